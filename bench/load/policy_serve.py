"""`q3tts serve` whose deadline policy knobs signals switch while it runs, for an interleaved A/B in one server and one
build of its graphs (bench/load/prefill_ab.sh with MODULE=bench.load.policy_serve; the policy on: Q3TTS_DEADLINE=1):

    SIGHUP   "default":  the policy as the server built it (DeadlinePolicy's defaults and $Q3TTS_DEADLINE_<NAME>)
    SIGUSR1  "usr1":     the built policy with $POLICY_USR1's fields, e.g. POLICY_USR1="first_chunk_prefills=24"
    SIGUSR2  "usr2":     the built policy with $POLICY_USR2's fields, e.g. POLICY_USR2="max_wait_s=0.1,margin_s=0.01"
    SIGWINCH "winch":    the built policy with $POLICY_WINCH's fields (a fourth setting)

A setting is "field=value,..." over DeadlinePolicy's number fields (not `times`: the measured step costs stay, as one
server has them) and `alone_max`: the runner's PREFILL_GRAPH_MAX_REQUESTS (up to it newcomers replay their prefill
graphs one by one, more share a wave graph), read at every step as bench/load/prefill_serve.py switches it; a setting
that changes it empties the policy's prefill cost fits, as a server started with it has them. "off" is no policy at
all: the engine and its scheduler as Engine(deadline=False) builds them (admission by count, chunks when full; the
policy's step costs are not measured meanwhile, and the warm-up burst after the next switch brings them up to date).
An unknown field, a value that is not a number or a fraction for an integer field fails at the start, naming the
accepted fields. The engine and the scheduler read the policy at every step: a switch applies from the next step on.
One server instead of one per setting: a 0.6B server at 128 slots x 1024 positions holds ~20 GiB, so four of them do
not fit an 80 GB H100.

    python3 -m bench.load.policy_serve serve --model DIR ...     (the arguments of `q3tts serve`)
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

from bench.load.switched import serve, track
from q3tts.engine import runner as runner_mod
from q3tts.engine.deadline import DeadlinePolicy, PrefillCost
from q3tts.engine.engine import Engine

ENGINES: list[Engine] = []  # every Engine built in this process
POLICY_KNOBS = {f.name: type(f.default) for f in dataclasses.fields(DeadlinePolicy) if f.name != "times"}  # int/float
KNOBS = {**POLICY_KNOBS, "alone_max": int}  # and the runner's PREFILL_GRAPH_MAX_REQUESTS
BUILT: dict[int, tuple[DeadlinePolicy, dict[str, float]]] = {}  # id(engine) -> its policy and its knobs as built
ALONE_MAX = runner_mod.PREFILL_GRAPH_MAX_REQUESTS  # as the server was built


def parse(text: str) -> dict[str, float]:
    """"field=value,..." -> {field: value}; ValueError naming the item and the accepted fields."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, raw = item.partition("=")
        try:
            value = float(raw)
        except ValueError:
            value = None
        name = name.strip()
        bad_int = KNOBS.get(name) is int and value is not None and not value.is_integer()
        if not sep or name not in KNOBS or value is None or value != value or bad_int:  # (value != value: nan)
            ints = ", ".join(k for k, t in KNOBS.items() if t is int)
            raise ValueError(f"bad policy setting {item!r}: expected field=number (an integer for {ints}) with field "
                             f"one of {', '.join(KNOBS)}")
        out[name] = KNOBS[name](value)
    return out


def setting(text: str) -> dict[str, float] | None:
    """A signal's setting: "off" -> None (no policy), else parse(text)."""
    return None if text.strip().lower() == "off" else parse(text)


def apply(name: str, fields: dict[str, float] | None) -> None:
    """Every engine's policy: its knobs as built, then `fields` (alone_max: the runners', as built unless given);
    fields None: no policy, in the engine and its scheduler. An engine built without a policy keeps none."""
    alone_max = (fields or {}).get("alone_max", ALONE_MAX)
    changed, runner_mod.PREFILL_GRAPH_MAX_REQUESTS = alone_max != runner_mod.PREFILL_GRAPH_MAX_REQUESTS, alone_max
    for engine in ENGINES:
        if id(engine) not in BUILT:
            continue
        policy, knobs = BUILT[id(engine)]
        if changed:  # (off as well: the runners go back to their regime as built)
            policy.times.prefill = PrefillCost()
        engine.policy = engine.scheduler.policy = None if fields is None else policy
        if fields is not None:
            for knob in POLICY_KNOBS:
                setattr(policy, knob, fields.get(knob, knobs[knob]))
    what = "off" if fields is None else fields or "as built"
    print(f"policy setting {name}: {what} ({len(ENGINES)} engine(s))", file=sys.stderr, flush=True)


def remember(engine: Engine) -> None:
    if engine.policy is not None:
        BUILT[id(engine)] = (engine.policy, {k: getattr(engine.policy, k) for k in POLICY_KNOBS})


SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH)  # each with $POLICY_<name>'s setting; SIGHUP: as built

if __name__ == "__main__":
    track(Engine, ENGINES, remember)
    switches = {signal.SIGHUP: lambda: apply("default", {})}
    for sig in SIGNALS:
        name = sig.name.removeprefix("SIG")
        fields = setting(os.environ.get(f"POLICY_{name}", ""))
        switches[sig] = lambda name=name.lower(), fields=fields: apply(name, fields)
    raise SystemExit(serve(switches))
