"""Why a burst's arrivals hold the engine's thread back (issue 33), without a server or a GPU: an event loop runs N
'requests' (W us of Python each, one loop callback each, chained through call_soon so the loop polls between them,
letting the GIL go each time), and an engine thread, woken at the first request, runs a 'step' of OPS torch calls
under the host turn (q3tts.engine.turn). When does the engine wake, take its turn and finish, against the burst's end?

    python -m bench.load.gil_burst [--requests 64] [--work-us 500] [--ops 300] [--trials 5]

CPython forces a switch to a waiting thread only after an interval (5 ms) in which the GIL did not change hands; a loop
that polls between callbacks lets it go and takes it back at every iteration, so the waiting thread's interval never
runs out, and it loses each race for the GIL to the running loop: it wakes when the burst is over.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import torch

from q3tts.engine.turn import HostTurn


def work(us: float) -> None:
    """Python for `us` microseconds (a request's parsing and routing), letting no GIL go."""
    end = time.perf_counter() + us / 1e6
    s = 0
    while time.perf_counter() < end:
        for i in range(50):
            s += i


def trial(loop_kind: str, turn_on: bool, requests: int = 64, work_us: float = 500, ops: int = 300) -> dict:
    """ms from the first request to: the engine's thread awake, its turn taken, its step done; and the burst done."""
    turn, x = HostTurn(turn_on), torch.zeros(8)
    wake, marks = threading.Event(), {}

    def engine():
        wake.wait()
        marks["woke"] = time.perf_counter()
        with turn.hold():
            marks["held"] = time.perf_counter()
            for _ in range(ops):
                x.add_(1)
        marks["done"] = time.perf_counter()

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()

    async def burst():
        loop, left = asyncio.get_running_loop(), [requests]
        finished = loop.create_future()

        def one():
            work(work_us)
            turn.wait()  # the request's check-in, as AsyncEngine.submit's
            if left[0] == requests:
                marks["t0"] = time.perf_counter()
                wake.set()
            left[0] -= 1
            if left[0]:
                loop.call_soon(one)
            else:
                marks["burst"] = time.perf_counter()
                finished.set_result(None)

        loop.call_soon(one)
        await finished

    if loop_kind == "uvloop":
        import uvloop
        uvloop.run(burst())
    else:
        asyncio.run(burst())
    thread.join(10)
    return {k: round((marks[k] - marks["t0"]) * 1000, 2) for k in ("woke", "held", "done", "burst")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--work-us", type=float, default=500)
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--trials", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    loops = ["asyncio"]
    try:
        import uvloop  # noqa: F401
        loops.append("uvloop")
    except ImportError:
        pass
    for loop_kind in loops:
        for turn_on in (False, True):
            runs = sorted((trial(loop_kind, turn_on, a.requests, a.work_us, a.ops) for _ in range(a.trials)),
                          key=lambda r: r["done"])
            print(f"{loop_kind:8} turn {'on ' if turn_on else 'off'}  ms from the first request (median of "
                  f"{a.trials}): {runs[len(runs) // 2]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
