"""`q3tts serve` whose admission regime signals switch while it runs, for an interleaved A/B in one server and one
build of its graphs (bench/load/prefill_ab.sh):

    SIGUSR1  "eager":   no wave graph, up to 10 newcomers alone: a wave of more is one batched forward (c58503a's)
    SIGUSR2  "waves10": wave graphs, up to 10 newcomers alone (the engine's default)
    SIGHUP   "waves4":  wave graphs, up to 4 newcomers alone

The runner's PREFILL_GRAPH_MAX_REQUESTS is read at each step (ModelRunner.prefill_alone_max, which the engine hands the
deadline policy with every step's sample), and a runner's wave graphs are looked up at each wave: a switch applies from
the next step on. It also empties the deadline policy's prefill cost fits, as a server started with the setting has
them (the other setting's samples would steer its first waves; run a warm-up level after a switch).

    python3 -m bench.load.prefill_serve serve --model DIR ...     (the arguments of `q3tts serve`)
"""

from __future__ import annotations

import signal
import sys

from bench.load.switched import serve, track
from q3tts.engine import engine as engine_mod
from q3tts.engine import runner as runner_mod
from q3tts.engine.deadline import PrefillCost

RUNNERS: list = []  # every ModelRunner built in this process
ENGINES: list = []  # every Engine built in this process
SETTINGS = {"eager": (False, 10), "waves10": (True, 10), "waves4": (True, 4)}  # name -> (wave graphs, alone max)


def track_runners() -> None:
    """Record each ModelRunner and Engine as it is built (the server builds its engine inside the CLI's main)."""
    track(runner_mod.ModelRunner, RUNNERS, lambda r: setattr(r, "_captured_waves", {}))
    track(engine_mod.Engine, ENGINES)


def apply(name: str) -> None:
    """Switch every runner to a setting of SETTINGS."""
    waves, alone_max = SETTINGS[name]
    runner_mod.PREFILL_GRAPH_MAX_REQUESTS = alone_max
    for r in RUNNERS:
        r._captured_waves = r._captured_waves or r.wave_graphs  # the graphs as captured, kept while switched off
        r.wave_graphs = r._captured_waves if waves else {}
    for e in ENGINES:
        if e.policy is not None:
            e.policy.times.prefill = PrefillCost()
    print(f"prefill setting {name}: wave graphs {'on' if waves else 'off'}, alone max {alone_max}", file=sys.stderr,
          flush=True)


if __name__ == "__main__":
    track_runners()
    raise SystemExit(serve({sig: lambda name=name: apply(name)
                            for sig, name in ((signal.SIGUSR1, "eager"), (signal.SIGUSR2, "waves10"),
                                              (signal.SIGHUP, "waves4"))}))
