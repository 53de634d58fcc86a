"""What the signal-switched `q3tts serve` wrappers share (switch_serve, prefill_serve, deliver_serve, turn_serve; run
by gil_switch.sh and prefill_ab.sh): the objects the server builds, recorded as built, and the server run with its
signals set."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable


def track(cls: type, built: list, then: Callable[[object], None] | None = None) -> None:
    """Append each instance of cls to `built` as it is built, after then(instance) (the server builds its engine inside
    the CLI's main, out of the wrapper's reach)."""
    init = cls.__init__

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        if then is not None:
            then(self)
        built.append(self)

    cls.__init__ = __init__


def serve(switches: dict[signal.Signals, Callable[[], None]]) -> int:
    """`q3tts serve` with the command line's arguments, each signal of `switches` calling its function."""
    from q3tts.cli import main
    for sig, fn in switches.items():
        signal.signal(sig, lambda *_, fn=fn: fn())
    return main(sys.argv[1:])
