"""A test's own loop over an Engine it alone owns: step it by hand until its requests are done (the product's one
loop is q3tts.engine.AsyncEngine; tests step by hand to control what each step holds)."""

import torch

from q3tts.engine.engine import AudioChunk, Engine
from q3tts.engine.request import EngineRequest


def run_to_completion(eng: Engine, reqs: list[EngineRequest]) -> list[AudioChunk]:
    chunks = []
    while any(not r.status.finished for r in reqs):
        if eng.wait_for_work():  # else only streamed text can move it on
            chunks += eng.step()
    return chunks


def generate_codes(eng: Engine, prepared) -> list[torch.Tensor]:
    """Codes [T_i, K] (CPU) of each prepared request."""
    reqs = [eng.add_request(p) for p in prepared]
    run_to_completion(eng, reqs)
    return [torch.stack(r.frames).cpu() if r.frames else torch.zeros(0, eng.runner.K, dtype=torch.long) for r in reqs]
