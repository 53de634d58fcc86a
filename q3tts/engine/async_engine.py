"""The one async bridge: a background thread drives Engine.step(); asyncio consumers get their chunks.

Only `_loop` iterates over step outputs; each request has its own asyncio.Queue fed thread-safely.
Cancelling a consumer (client disconnect) aborts its request, which frees its slot at the next step.
A request's text may be streamed in: an async iterable of pieces (`generate(text_stream=...)`), or pieces
appended to `prepared.text` by the caller (`submit`). A step that raises fails only the requests it held
(Engine.step finishes them; their consumers get the exception); queued ones go on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

from .engine import AudioChunk, Engine, EngineCounters
from .request import StreamOptions


@dataclass(slots=True)
class EngineStats:
    queue_depth: int
    active_slots: int
    max_slots: int
    counters: EngineCounters  # the live object: read it, do not change it


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.last_error: str | None = None  # last step failure (a device assert poisons the CUDA context)
        self._thread = threading.Thread(target=self._loop, name="q3tts-engine", daemon=True)
        self._thread.start()

    def stats(self) -> EngineStats:
        s = self.engine.scheduler
        return EngineStats(s.queue_depth, s.num_running, s.max_slots, self.engine.counters)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def healthy(self) -> bool:
        """False once it cannot serve: its thread stopped, or a CUDA error poisoned the device context (every later
        step would fail too). A failed step of another kind fails only the requests it held."""
        return self.is_alive() and not (self.last_error and "CUDA" in self.last_error)

    def shutdown(self) -> None:
        self._stop = True
        self.engine.wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.wait_for_work():
                continue
            try:
                chunks = self.engine.step()
            except Exception as e:  # a bug or device error: fail the requests the step held, keep serving
                self.last_error = f"{type(e).__name__}: {e}"
                for rid in self.engine.failed_ids:
                    target = self._queues.get(rid)
                    if target is not None:
                        target[0].call_soon_threadsafe(target[1].put_nowait, e)
                continue
            for c in chunks:
                target = self._queues.get(c.request_id)
                if target is not None:
                    loop, q = target
                    loop.call_soon_threadsafe(q.put_nowait, c)

    def submit(self, prepared, stream: StreamOptions | None = None, request_id: str | None = None,
               arrival_time: float | None = None) -> RequestHandle:
        """Queue a request now (QueueFullError / ValueError at once); its chunks come from handle.chunks()."""
        req = self.engine.add_request(prepared, stream or StreamOptions(), request_id)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        q: asyncio.Queue = asyncio.Queue()
        self._queues[req.request_id] = (asyncio.get_running_loop(), q)
        return RequestHandle(self, req.request_id, q)

    async def generate(self, prepared, stream: StreamOptions | None = None, request_id: str | None = None,
                       arrival_time: float | None = None,
                       text_stream: AsyncIterable[str] | None = None) -> AsyncIterator[AudioChunk]:
        """Chunks of one request until its last one. Raises QueueFullError at once if the queue is full.

        Always streams internally (exact decoder); pass large chunk sizes for non-streaming responses.
        text_stream: the text as it is written (prepared from text=None), read while audio is made.
        """
        handle = self.submit(prepared, stream, request_id, arrival_time)
        feeder = asyncio.ensure_future(_feed(prepared.text, text_stream, handle)) if text_stream is not None else None
        try:
            async for chunk in handle.chunks():
                yield chunk
            if feeder is not None and feeder.done() and feeder.exception() is not None:
                raise feeder.exception()
        finally:
            if feeder is not None:
                feeder.cancel()


async def _feed(text, pieces: AsyncIterable[str], handle: RequestHandle) -> None:
    try:
        async for piece in pieces:
            text.append(piece)
        text.close()
    except BaseException:
        handle.cancel()  # the text source failed: end the request (the error is raised by generate)
        raise


class RequestHandle:
    """One queued request of the AsyncEngine."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue):
        self.engine, self.request_id, self._q = engine, request_id, queue
        self.finished = False

    async def chunks(self) -> AsyncIterator[AudioChunk]:
        """Its chunks until the last one; leaving early (or being cancelled) aborts the request."""
        try:
            while not self.finished:
                item = await self._q.get()
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
        self.engine._queues.pop(self.request_id, None)
