"""`q3tts serve` whose GIL switch interval (sys.setswitchinterval) signals change while it runs, for an interleaved A/B
in one server (bench/load/gil_switch.sh): SIGUSR1 sets $SHORT_MS (default 0.5 ms), SIGUSR2 Python's default 5 ms.

The engine's thread holds the GIL while it launches a step's work; the event loop (HTTP, the chunks' delivery) waits
for it up to the switch interval at each hand-over.

    python3 -m bench.load.switch_serve serve --model DIR ...     (the arguments of `q3tts serve`)
"""

from __future__ import annotations

import os
import signal
import sys

from bench.load.switched import serve


def set_interval(ms: float) -> None:
    sys.setswitchinterval(ms / 1000)
    print(f"switch interval {ms} ms", file=sys.stderr, flush=True)


if __name__ == "__main__":
    short = float(os.environ.get("SHORT_MS", "0.5"))
    raise SystemExit(serve({signal.SIGUSR1: lambda: set_interval(short), signal.SIGUSR2: lambda: set_interval(5.0)}))
