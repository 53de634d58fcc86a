"""Offline generation: a batch of requests decoded together until each one stops.

A request stops when it samples EOS (allowed from its third code on) or when it has sampled
`max_new_tokens` codes; as upstream, the code 0 sampled last is dropped, so at most
max_new_tokens - 1 frames come out. Rows finish independently; a finished row is simply left out of
the next frame, so nothing of it can leak into the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams
from .runner import ModelRunner


@dataclass(slots=True)
class Request:
    prefill: torch.Tensor  # [L, D] prompt embeddings
    trailing: torch.Tensor  # [S, D] text fed one per frame
    params: SamplingParams
    codes: list[torch.Tensor] = field(default_factory=list)  # frames so far, each [K]
    done: bool = False


def generate_codes(runner: ModelRunner, requests: list[Request], on_frame=None) -> list[torch.Tensor]:
    """Returns each request's codes [T_i, K] (int64, CPU). on_frame(i, codes[K]) is called per frame."""
    eos = runner.cfg.codec_eos_token_id
    active: list[int] = []
    for slot, r in enumerate(requests):
        code0 = runner.prefill(slot, r.prefill, r.trailing, r.params)
        r.done = code0 == eos or r.params.max_new_tokens <= 1
        if not r.done:
            active.append(slot)
    while active:
        out = runner.decode_frame(torch.tensor(active, device=runner.device))
        codes, nxt = out.codes.cpu(), out.next_code0.tolist()
        still = []
        for row, slot in enumerate(active):
            r = requests[slot]
            r.codes.append(codes[row])
            if on_frame is not None:
                on_frame(slot, codes[row])
            if not (nxt[row] == eos or len(r.codes) + 1 >= r.params.max_new_tokens):
                still.append(slot)
        active = still
    K = runner.K
    return [torch.stack(r.codes) if r.codes else torch.zeros(0, K, dtype=torch.long) for r in requests]
