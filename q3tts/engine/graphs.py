"""CUDA-graph capture, shared by the runner's frames and prefills (`capture_runner`) and the vocoder's calls.

Each owner warms its functions up on a side stream (compilation, allocations, cuBLAS handles), then captures
them largest first into one shared memory pool with Python's cycle collector paused.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
from collections.abc import Callable, Iterator

import torch

from ..sampling import SamplingParams
from .compile import compile_counts
from .compile_helpers import Helpers, Source

log = logging.getLogger("q3tts.engine")


@contextlib.contextmanager
def gc_paused(collect: bool = True) -> Iterator[None]:
    """Python's cycle collector paused for a loop of CUDA-graph captures, after one collection (collect=False: none,
    for a capture beside running streams: a collection holds the interpreter, and their steps wait for it).
    - Paused: a collection during a capture can free an engine dropped earlier, whose graphs then reset mid-capture
      and invalidate it (seen in the GPU tests, which build engine after engine in one process).
    - Once per loop, not per capture: with Dynamo and Inductor loaded a collection is slow, and a start-up captures
      about a hundred graphs."""
    enabled = gc.isenabled()
    if collect:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def side_stream() -> Iterator[None]:
    """Warm-ups before a capture run on a side stream that the current stream then waits for."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def capture(fn: Callable[[], object], pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """One CUDA graph of fn() in the memory pool `pool` (None: a new one) -> (graph, fn's result)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out


def capture_beside(fn: Callable[[], object], pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """capture, while other threads go on launching (the forced aligner's worker beside the engine's steps).
    torch.cuda.graph first synchronizes the device and empties the allocator's cache, whose cudaFree waits for every
    stream: the running streams' steps would stop behind it. Here neither; the capture's errors are this thread's only
    (thread_local), so launches of other threads meanwhile are allowed."""
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        g.capture_begin(pool, capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return g, out


def warm_ups(runner) -> list[tuple[str, Callable[[], object]]]:
    """The runner's warm-up calls, named, in the order capture_runner runs them: a frame per (batch bucket, sampler)
    ('frame 4 capped'), a prefill per padded prompt length ('prefill 32'), a wave per wave key ('wave 16x64'), then
    the batched prefill of two rows ('batch 2') and a prompt past the last prefill graph's length ('long 257'), which
    run after the captures. Each compiles what it is the first of its shape to need (compile_helpers.shape_class)."""
    keys, lens = runner.graph_keys(), runner.prefill_graph_lens
    # one warm-up frame per (batch bucket, sampler), at its shortest span: the spans share every compiled variant
    # (the span is a dynamic size), and each frame launched from Python is slow. Paged: every key (a longer span
    # compiled a variant of its own there, inside a capture)
    warm = {}
    for B, n, c in sorted(keys):
        warm.setdefault((B, c) if runner.block_table is None else (B, n, c), (B, n, c))
    units = [(f"frame {B} {'capped' if c else 'full'}" + (f" {n}" if runner.block_table is not None else ""),
              functools.partial(runner.warm_up_frames, [(B, n, c)])) for B, n, c in warm.values()]
    units += [(f"prefill {L}", functools.partial(runner._prefill_one, L)) for L in lens]
    units += [(f"wave {N}x{L}", functools.partial(runner._prefill_wave, N, L)) for N, L in runner.wave_keys()]
    # Batched prefills compile apart for 1 and >= 2 rows (and so do the samplers they call; any number of tokens
    # shares one variant: kernels.rows_linear chooses the skinny GEMM or cuBLAS when it runs). One row replays its
    # prefill graph after the captures (compiled apart only without them: a paged cache); long prompts run uncompiled
    # (eager_prefill)
    if runner.num_rows >= 2:
        units.append(("batch 2", functools.partial(_prefill_batch, runner, 2, 32)))
    # and a prompt past the last prefill graph's length, alone: its forward launched from Python straight into its
    # row, as each of a few (in batch-invariant mode, any number of) long newcomers runs
    L = max(lens, default=0) + 1
    if L < runner.max_len and runner.block_table is None and not runner.eager_prefill(1, L):
        units.append((f"long {L}", functools.partial(_prefill_batch, runner, 1, L)))
    return units


def _prefill_batch(runner, n: int, L: int) -> None:
    """n zero prompts of L tokens through prefill_batch into rows [0, n) (one row: its prefill graph if captured;
    more: the batched forward)."""
    D, dev, dt = runner.cfg.hidden_size, runner.device, runner.dtype
    runner.prefill_batch(0, [torch.zeros(L, D, device=dev, dtype=dt)] * n,
                         [torch.zeros(2, D, device=dev, dtype=dt)] * n, [SamplingParams()] * n, graphs=n == 1)


@torch.inference_mode()
def capture_runner(runner, source: Source | None = None) -> int:
    """Capture a ModelRunner's graphs: one per (batch bucket up to the allocated rows, length bucket up to max_len,
    sampler) of a frame's talker half and one per (batch bucket, sampler) of its code-predictor half, one per padded
    prompt length of its single-request prefill and one per (wave size, padded length) of its batched prefill. Must
    run while no request is active: the warm-up replays write into the rows they cover (all state is reset
    afterwards). source: where the runner's checkpoint came from, for compile helpers on a cold start
    (q3tts.engine.compile_helpers; None: none)."""
    keys, lens = runner.graph_keys(), runner.prefill_graph_lens
    units = warm_ups(runner)
    after = [u for u in units if u[0].startswith(("batch", "long"))]  # (they run after the captures)
    before = [u for u in units if u not in after]
    helpers = Helpers(source, runner, [name for name, _ in units])
    try:
        with side_stream():
            for _, fn in helpers.in_turn(before):
                fn()
        compiled = compile_counts()
        with gc_paused():
            for key in sorted(runner.wave_keys(), reverse=True):  # the most tokens first: the pool sized by them
                runner.wave_graphs[key], _ = capture(lambda: runner._prefill_wave(*key), runner._pool)  # noqa: B023
                runner._pool = runner.wave_graphs[key].pool()
            # largest batch first: the shared pool is sized by it. A frame replays its two halves back to back on one
            # stream, so their temporaries may share the pool's blocks as any two graphs' do
            for key in sorted(runner.code_graph_keys(), reverse=True):
                runner.code_graphs[key], _ = capture(lambda: runner._frame_codes(*key), runner._pool)  # noqa: B023
                runner._pool = runner.code_graphs[key].pool()
            for key in sorted(keys, reverse=True):
                runner.graphs[key], _ = capture(lambda: runner._frame_talker(*key), runner._pool)  # noqa: B023
                runner._pool = runner.graphs[key].pool()
            for L in lens:
                runner.prefill_graphs[L], _ = capture(lambda: runner._prefill_one(L), runner._pool)  # noqa: B023
        # a variant compiled inside a capture (a span that needed its own) is a bug: it ran no warm-up, and its
        # kernels were tuned while capturing
        now = compile_counts()
        runner.compiled_while_capturing = now["fx_hit"] + now["fx_miss"] - compiled["fx_hit"] - compiled["fx_miss"]
        if runner.compiled_while_capturing:
            log.warning("%d graphs compiled while capturing CUDA graphs", runner.compiled_while_capturing)
        # one row's batched prefill (its prefill graph; compiled apart where there are none), then the rest
        _prefill_batch(runner, 1, 32)
        for _, fn in helpers.in_turn(after):
            fn()
        torch.cuda.synchronize()
    finally:
        helpers.stop()
    runner.slots.reset()  # the warm-ups wrote garbage into free rows
    torch.cuda.empty_cache()  # the warm-ups' blocks (cached on their side stream, where nothing else reuses them)
    return runner.num_frame_graphs
