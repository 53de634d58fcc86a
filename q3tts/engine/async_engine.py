"""The one loop over an Engine: a background thread drives Engine.step(); every consumer submits through it.

Only `_loop` steps the engine and iterates over step outputs; each request has a sink fed from that thread: an
asyncio.Queue for the server (`submit`, `generate`), a queue.Queue for blocking callers (`submit_blocking`,
`generate_codes`: the Python API). One AsyncEngine per Engine (`AsyncEngine.of`), so the API and the server share
the loop. Cancelling a consumer (client disconnect, leaving a stream early) aborts its request, which frees its slot
at the next step. A request's text may be streamed in (`TextFeed`): pieces from an iterable, sync or async, read
while audio is made. A step that raises fails only the requests it held (Engine.step finishes them; their consumers
get the exception); queued ones go on.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from ..inputs.request import PreparedRequest
from .engine import AudioChunk, Engine, EngineCounters
from .request import EngineRequest, StreamOptions

_OWNER_LOCK = threading.Lock()
_yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))  # gives up the GIL and the core (Windows: none)
_RUNNING: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Loops still running at exit end before the interpreter finalizes: a daemon thread stopped inside a torch call
    then aborts the process."""
    for owner in list(_RUNNING):
        owner.shutdown()


def step_stream(device: torch.device) -> torch.cuda.Stream | None:
    """For an engine whose GPU other work shares (the server's forced aligner worker, on its own stream of default
    priority): on CUDA a stream of priority above the default's (CUDA: lower is higher, 0 the default) for
    `AsyncEngine.step_stream`, so the block scheduler starts a step's kernels before the other stream's queued ones
    and a step waits at most for blocks already running. None elsewhere."""
    return torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None


@dataclass(slots=True)
class EngineStats:
    queue_depth: int
    active_slots: int
    max_slots: int
    counters: EngineCounters  # the live object: read it, do not change it


