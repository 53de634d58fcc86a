"""`q3tts serve` whose hand-over of chunks to the event loop signals switch while it runs, for an interleaved A/B in one
server (bench/load/prefill_ab.sh with MODULE=bench.load.deliver_serve):

    SIGUSR1  "per_chunk": one call_soon_threadsafe per chunk (0b11ad3's)
    SIGUSR2  "batched":   one per wake-up of the event loop: a step's chunks wake it once they are all in
                          (AsyncEngine._deliver, the default)

A switch applies from the next delivery on.

    python3 -m bench.load.deliver_serve serve --model DIR ...     (the arguments of `q3tts serve`)
"""

from __future__ import annotations

import signal
import sys

from bench.load.switched import serve
from q3tts.engine.async_engine import AsyncEngine, LoopSink

MODE = {"per_chunk": False}
_deliver = AsyncEngine._deliver


def deliver(self: AsyncEngine, request_id: str, item: object, woken: list | None = None) -> None:
    sink = self._sinks.get(request_id)
    if MODE["per_chunk"] and type(sink) is LoopSink:
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:  # the consumers' loop is closed
            pass
    else:
        _deliver(self, request_id, item, woken)


def apply(name: str) -> None:
    MODE["per_chunk"] = name == "per_chunk"
    print(f"delivery setting {name}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    AsyncEngine._deliver = deliver
    raise SystemExit(serve({signal.SIGUSR1: lambda: apply("per_chunk"), signal.SIGUSR2: lambda: apply("batched")}))
