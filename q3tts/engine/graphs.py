"""CUDA-graph capture, shared by the runner's frames and prefills (`capture_runner`) and the vocoder's calls.

Each owner warms its functions up on a side stream (compilation, allocations, cuBLAS handles), then captures
them largest first into one shared memory pool with Python's cycle collector paused.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import torch

from ..kernels import MAX_ROWS
from ..sampling import SamplingParams
from .compile import compile_counts

OVERLAP_ENV = "Q3TTS_OVERLAP_CAPTURE"
log = logging.getLogger("q3tts.engine")


def want_overlap(device: torch.device, flag: bool | None = None) -> bool:
    """Whether the vocoder's start-up work runs on a thread beside the runner's (StartBeside): the flag, else
    $Q3TTS_OVERLAP_CAPTURE (1 / 0), else on for CUDA (where its CUDA graphs are made; a CPU has nothing to overlap)."""
    if flag is not None:
        return flag
    env = os.environ.get(OVERLAP_ENV, "").strip().lower()
    if env:
        return env not in ("0", "off", "false", "no")
    return device.type == "cuda"


class _Cancelled(Exception):
    """The engine's start failed before the handover: the thread stops there."""


class StartBeside:
    """A part of the engine's start-up on a thread of its own: `fn(handover)` starts at once on the device's thread
    (its warm-ups overlap this thread's work: on CUDA mostly cuDNN building convolution plans and kernels loading,
    which hold no GIL), and calls handover() before anything that must not run beside other launches (its CUDA-graph
    captures); handover() returns once this thread calls join() (which waits for fn's end and raises its error
    here), or raises _Cancelled after join(cancel=True).
    NOTE(overlap): so nothing captures while the other thread launches, syncs or frees: the two threads only overlap
    in eager work, and each thread's captures run with the other one waiting (the engine's in join, this one's before
    handover has returned). Warm-ups and captures of fn stay on one thread: PyTorch's cuDNN plan cache is per thread,
    so plans built by its warm-ups serve its captures.
    NOTE(keep-alive): once fn has returned the thread waits for release() (the engine's end) instead of ending: its
    thread-local cuDNN plans and attention graphs (some of them kernels compiled at run time) live as long as it does,
    and the graphs it captured may launch their kernels."""

    def __init__(self, fn: Callable[[Callable[[], None]], object], device: torch.device, name: str):
        self._go, self._done, self._released = threading.Event(), threading.Event(), threading.Event()
        self._cancel = False
        self.error: BaseException | None = None
        # seconds from the start: the thread at its handover ("handover"), join called ("join"), fn done ("done")
        self._t0, self.times = time.perf_counter(), {}
        self._fn = fn  # (held here, not by the thread, which outlives it: fn may hold what the engine's end frees)
        self._thread = threading.Thread(target=self._main, args=(device,), name=name, daemon=True)
        self._thread.start()

    def _main(self, device) -> None:
        fn, self._fn = self._fn, None
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                fn(self._handover)  # (the CUDA device is per thread: a new thread starts on device 0)
                del fn
        except _Cancelled:
            return
        except BaseException as e:  # noqa: BLE001 (any failure is the start's: join raises it on the engine's thread)
            self.error = e
            return
        finally:
            self.times["done"] = time.perf_counter() - self._t0
            self._done.set()
        self._released.wait()

    def _handover(self) -> None:
        self.times["handover"] = time.perf_counter() - self._t0
        self._go.wait()
        if self._cancel:
            raise _Cancelled

    def join(self, cancel: bool = False) -> None:
        """Let the thread go on past its handover and wait for its end; raise its error here (cancel: the start failed
        on this thread: the other stops at its handover and its own error, if any, is only logged)."""
        self._cancel = cancel
        self.times.setdefault("join", time.perf_counter() - self._t0)
        self._go.set()
        self._done.wait()  # fn's end (the thread itself stays: keep-alive)
        error, self.error = self.error, None  # raised once
        if error is not None and cancel:
            log.warning("%s also failed: %s: %s", self._thread.name, type(error).__name__, error)
        elif error is not None:
            raise error

    def release(self) -> None:
        """The thread may end (the engine whose graphs it captured is gone)."""
        self._released.set()


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


