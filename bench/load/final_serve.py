"""`q3tts serve` whose vocoding of a stream's final chunk signals switch while it runs, for an interleaved A/B in one
server (bench/load/prefill_ab.sh with MODULE=bench.load.final_serve):

    SIGUSR1  "cut":     the final chunk cut into power-of-two pieces like every other chunk (13 frames: 8, 4, 1, each
                        its own call unless other streams have a piece of that size in the same round)
    SIGUSR2  "padded":  padded up to whole pieces (13 frames: one 16-frame piece that shares the call of other streams'
                        16-frame chunks; q3tts.engine.vocoder.final_pieces, the default)

A switch applies from the next step on.

    python3 -m bench.load.final_serve serve --model DIR ...     (the arguments of `q3tts serve`)
"""

from __future__ import annotations

import signal
import sys

from bench.load.switched import serve
from q3tts.engine import vocoder

PADDED = vocoder.final_pieces  # as the package has it


def apply(name: str) -> None:
    vocoder.final_pieces = PADDED if name == "padded" else vocoder.pieces
    print(f"final chunk setting {name}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(serve({signal.SIGUSR1: lambda: apply("cut"), signal.SIGUSR2: lambda: apply("padded")}))
