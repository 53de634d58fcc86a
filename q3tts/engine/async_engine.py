"""The one async bridge: a background thread drives Engine.step(); asyncio consumers get their chunks.

Only `_loop` iterates over step outputs; each request has its own asyncio.Queue fed thread-safely.
Cancelling a consumer (client disconnect) aborts its request, which frees its slot at the next step.
A step that raises fails only the requests it held (running or being admitted); queued ones go on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .engine import AudioChunk, Engine, EngineCounters
from .request import EngineRequest, StreamOptions


@dataclass(slots=True)
class EngineStats:
    queue_depth: int
    active_slots: int
    max_slots: int
    counters: EngineCounters  # the live object: read it, do not change it


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        # request id -> (its consumer's loop, its chunk queue, the EngineRequest)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, EngineRequest]] = {}
        self._wake = threading.Event()
        self._stop = False
        self.last_error: str | None = None  # last step failure (a device assert poisons the CUDA context)
        self._thread = threading.Thread(target=self._loop, name="q3tts-engine", daemon=True)
        self._thread.start()

    def stats(self) -> EngineStats:
        s = self.engine.scheduler
        return EngineStats(s.queue_depth, s.num_running, s.max_slots, self.engine.counters)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                chunks = self.engine.step()
            except Exception as e:  # a bug or device error: fail the requests the step held, keep serving
                self.last_error = f"{type(e).__name__}: {e}"
                self._fail_touched(e)
                continue
            for c in chunks:
                target = self._queues.get(c.request_id)
                if target is not None:
                    loop, q, _ = target
                    loop.call_soon_threadsafe(q.put_nowait, c)

    def _fail_touched(self, e: Exception) -> None:
        """After a failed step: fail the requests it may have touched, i.e. every live request that is no
        longer waiting (running, admitted this step, or finished in it before its last chunk went out); the
        queued ones never entered the step and go on. Each failed request is aborted (slot freed at the next
        step); one that already finished inside the failed step is out of the scheduler, so its vocoder row
        is handed back here (else the pool would shrink by one row per such failure)."""
        eng = self.engine
        with eng._lock:
            waiting = {id(r) for r in eng.scheduler.waiting}
        for rid, (loop, q, req) in list(self._queues.items()):
            if id(req) in waiting or req.stream_done:  # queued, or already had its last chunk
                continue
            loop.call_soon_threadsafe(q.put_nowait, e)
            eng.abort(rid)
            if req.status.finished and not req.stream_done and req.vocoder_row is not None:
                eng.vocoder.close(req.vocoder_row)
                req.vocoder_row = None

    async def generate(self, prepared, stream: StreamOptions | None = None, request_id: str | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[AudioChunk]:
        """Chunks of one request until its last one. Raises QueueFullError at once if the queue is full.

        Always streams internally (exact decoder); pass large chunk sizes for non-streaming responses.
        """
        stream = stream or StreamOptions()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req = self.engine.add_request(prepared, stream, request_id)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self._queues[req.request_id] = (loop, q, req)
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.is_last:
                    finished = True
                    return
        finally:
            self._queues.pop(req.request_id, None)
            if not finished:
                self.engine.abort(req.request_id)
                self._wake.set()


def now() -> float:
    return time.perf_counter()
