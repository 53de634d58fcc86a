"""`q3tts serve` whose host turn (q3tts.engine.turn) signals switch while it runs, for an interleaved A/B in one server
(bench/load/prefill_ab.sh with MODULE=bench.load.turn_serve):

    SIGUSR1  "free":  no turn: the engine's thread and the event loop take the GIL as CPython hands it over
    SIGUSR2  "turn":  a step's host work first, the event loop checking in at each request and chunk (the default on
                      CUDA)

A switch applies from the next step on.

    python3 -m bench.load.turn_serve serve --model DIR ...     (the arguments of `q3tts serve`)
"""

from __future__ import annotations

import signal
import sys

from bench.load.switched import serve, track
from q3tts.engine.engine import Engine

ENGINES: list[Engine] = []  # every Engine built in this process


def apply(name: str) -> None:
    for engine in ENGINES:
        engine.turn.enabled = name == "turn"
    print(f"turn setting {name} ({len(ENGINES)} engine(s))", file=sys.stderr, flush=True)


if __name__ == "__main__":
    track(Engine, ENGINES)
    raise SystemExit(serve({signal.SIGUSR1: lambda: apply("free"), signal.SIGUSR2: lambda: apply("turn")}))
