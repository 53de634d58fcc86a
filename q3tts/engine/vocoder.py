"""Streaming Code2Wav for many requests: every request's exact decoder state is one row of a pool.

A streaming request holds a pool row from admission to its last chunk. The chunks due in a step decode
in a few batched calls:
  - a chunk of n frames is cut into power-of-two pieces, largest first (13 -> 8, 4, 1). The decoder is
    causal at frame granularity, so any cut gives the same audio (q3tts.models.codec: decode_step);
  - a stream's final chunk (its row's state is never read again) is instead padded up to whole pieces (13 -> 16:
    13 frames and 3 frames of code 0 whose audio is dropped): one call that same-size pieces of other streams
    share, instead of a call per piece size (`final_pieces`). Causality keeps its 13 frames' audio; the cut
    depends only on the chunk, so the bits do not depend on the load;
  - the pieces of one size from different requests run together: their rows are gathered from the
    pool, decoded by `Code2Wav.decode_step`, and scattered back, at most max_call_frames rows x frames per
    call (more take several calls), which bounds the workspace whatever the number of streams;
  - on CUDA each (rows bucket, piece size) call is one CUDA graph with the gather and the scatter inside,
    replayed with padding rows that all point at a scratch row. One replay instead of several hundred
    small launches per call (the eager vocoder is launch-bound, bench/probe.py). A replay still costs about its
    kernels' count in launch gaps, so where the engine compiles, the pre-transformer's layers run compiled
    (`compiled`): their elementwise glue fused, fewer kernels per replay.
ICL reference codes warm a request's row once at admission (decoded through it as a chunk whose audio is dropped) and
are never decoded again (C5/C6). The warmed state is a pure function of the reference, so it is kept per reference
(LRU, WARM_CACHE_BYTES): the requests of a stored voice copy it into their rows instead of each decoding it again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, defaultdict
from collections.abc import Iterator

import numpy as np
import torch

from .. import invariant
from ..hostcopy import ints_to_device
from ..models.codec import Code2Wav, Code2WavState
from .compile import compile_codec
from .graphs import capture, gc_paused, side_stream
from .turn import device_wait

WARM_CACHE_BYTES = 64 << 20  # the warmed ICL states kept, in bytes: a few dozen references' one-row states


def pieces(n: int, max_piece: int) -> list[int]:
    """n frames as power-of-two pieces of at most max_piece (a power of two), largest first."""
    out = []
    while n > 0:
        p = min(max_piece, 1 << (n.bit_length() - 1))
        out.append(p)
        n -= p
    return out


def final_pieces(n: int, max_piece: int) -> list[int]:
    """A stream's final n frames as whole max_piece pieces, then the rest padded up to one power of two (13, 16 ->
    [16]; 40, 16 -> [16, 16, 8]): their sum may exceed n, by less than the last piece."""
    rest = n % max_piece
    return [max_piece] * (n // max_piece) + ([1 << (rest - 1).bit_length()] if rest else [])


def cut(chunks: list[int], final: bool, max_piece: int) -> list[int]:
    """One request's pieces: each of its chunks (frames) cut on its own, its last by `final_pieces` if it ends the
    stream."""
    last = len(chunks) - 1
    return [p for k, n in enumerate(chunks) for p in (final_pieces if final and k == last else pieces)(n, max_piece)]


def call_rows(max_rows: int, max_piece: int, max_call_frames: int) -> dict[int, int]:
    """Piece size -> the most requests one call decodes: a power of two, at most max_call_frames rows x frames and the
    rows bucket that holds max_rows."""
    top = 1 << (max_rows - 1).bit_length()
    return {1 << i: min(top, max_call_frames >> i) for i in range(max_piece.bit_length())}


def calls(cuts: list[list[int]], call_rows: dict[int, int]) -> Iterator[tuple[int, list[int]]]:
    """The calls that decode requests cut into `cuts` (their pieces, in order), as (piece size, the requests): round j
    takes every request's j-th piece, and within a round pieces of one size share calls of at most call_rows[size]
    requests."""
    for j in range(max(map(len, cuts), default=0)):
        groups: dict[int, list[int]] = defaultdict(list)  # piece size -> requests
        for i, pcs in enumerate(cuts):
            if j < len(pcs):
                groups[pcs[j]].append(i)
        for size, group in groups.items():
            step = call_rows[size]
            yield from ((size, group[a: a + step]) for a in range(0, len(group), step))


class StreamingVocoder:
    """Args:
        code2wav: the decoder (its device and dtype are the pool's).
        max_rows: concurrent streams (the engine's max_slots).
        use_graphs: capture one CUDA graph per (rows bucket, piece size) in `capture_graphs`.
        max_piece: the largest piece, a power of two (chunks longer than it take several calls).
        max_call_frames: rows x frames of one call at most (a power of two >= max_piece): bounds the workspace
            (~6 MiB per row-frame in bf16, measured) and the largest CUDA graph's pool.
        compiled: the decoder's pre-transformer layers compiled for these calls (q3tts.engine.compile.compile_codec;
            the module stays eager); the warm-up compiles their variants.
    """

    def __init__(self, code2wav: Code2Wav, max_rows: int, use_graphs: bool = False, max_piece: int = 16,
                 max_call_frames: int = 64, compiled: bool = False):
        assert max_piece & (max_piece - 1) == 0, "max_piece must be a power of two"
        assert max_call_frames & (max_call_frames - 1) == 0 and max_call_frames >= max_piece
        self.code2wav, self.max_rows, self.max_piece = code2wav, max_rows, max_piece
        # piece size -> the most rows one call decodes (a power of two).
        # NOTE(invariant): batch-invariant mode (as it is at the build) decodes each request's piece in a call of its
        # own (cuBLAS and cuDNN's attention choose their kernels, and with them the sums' order, by the number of
        # rows), so only one-row calls are captured
        self.call_rows = {size: 1 if invariant.ENABLED else most
                          for size, most in call_rows(max_rows, max_piece, max_call_frames).items()}
        p = next(code2wav.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.K = code2wav.cfg.num_quantizers
        self.scratch = max_rows  # the padding rows of a replay read and write this row only
        self.pool: Code2WavState = code2wav.init_state(max_rows + 1, self.device, self.dtype)
        self.free_rows = list(range(max_rows - 1, -1, -1))  # pop() gives the lowest
        self.use_graphs = use_graphs
        self.layer = compile_codec(self.device.type == "cuda") if compiled else None  # its layers' forward, or None
        # (rows bucket, piece) -> (graph, static row index [R], static codes [R, K, piece], wav out [R, piece*1920])
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.warmed: OrderedDict[bytes, tuple[Code2WavState, int]] = OrderedDict()  # reference -> (state, bytes), LRU
        self.warmed_bytes = 0

    # ------------------------------------------------------------------ rows
    @torch.inference_mode()
    def open(self, ref_codes: list[torch.Tensor | None]) -> list[int]:
        """Fresh rows for new requests, each warmed with its ICL reference codes [T, K] if any."""
        assert len(ref_codes) <= len(self.free_rows), "more streams than vocoder rows"
        if not ref_codes:
            return []
        rows = [self.free_rows.pop() for _ in ref_codes]
        idx = ints_to_device(rows, self.device)  # an asynchronous copy (a pageable one waits for the device)
        self.pool.assign_rows_(idx, self.code2wav.init_state(len(rows), self.device, self.dtype))
        for j, (row, ref) in enumerate(zip(rows, ref_codes)):
            if ref is not None and ref.shape[0] > 0:
                self._warm(row, idx[j:j + 1], ref)
        return rows

    def _warm(self, row: int, idx: torch.Tensor, ref: torch.Tensor) -> None:
        """Fresh row `row` (idx: it on the device) := its state after the reference codes ref [T, K]. The first request
        of a reference decodes it through the row as a chunk of T frames (the pieces and, on CUDA, the captured graphs
        of any chunk: no eager launches, no new shapes), its audio dropped; the state is then kept (a pure function of
        the codes) and the reference's later requests copy it into their rows."""
        host = ref if ref.device.type == "cpu" else ref.cpu()
        key = hashlib.blake2b(f"{tuple(host.shape)}{host.dtype}".encode() + host.contiguous().numpy().tobytes(),
                              digest_size=16).digest()
        kept = self.warmed.get(key)
        if kept is not None:
            self.warmed.move_to_end(key)
            self.pool.assign_rows_(idx, kept[0])
            return
        self.decode([(row, ref)])
        state = self.pool.select_rows(idx)  # a copy (indexing), not a view of the pool
        size = sum(t.nbytes for t in (*state.tails, state.keys, state.values, state.pos))
        self.warmed[key] = (state, size)
        self.warmed_bytes += size
        while self.warmed_bytes > WARM_CACHE_BYTES and len(self.warmed) > 1:  # the least recently used go first
            self.warmed_bytes -= self.warmed.popitem(last=False)[1][1]

    def close(self, row: int) -> None:
        self.free_rows.append(row)
        self.free_rows.sort(reverse=True)

    def _run(self, idx: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """idx [R] pool rows, codes [R, K, t] -> wav [R, t*1920]; the rows advance by t frames."""
        wav, state = self.code2wav.decode_step(codes, self.pool.select_rows(idx), self.layer)
        self.pool.assign_rows_(idx, state)
        return wav

    # ------------------------------------------------------------------ decoding
    @torch.inference_mode()
    def decode(self, work: list[tuple[int, torch.Tensor | list[torch.Tensor]]],
               sizes: list[list[int]] | None = None, final: list[bool] | None = None) -> list[np.ndarray]:
        """work: (row, codes) per request, codes its n frames as [n, K] int64 or as n frames [K] (the engine's, as
        sampled: gathered per call, not per request) -> wav [n*1920] float32 per request. sizes: per request, the
        stream chunks its n frames hold, in order (summing to n; default one chunk): each is cut into pieces on its
        own, so frames decode in the same pieces however the chunks are grouped into calls (the same bits).
        final: per request, whether its last chunk ends its stream (its row is closed after it, its state never
        read): that chunk is cut by `final_pieces`, padded with frames of code 0 whose audio is dropped.

        Round j decodes every request's j-th piece; within a round, pieces of one size share a call."""
        if not work:
            return []
        sizes = sizes or [[len(codes)] for _, codes in work]
        final = final or [False] * len(work)
        starts = [0] * len(work)
        parts: list[list[torch.Tensor]] = [[] for _ in work]  # per request: its pieces' audio on the device
        cuts = [cut(ns, last, self.max_piece) for ns, last in zip(sizes, final)]
        for size, items in calls(cuts, self.call_rows):  # (one row per call in batch-invariant mode)
            frames = []  # n * size x [K]: each request's next `size` frames, a final piece padded with code 0
            for i in items:
                own = list(work[i][1][starts[i]: starts[i] + size])
                frames += own + [own[0].new_zeros(own[0].shape)] * (size - len(own))
            codes = torch.stack(frames).view(len(items), size, -1).transpose(1, 2).contiguous()  # [n, K, size]
            wav = self._call([work[i][0] for i in items], codes)
            for k, i in enumerate(items):
                real = min(size, len(work[i][1]) - starts[i])  # (< size: a final piece's padding dropped)
                parts[i].append(wav[k, :real * self.code2wav.total_upsample])
                starts[i] += real
        flat = torch.cat([p for ps in parts for p in ps])
        with device_wait():
            flat = flat.cpu()  # the one sync of the call
        return [w.numpy() for w in flat.split([len(codes) * self.code2wav.total_upsample for _, codes in work])]

    def _call(self, rows: list[int], codes: torch.Tensor) -> torch.Tensor:
        """rows: n pool rows, codes [n, K, t] (CPU) -> wav [n, t*1920] float32 on the device (a copy: a graph's
        output is overwritten by its next replay)."""
        n, t = codes.shape[0], codes.shape[2]
        R = 1 << (n - 1).bit_length()  # the rows bucket
        entry = self.graphs.get((R, t)) if self.use_graphs else None
        if entry is None:
            if self.use_graphs:
                raise RuntimeError(f"no vocoder graph for {n} rows x {t} frames: call capture_graphs() first")
            wav = self._run(torch.tensor(rows, device=self.device), codes.to(self.device))
            return wav.to(torch.float32, copy=True)
        graph, idx, codes_in, wav = entry
        idx.copy_(torch.tensor(rows + [self.scratch] * (R - n)))
        codes_in[:n].copy_(codes)
        graph.replay()
        return wav[:n].to(torch.float32, copy=True)

    # ------------------------------------------------------------------ CUDA graphs
    def _graph_inputs(self) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """(rows bucket up to call_rows[piece], piece size up to max_piece) -> static (row index [R] on the scratch
        row, codes [R, K, piece]): one CUDA graph each."""
        keys = [(1 << j, p) for p, rows in self.call_rows.items() for j in range(rows.bit_length())]
        return {k: (torch.full((k[0],), self.scratch, device=self.device),
                    torch.zeros(k[0], self.K, k[1], dtype=torch.long, device=self.device)) for k in keys}

    @torch.inference_mode()
    def warm_up(self, static: dict | None = None) -> None:
        """The runs before a capture (Triton kernels' specializations, cuDNN/cuBLAS plans), on a side stream, writing
        only the scratch row: per piece size at one row and at its most rows only (the row counts in between share
        their Triton specializations, which depend on the piece size only; each run is a decoder pass launched from
        Python). A compile helper runs them too, so the engine's process finds the Triton kernels in the cache."""
        static = static or self._graph_inputs()
        with side_stream():
            for k in sorted(k for k in static if k[0] in (1, self.call_rows[k[1]])):
                self._run(*static[k])

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """One graph per (rows bucket, piece size) (_graph_inputs), sharing one memory pool, after the warm-up."""
        if not self.use_graphs:
            return 0
        static = self._graph_inputs()
        self.warm_up(static)
        pool = None
        with gc_paused():
            for k in sorted(static, reverse=True):  # the largest first: the shared pool is sized by it
                g, wav = capture(lambda: self._run(*static[k]), pool)  # noqa: B023 (called at once)
                pool = g.pool()
                self.graphs[k] = (g, *static[k], wav)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-ups' blocks (cached on their side stream, where nothing else reuses them)
        return len(self.graphs)