@dataclass(slots=True, frozen=True)
class LoopSink:
    """An asyncio consumer's queue, filled on its event loop (AsyncEngine._drain)."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """The owner of an Engine's steps. Build it with `AsyncEngine.of(engine)`: a second live owner of one engine
    is refused (two threads stepping one engine would corrupt its state)."""

    def __init__(self, engine: Engine):
        with _OWNER_LOCK:
            owner = getattr(engine, "owner", None)
            if owner is not None and owner.running():
                raise RuntimeError("this engine is stepped by another AsyncEngine already: use AsyncEngine.of(engine)")
            engine.owner = self
        self.engine = engine
        self._sinks: dict[str, Callable[[object], None] | LoopSink] = {}  # request id -> where its chunks go
        # items for asyncio consumers not yet taken by their event loop (`_deliver`, `_drain`), under _pending_lock
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        self._pending_lock = threading.Lock()
        self._offline: dict[str, EngineRequest] = {}  # offline requests (no chunks): delivered once finished
        self._stop = False
        self.last_error: str | None = None  # last step failure (a device assert poisons the CUDA context)
        # the stream the loop steps on (None: the thread's current one); `step_stream(device)` where other work shares
        # the GPU
        self.step_stream: torch.cuda.Stream | None = None
        # NOTE(compile): in the creator's context: torch keeps Dynamo's and Inductor's settings per context from 2.13
        # on, so a bare thread would trace its compilations under torch's defaults, not compile_layers' settings
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._loop,), name="q3tts-engine",
                                        daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    @classmethod
    def of(cls, engine: Engine) -> AsyncEngine:
        """The engine's running owner, or a new one."""
        with _OWNER_LOCK:
            owner = getattr(engine, "owner", None)
            if owner is not None and owner.running():
                return owner
        return cls(engine)

    def running(self) -> bool:
        return self.is_alive() and not self._stop

    def stats(self) -> EngineStats:
        s = self.engine.scheduler
        return EngineStats(s.queue_depth, s.num_running, s.max_slots, self.engine.counters)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def healthy(self) -> bool:
        """False once it cannot serve: its thread stopped, or a CUDA error poisoned the device context (every later
        step would fail too). A failed step of another kind fails only the requests it held."""
        return self.is_alive() and not (self.last_error and "CUDA" in self.last_error)

    def stop(self) -> None:
        """Let the loop end after its current step (without waiting for it)."""
        self._stop = True
        self.engine.wake.set()

    def shutdown(self) -> None:
        self.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.wait_for_work():
                continue
            try:
                chunks = self._step()
            except Exception as e:  # a bug or device error: fail the requests the step held, keep serving
                self.last_error = f"{type(e).__name__}: {e}"
                for rid in self.engine.failed_ids:
                    self._offline.pop(rid, None)
                    self._deliver(rid, e)
                continue
            woken: list[asyncio.AbstractEventLoop] = []  # the event loops this step's items wake, once each
            for c in chunks:
                self._deliver(c.request_id, c, woken)
            done = [rid for rid, r in self._offline.items() if r.status.finished]
            for rid in done:
                self._deliver(rid, self._offline.pop(rid), woken)
            for loop in woken:
                self._wake(loop)
            if chunks or done:
                # NOTE(handoff): a consumer woken by a delivery needs the GIL and a core, which this thread, going on
                # into the next step, holds until it blocks (a device sync) or is made to switch: give both up once
                _yield_cpu()

    def _step(self) -> list[AudioChunk]:
        stream = self.step_stream
        if stream is None:
            return self.engine.step()
        # NOTE(priority): what other threads queued on the default stream before handing it over (a voice's
        # embedding or reference codes made while preparing a request) is ordered before this step; the step's own
        # results reach other threads only after its host syncs (codes, audio)
        stream.wait_stream(torch.cuda.default_stream(stream.device))
        with torch.cuda.stream(stream):
            return self.engine.step()

    def _deliver(self, request_id: str, item: object, woken: list | None = None) -> None:
        """To a blocking sink at once; to an event loop through one callback (`_drain`) per wake-up, which takes every
        item delivered since: a step's many chunks wake it once (woken: the loops to wake once the step's items are all
        in, the caller's; None: at once), not once each, whose wake-ups would each contend with this thread for the
        GIL. Items that come while a callback is pending ride along in it."""
        sink = self._sinks.get(request_id)
        if type(sink) is not LoopSink:
            if sink is not None:
                sink(item)
            return
        loop = sink.loop
        with self._pending_lock:
            items = self._pending.get(loop)
            wake = items is None
            if wake:
                items = self._pending[loop] = []
            items.append((sink.queue, item))
        if wake:
            if woken is None:
                self._wake(loop)
            else:
                woken.append(loop)

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_soon_threadsafe(self._drain, loop)
        except RuntimeError:  # the consumers' loop is closed: nobody reads these
            with self._pending_lock:
                self._pending.pop(loop, None)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the consumers' loop: every item delivered to it since its wake-up, in order."""
        with self._pending_lock:
            items = self._pending.pop(loop, ())
        for q, item in items:
            q.put_nowait(item)

    def _add(self, prepared: PreparedRequest, stream: StreamOptions | None, request_id: str | None,
             arrival_time: float | None, sink: Callable[[object], None] | LoopSink) -> EngineRequest:
        """Queue a request whose outputs go to sink (registered before the loop can see the request)."""
        rid = request_id or self.engine.new_request_id()
        self._sinks[rid] = sink
        try:
            req = self.engine.add_request(prepared, stream, rid, arrival_time, before_queue=(
                None if stream is not None else lambda r: self._offline.__setitem__(rid, r)))
        except BaseException:
            self._sinks.pop(rid, None)
            self._offline.pop(rid, None)
            raise
        return req

    def submit(self, prepared, stream: StreamOptions | None = None, request_id: str | None = None,
               arrival_time: float | None = None) -> RequestHandle:
        """Queue a request now (QueueFullError / ValueError at once); its chunks come from handle.chunks()."""
        self.engine.turn.wait()  # a burst's arrivals leave a step's host work its interpreter (q3tts.engine.turn)
        q: asyncio.Queue = asyncio.Queue()
        req = self._add(prepared, stream or StreamOptions(), request_id, arrival_time,
                        LoopSink(asyncio.get_running_loop(), q))
        return RequestHandle(self, req.request_id, q)

    def submit_blocking(self, prepared: PreparedRequest, stream: StreamOptions | None = None,
                        arrival_time: float | None = None, q: queue.Queue | None = None,
                        request_id: str | None = None) -> BlockingHandle:
        """As submit, for a caller outside asyncio (the Python API): its outputs go to q (default a new queue; several
        requests may share one). stream=None queues an offline request (codes only), whose handle.wait() returns it
        once finished."""
        q = queue.Queue() if q is None else q
        req = self._add(prepared, stream, request_id, arrival_time, q.put)
        return BlockingHandle(self, req, q)

    def generate_codes(self, prepared: list[PreparedRequest]) -> list[torch.Tensor]:
        """Offline: codes [T_i, K] (CPU) for each prepared request (queued beyond max_slots as needed)."""
        handles = [self.submit_blocking(p) for p in prepared]
        reqs = [h.wait() for h in handles]
        K = self.engine.runner.K
        return [torch.stack(r.frames).cpu() if r.frames else torch.zeros(0, K, dtype=torch.long) for r in reqs]

    def stream(self, prepared: list[PreparedRequest], stream: StreamOptions, arrival_time: float | None = None,
               text_stream: Iterable[str] | None = None, request_ids: list[str] | None = None) -> Iterator[AudioChunk]:
        """Blocking: the chunks of prepared requests as they come (interleaved); text_stream: the text of the one
        request prepared with text=None, read in a thread. A chunk with an error raises ValueError, a failing text
        source its own error; leaving early cancels the requests, which are finished when this returns."""
        merged: queue.Queue = queue.Queue()
        handles = []
        try:
            for i, p in enumerate(prepared):
                handles.append(self.submit_blocking(p, stream, arrival_time, merged,
                                                    request_ids[i] if request_ids else None))
            feed = TextFeed(prepared[0].text, handles[0].cancel) if text_stream is not None else None
            if feed is not None:
                threading.Thread(target=feed.run, args=(text_stream,), daemon=True).start()
            left = len(handles)
            while left:
                item = handles[0].get()  # (any of them: they share the queue)
                if feed is not None and feed.error is not None:
                    raise feed.error
                if isinstance(item, BaseException):
                    raise item
                if item.error:
                    raise ValueError(item.error)
                left -= item.is_last
                yield item
        finally:
            for h in handles:
                h.close()

    async def generate(self, prepared, stream: StreamOptions | None = None, request_id: str | None = None,
                       arrival_time: float | None = None,
                       text_stream: AsyncIterable[str] | None = None) -> AsyncIterator[AudioChunk]:
        """Chunks of one request until its last one. Raises QueueFullError at once if the queue is full.

        Always streams internally (exact decoder); pass large chunk sizes for non-streaming responses.
        text_stream: the text as it is written (prepared from text=None), read while audio is made.
        """
        handle = self.submit(prepared, stream, request_id, arrival_time)
        feed = TextFeed(prepared.text, handle.cancel) if text_stream is not None else None
        feeder = asyncio.ensure_future(feed.arun(text_stream)) if feed is not None else None
        try:
            async for chunk in handle.chunks():
                yield chunk
            if feed is not None and feed.error is not None:
                raise feed.error
        finally:
            if feeder is not None:
                feeder.cancel()


