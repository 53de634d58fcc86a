"""The engine's start with the vocoder's warm-ups beside the runner's (q3tts.engine.graphs.StartBeside) on a GPU: the
same CUDA graphs and the same streamed audio as the start one after the other (GPU only: `gpu` marker)."""

import numpy as np
import pytest
import torch

from q3tts import TTS
from q3tts.engine.engine import Engine
from q3tts.engine.request import StreamOptions
from tests.engine.steps import run_to_completion
from tests.golden import fixtures as fx

pytestmark = pytest.mark.gpu


def test_overlapped_start_captures_the_same_graphs_and_streams_the_same_audio():
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cuda", dtype=torch.float32)
    prepared = [tts.prepare_custom_voice(t, s, "English", do_sample=False, subtalker_dosample=False,
                                         max_new_tokens=30)[0]
                for t, s in (("The first stream.", "vivian"), ("A second one, a little longer.", "ryan"),
                             ("Third.", "serena"))]
    out = {}
    for overlap in (True, False):
        eng = Engine(tts.ckpt, max_slots=4, max_seq_len=256, overlap_capture=overlap)
        assert eng.runner.compiled_while_capturing == 0
        keys = (sorted(eng.runner.graphs), sorted(eng.runner.prefill_graphs), sorted(eng.vocoder.graphs))
        eng_reqs = [eng.add_request(p, StreamOptions(1, 4)) for p in prepared]
        chunks = run_to_completion(eng, eng_reqs)
        audio = {r.request_id: np.concatenate([c.audio for c in chunks if c.request_id == r.request_id])
                 for r in eng_reqs}
        out[overlap] = keys, [torch.stack(r.frames).cpu() for r in eng_reqs], list(audio.values())
        del eng
    (k1, c1, a1), (k0, c0, a0) = out[True], out[False]
    assert k1 == k0
    assert all(torch.equal(x, y) for x, y in zip(c1, c0))
    for x, y in zip(a1, a0):  # the same graphs replayed: the same kernels (fp32)
        assert x.shape == y.shape and np.abs(x - y).max() <= 1e-6
