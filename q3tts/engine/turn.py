"""The engine thread's turn at the interpreter: a step's host work goes before an event loop's Python.

CPython hands the GIL over only when its holder lets it go. torch lets it go around every call (each kernel launch,
each copy), and wants it back right after; a thread that runs Python meanwhile (an event loop parsing a burst of
requests, or encoding a step's chunks) keeps it until the interpreter forces a switch (sys.getswitchinterval(), 5 ms).
So while the loop is busy, the engine's thread gets one launch in per switch interval: a step whose host work takes
a millisecond alone takes tens (the convoy effect; tests/engine/test_turn.py measures it).

The turn orders the two. The engine's thread holds it through a step (`HostTurn.hold`) and lets it go while it waits
for the device (`device_wait`, around the step's host syncs); an event loop checks in (`HostTurn.wait`) where it
takes up work for the engine (each request it queues, each chunk it takes) and, while the engine holds the turn,
blocks there with the GIL free, until the engine's next device wait. The loop's Python then runs while the device
works, the engine's launches while the loop waits. Only where the engine's steps are mostly device time (CUDA graphs):
on a CPU the whole step is host work, and a loop that waited for it would wait for every step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_held = threading.local()  # .turn: the HostTurn this thread holds (inside hold())


class HostTurn:
    """enabled: whether hold() takes the turn (a check-in returns at once while nobody holds it). max_wait_s: the
    longest a check-in blocks (a step's host phase is milliseconds; a longer one lets the loop go on)."""

    def __init__(self, enabled: bool, max_wait_s: float = 0.05):
        self.enabled, self.max_wait_s = enabled, max_wait_s
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The engine's thread, for one step: the turn is its own but for its device waits."""
        if not self.enabled:
            yield
            return
        self._lock.acquire()
        _held.turn = self
        try:
            yield
        finally:
            _held.turn = None
            self._lock.release()

    def wait(self) -> None:
        """A consumer's check-in: at once unless the engine holds the turn; then at its next device wait."""
        if self._lock.locked() and self._lock.acquire(timeout=self.max_wait_s):
            self._lock.release()


@contextlib.contextmanager
def device_wait() -> Iterator[None]:
    """Around a host sync of the engine's thread (a copy of the device's results): its turn goes to the consumers
    that wait for it meanwhile. Elsewhere (no turn held by this thread) nothing."""
    turn = getattr(_held, "turn", None)
    if turn is None:
        yield
        return
    turn._lock.release()
    try:
        yield
    finally:
        turn._lock.acquire()
