"""Streaming Code2Wav for many requests: one exact decoder state per request, batched per call.

Each request keeps its own `Code2WavState` (a batch of one). When several requests have a chunk due
with the same number of frames, their states are stacked into one batch, decoded together and split
again, so the vocoder runs a few batched launches per step instead of one per request (C5/C6:
ICL reference codes warm the state once and are never decoded again).
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch

from ..models.codec import Code2Wav, Code2WavState, SnakeBeta


def stack_states(states: list[Code2WavState]) -> Code2WavState:
    if len(states) == 1:
        return states[0]
    return Code2WavState([torch.cat(ts, 0) for ts in zip(*(s.tails for s in states))],
                         torch.cat([s.keys for s in states], 1), torch.cat([s.values for s in states], 1),
                         torch.cat([s.pos for s in states], 0), sum(s.frames_processed for s in states))


def split_state(state: Code2WavState, n: int) -> list[Code2WavState]:
    if n == 1:
        return [state]
    return [state.select_rows(torch.tensor([i], device=state.pos.device)) for i in range(n)]


def compile_snakes(code2wav: Code2Wav) -> None:
    """torch.compile the SnakeBeta activations (29 per call, five elementwise kernels each -> one)."""
    fwd = torch.compile(SnakeBeta.forward, dynamic=True, fullgraph=True)
    for m in code2wav.modules():
        if isinstance(m, SnakeBeta) and not isinstance(m.forward, functools.partial):
            m.forward = functools.partial(fwd, m)


class StreamingVocoder:
    def __init__(self, code2wav: Code2Wav, compile: bool = False):
        self.code2wav = code2wav
        p = next(code2wav.parameters())
        self.device, self.dtype = p.device, p.dtype
        if compile:
            compile_snakes(code2wav)
            # the compiled activations specialise on sizes 1 vs >= 2 (rows, samples): compile those now, not
            # while a burst of requests waits for its first audio
            for rows in (1, 2):
                for t in (1, 2):
                    codes = torch.zeros(rows, code2wav.cfg.num_quantizers, t, dtype=torch.long, device=self.device)
                    self.code2wav.decode_step(codes, code2wav.init_state(rows, self.device, self.dtype))

    def new_state(self, ref_codes: torch.Tensor | None) -> Code2WavState:
        """A fresh state for one request, warmed with its ICL reference codes [T, K] if any."""
        state = self.code2wav.init_state(1, self.device, self.dtype)
        if ref_codes is not None and ref_codes.shape[0] > 0:
            state = self.code2wav.warm(ref_codes.T[None].to(self.device), state)
        return state

    @torch.inference_mode()
    def decode(self, work: list[tuple[Code2WavState, torch.Tensor]]) -> list[tuple[torch.Tensor, Code2WavState]]:
        """work: (state, codes [t, K]) per request -> (wav [t*1920] float32 CPU, new state), batched by t."""
        out: list = [None] * len(work)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, (_, codes) in enumerate(work):
            groups[codes.shape[0]].append(i)
        for idx in groups.values():
            state = stack_states([work[i][0] for i in idx])
            codes = torch.stack([work[i][1].T for i in idx]).to(self.device)  # [n, K, t]
            wav, state = self.code2wav.decode_step(codes, state)
            wav = wav.float().cpu()
            for j, (i, s) in enumerate(zip(idx, split_state(state, len(idx)))):
                out[i] = (wav[j], s)
        return out