class TextFeed:
    """Pieces of a streamed text into the request's text (q3tts.inputs.text), then its close. A failing source ends
    the request (`cancel`) and is kept in `error` for the consumer to raise; an empty text is not a failure of the
    source: the engine fails the request with the text's own error."""

    def __init__(self, text, cancel: Callable[[], None]):
        self.text, self.cancel = text, cancel
        self.error: BaseException | None = None

    def _fail(self, e: BaseException) -> None:
        if not self.text.error:
            self.error = e
            self.cancel()

    def run(self, pieces: Iterable[str]) -> None:
        """In a thread: the source may block, as an LLM does."""
        try:
            for piece in pieces:
                self.text.append(piece)
            self.text.close()
        except BaseException as e:
            self._fail(e)

    async def arun(self, pieces: AsyncIterable[str]) -> None:
        try:
            async for piece in pieces:
                self.text.append(piece)
            self.text.close()
        except BaseException as e:
            self._fail(e)


class RequestHandle:
    """One queued request of the AsyncEngine."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue):
        self.engine, self.request_id, self._q = engine, request_id, queue
        self.finished = False

    async def chunks(self) -> AsyncIterator[AudioChunk]:
        """Its chunks until the last one; leaving early (or being cancelled) aborts the request."""
        try:
            turn = self.engine.engine.turn
            while not self.finished:
                item = await self._q.get()
                turn.wait()  # before this chunk's encoding: a step's host work first (q3tts.engine.turn)
                if isinstance(item, Exception):
                    raise item
                self.finished = item.is_last
                yield item
        finally:
            self.close()

    def cancel(self) -> None:
        """Abort the request (a no-op once it finished); its slot is free at the next step, and chunks() ends
        with a last chunk (finish_reason "abort")."""
        if not self.finished:
            self.engine.engine.abort(self.request_id)

    def close(self) -> None:
        """Cancel, and drop whatever it still sends: nobody reads it."""
        self.cancel()
        self.engine._sinks.pop(self.request_id, None)


class BlockingHandle:
    """One request of the AsyncEngine read from a plain thread."""

    def __init__(self, engine: AsyncEngine, req: EngineRequest, q: queue.Queue):
        self.engine, self.req, self.request_id, self._q = engine, req, req.request_id, q

    def get(self, timeout: float = 1.0):
        """The next item of its queue; RuntimeError if the engine's loop died meanwhile (nothing would come)."""
        while True:
            try:
                return self._q.get(timeout=timeout)
            except queue.Empty:
                if not self.engine.is_alive():
                    raise RuntimeError("the engine's loop stopped") from None

    def wait(self) -> EngineRequest:
        """Offline: the finished request (its frames), or the step's exception raised."""
        item = self.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        if not self.req.stream_done and not self.req.status.finished:
            self.engine.engine.abort(self.request_id)

    def close(self) -> None:
        """Cancel if still running, and wait until the engine let go of it (its slot is free when this returns)."""
        self.cancel()
        while not self._released() and self.engine.is_alive():
            time.sleep(0.002)
        self.engine._sinks.pop(self.request_id, None)

    def _released(self) -> bool:
        return self.req.stream_done if self.req.stream is not None else self.req.status.finished