@torch.inference_mode()
def capture_runner(runner, before_capture: Callable[[], None] | None = None) -> int:
    """Capture one graph per (batch bucket up to the allocated rows, length bucket up to max_len, sampler) of a
    ModelRunner's frame, and one per padded prompt length of its single-request prefill. Must run while no request
    is active: the warm-up replays write into the rows they cover (all state is reset afterwards). before_capture:
    called between the warm-ups and the captures (StartBeside.join: the vocoder's thread finishes first)."""
    keys = runner.graph_keys()
    lens = runner.prefill_graph_lens
    # one warm-up frame per (batch bucket, sampler), at its shortest span: the spans share every compiled variant
    # (the span is a dynamic size), and each frame launched from Python is slow. Paged: every key (a longer span
    # compiled a variant of its own there, inside a capture)
    warm = {}
    for B, n, c in sorted(keys):
        warm.setdefault((B, c) if runner.block_table is None else (B, n, c), (B, n, c))
    with side_stream():
        runner.warm_up_frames(list(warm.values()))
        for L in lens:
            runner._prefill_into_scratch(L)
    if before_capture is not None:
        before_capture()
    compiled = compile_counts()
    with gc_paused():
        for key in sorted(keys, reverse=True):  # largest batch first: the shared pool is sized by it
            runner.graphs[key], _ = capture(lambda: runner._frame(*key), runner._pool)  # noqa: B023 (called at once)
            runner._pool = runner.graphs[key].pool()
        for L in lens:
            runner.prefill_graphs[L], _ = capture(lambda: runner._prefill_into_scratch(L), runner._pool)  # noqa: B023
    # a variant compiled inside a capture (a span that needed its own) is a bug: it ran no warm-up, and its kernels
    # were tuned while capturing
    now = compile_counts()
    runner.compiled_while_capturing = now["fx_hit"] + now["fx_miss"] - compiled["fx_hit"] - compiled["fx_miss"]
    if runner.compiled_while_capturing:
        log.warning("%d graphs compiled while capturing CUDA graphs", runner.compiled_while_capturing)
    # Batched prefills compile apart for 1 and >= 2 rows (and so do the samplers they call), and for <= and >
    # MAX_ROWS tokens in all (the skinny GEMM or cuBLAS): compile the four now, not while the first burst of
    # requests waits. Long prompts run uncompiled (eager_prefill).
    D, dev, dt = runner.cfg.hidden_size, runner.device, runner.dtype
    for n in (1, 2)[: runner.num_rows]:
        for L in (8, 5 * MAX_ROWS):
            runner.prefill_batch(0, [torch.zeros(L, D, device=dev, dtype=dt)] * n,
                                 [torch.zeros(2, D, device=dev, dtype=dt)] * n,
                                 [SamplingParams()] * n, graphs=n == 1)  # 2 rows: the batched forward
    # and a prompt past the last prefill graph's length, alone: its forward launched from Python straight into its
    # row, as each of a few (in batch-invariant mode, any number of) long newcomers runs
    L = max(lens, default=0) + 1
    if L < runner.max_len and runner.block_table is None and not runner.eager_prefill(1, L):
        runner.prefill_batch(0, [torch.zeros(L, D, device=dev, dtype=dt)], [torch.zeros(2, D, device=dev, dtype=dt)],
                             [SamplingParams()])
    torch.cuda.synchronize()
    runner.slots.reset()  # the warm-ups wrote garbage into free rows
    torch.cuda.empty_cache()  # the warm-ups' blocks (cached on their side stream, where nothing else reuses them)
    return len(runner.graphs)
