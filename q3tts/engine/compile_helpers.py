"""Compile helpers: processes that compile part of a cold start's warm-ups into the shared compile cache while the
engine's own process runs all of them.

A runner's warm-ups (q3tts.engine.graphs.warm_ups) fall into shape classes, each of which compiles its own variants of
the layers, the code predictor's step and the samplers (a one-row frame per sampler, a frame of two rows and more per
sampler, with capped frames past the top-k kernel's rows apart, one prompt's prefill, a wave, a batched prefill, a long
prompt). The engine's process works through them in order, compiling each class's variants as it reaches it. A helper is
a fresh process that loads the same checkpoint, builds a runner of the same slots and runs only the first warm-up of the
classes it is given (of a frame class, the code predictor's half or the talker's: halves()), then exits: Inductor's FX
graphs and the AOTAutograd entries it writes are keyed by the traced graph, so when the engine reaches those classes it
traces them (Dynamo runs in every process) and takes the rest from the cache. A helper's runner has fewer positions than
the engine's (helper_len: enough for every warm-up's prompt): the compiled functions take the KV cache's length as a
dynamic size, so the graphs are the same, and a helper holds a fraction of the engine's memory (so a GPU that holds the
engine holds its helpers too). One helper also runs the streaming vocoder's warm-ups (VOCODER), whose Triton kernels the
engine's process then loads from Triton's cache rather than compiling them after the runner's captures, and the helper
that takes the engine's next class first runs an uncompiled one-row frame (KERNELS), so that the engine's first class
finds q3tts's own Triton kernels compiled. Nothing a helper does changes what the engine computes: a cache hit is the
graph the engine would have compiled; a helper that fails or is late only leaves the engine compiling that class itself.

Off unless $Q3TTS_COMPILE_HELPERS says otherwise: "auto" (which `q3tts serve` sets; not `q3tts warmup`, a build step
whose speed matters less than its artifact holding what one process compiled) or a number. Used only for a cold start
(no Dynamo entry installed from the cache or an artifact) of a compiled, captured runner with a contiguous cache, and
only as many as the CPU cores and the free GPU memory hold.

`q3tts serve` starts its helpers at launch (`prestart`): each imports torch, Inductor and the runner and then waits on
its stdin for the work, which the engine sends once its runner's geometry is known (the memory budget sizes it after
the weights have loaded); a helper that gets none exits. So their imports overlap the engine's own imports and loading.
A helper reports each warm-up it starts and finishes on its stdout. The engine runs the classes no helper is compiling
(first those a helper has compiled, last those a helper has still to start) and takes the others as their helpers
finish them (Helpers.in_turn), waiting only when nothing else is left, rather than compiling the same graphs beside a
helper.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

import torch

from .. import invariant
from ..kernels import TOP_KERNEL_MAX_ROWS
from .compile import OFF, compile_counts, use_compile_cache, want_compile
from .memory import alloc_len

ENV = "Q3TTS_COMPILE_HELPERS"
ENTRY = "q3tts.engine.helper_process"  # a helper's process: python -m ENTRY, its work one line on stdin (a module of
# its own: it imports the runner and the warm-ups, which import this one)
MAX_HELPERS = 5
KERNELS = "kernels"  # the first unit of the helper that compiles the engine's next class: one uncompiled one-row frame
# per sampler (helper_process.eager_frames), which compiles q3tts's own Triton kernels (q3tts.kernels) that the
# engine's first class launches into Triton's cache before the engine first runs its compiled frame (there they would
# compile one after another on its critical path); that helper's own one-row frame then finds them too
VOCODER = "vocoder"  # a helper's unit after the runner's warm-ups: the streaming vocoder's (StreamingVocoder.warm_up),
# which compile the engine's own Triton kernels of the vocoder into Triton's cache for the engine's capture to find
HALVES = ("codes", "talker")  # a frame's halves, in the order it runs them (halves())
TURN = ("done", "none", "queued")  # Helpers.in_turn's order of the classes by Reports.state (a busy one waits)
WAIT_S = 240.0  # the longest the engine waits for a helper's warm-up (a class compiles in well under a minute)
log = logging.getLogger("q3tts.engine")
_waiting: list[subprocess.Popen] = []  # helpers started at launch (prestart), waiting for their warm-ups


@dataclass(slots=True)
class Source:
    """What a helper needs to build a runner like the engine's: the checkpoint as loaded, the slots and the positions
    (the engine's; a helper gets helper_len's)."""

    model_dir: str
    device: str
    dtype: str  # e.g. "bfloat16"
    quantization: str | None
    max_slots: int
    max_len: int


def shape_class(name: str) -> str:
    """The compiled variants a named warm-up (graphs.warm_ups) shares with others: frames by one row or more and
    sampler ('frame 1 capped', 'frame 2+ full'), except that capped frames of more rows than the top-k kernel takes
    (kernels.sample_top_applies: any number in batch-invariant mode) sample through torch's ops, a class of their own
    ('frame 17+ capped'); the rest by kind ('prefill', 'wave', 'batch 2', 'long')."""
    kind, *rest = name.split()
    if kind == "frame":
        rows, sampler = int(rest[0]), rest[1]
        if sampler == "capped" and rows > TOP_KERNEL_MAX_ROWS and not invariant.ENABLED:
            return f"frame {TOP_KERNEL_MAX_ROWS + 1}+ capped"
        return f"frame {'1' if rows == 1 else '2+'} {sampler}"
    return " ".join([kind, *rest[:1]]) if kind == "batch" else kind


def plan(names: list[str], helpers: int) -> list[list[str]]:
    """Per helper, the warm-ups it runs: the first of each shape class after the engine's own first one (a frame's as
    its two halves: halves()), dealt in the engine's order (so the classes the engine reaches first are compiled
    first), every other round from the last helper back (a snake: the first helper, which also runs KERNELS, does not
    get the second round's first unit too, which would start only after both of its others)."""
    firsts, seen = [], set()
    for name in names:
        c = shape_class(name)
        if c not in seen:
            seen.add(c)
            firsts.append(name)
    rest = [unit for name in firsts[1:] for unit in halves(name)]
    n = min(helpers, len(rest))
    dealt = [[] for _ in range(n)]
    for i, name in enumerate(rest):
        turn, j = divmod(i, n)
        dealt[n - 1 - j if turn % 2 else j].append(name)
    return dealt


def halves(name: str) -> list[str]:
    """A helper's units of warm-up `name`: a frame's two halves apart ('frame 2 capped:codes', 'frame 2 capped:talker':
    ModelRunner.warm_up_frames' `half`), which compile mostly different graphs (the code predictor's steps at its
    dimensions; the talker's layer, its logits rules and code 0's sampler), so two helpers compile a frame class side
    by side; any other warm-up whole."""
    return [f"{name}:{half}" for half in HALVES] if name.startswith("frame ") else [name]


def helper_len(runner) -> int:
    """A helper's runner's positions: the fewest the runner allocates (a power of two) that hold every warm-up's
    prompt (the prefill graphs' and waves' lengths, and the long prompt one past the last prefill graph's), at most
    the engine's. Its KV cache (most of a runner's memory) is then a fraction of the engine's, and its warm-ups trace
    the same graphs: the compiled functions take the cache's length as a dynamic size, and each warm-up attends to
    its own positions only."""
    need = max([*runner.prefill_graph_lens, *runner.wave_lens], default=0) + 2
    return min(runner.max_len, alloc_len(need))


def asked() -> int:
    """The helpers $Q3TTS_COMPILE_HELPERS asks for ('auto': MAX_HELPERS; a number; 0 or compile.OFF's words: none),
    bounded by the cores (a helper is one busy core plus its compile workers (helper_env): half the cores, less one
    for the engine). ValueError naming the accepted values for anything else."""
    setting = os.environ.get(ENV, "0").strip().lower()
    if setting in ("", *OFF):
        return 0
    if setting != "auto" and not setting.isdigit():
        raise ValueError(f"${ENV}={setting!r}: expected auto, 0 (off) or a number of helper processes")
    n = MAX_HELPERS if setting == "auto" else int(setting)
    return min(n, max(0, _cores() // 2 - 1))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def helper_env() -> dict[str, str]:
    """A helper's environment: this one's, with no helpers of its own and, unless the user set it, Inductor's compile
    pool sized to its share of the cores (the cores over the asked() helpers and the engine, at least 1). Inductor
    sizes each process's pool by all the cores, so the engine and its helpers would each start that many workers on
    the same cores, and the engine's own tracing, the start's critical path, would wait behind them."""
    env = dict(os.environ, **{ENV: "0"})
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, _cores() // (asked() + 1))))
    return env


def wanted(runner) -> int:
    """How many helpers this cold start gets: asked(), bounded by the GPU memory free beyond what the engine may still
    take (a tenth of the device, outside its budget, and a quarter of what it holds now plus 2 GiB for its captures
    and warm-ups), each helper holding what the engine holds now less the KV cache positions its runner lacks
    (helper_len) plus 1 GiB (its context and warm-up activations); 0 where helpers cannot help (no compilation, no
    CUDA graphs, a paged cache, Dynamo entries already installed: a warm start)."""
    n = asked()
    if not n or not (runner.compiled and runner.use_graphs):
        return 0
    if runner.block_table is not None or compile_counts()["dynamo_hit"]:
        return 0
    dev = runner.device
    free, total = torch.cuda.mem_get_info(dev)
    used = torch.cuda.memory_allocated(dev)
    spare = free - total * 0.1 - used * 0.25 - (2 << 30)
    kv = runner.kv.numel() * runner.kv.element_size()
    each = used - kv * (1 - helper_len(runner) / runner.max_len) + (1 << 30)
    return max(0, min(n, int(spare // each)))


def prestart(device: str | None, compile_cache: str | None) -> int:
    """Start asked() helpers now, before the engine exists (q3tts serve, at launch, with its --device and
    --compile-cache), to wait for their warm-ups (Helpers takes them) -> how many. None on a CPU, without compilation,
    or where the compile cache already holds Dynamo entries (most likely a warm start, whose engine wants no helper:
    any it still wants start then). They touch no GPU before their work comes, so the engine's memory budget sees none
    of them."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda" or not want_compile(dev, None):
        return 0
    cache_dir = use_compile_cache(compile_cache)  # (the engine's runner resolves the same directory)
    entries = os.path.join(cache_dir, "dynamo") if cache_dir else None
    if entries and os.path.isdir(entries) and os.listdir(entries):
        return 0
    for _ in range(asked() - len(_waiting)):
        _waiting.append(_spawn())
    return len(_waiting)


def dismiss() -> None:
    """End the helpers still waiting (they hold no GPU memory yet): the engine wants no more of them."""
    while _waiting:
        p = _waiting.pop()
        p.kill()
        p.wait()


def _spawn() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", ENTRY], env=helper_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


class Reports:
    """What the helpers of one cold start report ('start NAME' and 'done NAME' lines per warm-up on their stdout), and
    the engine's waits for them."""

    def __init__(self):
        self._busy: set[str] = set()  # warm-ups a helper has started and not finished (nor ended)
        self._queued: set[str] = set()  # warm-ups dealt to a helper that has not started them (nor ended)
        self._changed = threading.Condition()  # notified whenever _busy loses a name
        self.t0 = time.perf_counter()  # the helpers' work sent (about): `spans` count from here
        self.spans: dict[str, list[float]] = {}  # per warm-up a helper started: [start, done] s after t0 (done: nan
        # while it runs)
        self.waits: dict[str, float] = {}  # per warm-up the engine waited for: seconds

    def deal(self, units: list[str]) -> None:
        """One helper's warm-ups, sent to it: queued until it starts each."""
        with self._changed:
            self._queued.update(units)

    def follow(self, lines, units: list[str] = ()) -> None:
        """Read one helper's lines until it ends (a thread of its own); each warm-up it started counts as done once it
        reports so or has ended (a failed helper leaves its warm-ups, `units`, to the engine)."""
        started = []
        for line in lines:
            what, _, name = line.strip().partition(" ")
            t = time.perf_counter() - self.t0
            with self._changed:
                if what == "start":
                    started.append(name)
                    self._busy.add(name)
                    self._queued.discard(name)
                    self.spans[name] = [t, float("nan")]
                elif what == "done" and name in self.spans:
                    self._busy.discard(name)
                    self.spans[name][1] = t
                    self._changed.notify_all()
        with self._changed:
            self._busy.difference_update(started)
            self._queued.difference_update(units)
            self._changed.notify_all()

    def state(self, name: str) -> str:
        """Warm-up `name`, over its units (halves()): 'busy' (a helper is compiling one), 'queued' (a helper has one
        still to start), 'none' (no helper has one: never dealt, or its helper ended without it) or 'done' (helpers
        have compiled them all), the first of these that holds."""
        with self._changed:
            states = {self._state(unit) for unit in halves(name)}
        return next(s for s in ("busy", "queued", "none", "done") if s in states)

    def _state(self, unit: str) -> str:
        if unit in self._busy:
            return "busy"
        if unit in self._queued:
            return "queued"
        return "done" if unit in self.spans and not math.isnan(self.spans[unit][1]) else "none"

    def wait_any(self, names: list[str], timeout: float = WAIT_S) -> float:
        """Until a helper is done with a unit of one of `names` (halves()), at once if a helper is compiling none of
        them, at most `timeout` s, after which they are the engine's -> the seconds waited."""
        t0 = time.perf_counter()
        with self._changed:
            names = [unit for name in names for unit in halves(name) if unit in self._busy]
            if not names:
                return 0.0
            if not self._changed.wait_for(lambda: not self._busy.issuperset(names), timeout):
                log.warning("compile helpers: %s not done after %.0f s; compiling here", ", ".join(names), timeout)
                self._busy.difference_update(names)
            first = next(n for n in names if n not in self._busy)
        waited = time.perf_counter() - t0
        self.waits[first] = self.waits.get(first, 0.0) + waited
        return waited

    def describe(self) -> str:
        """The helpers' warm-ups and the engine's waits, e.g. 'frame 1 capped 5.2-31.0 s, ... after the work was sent;
        the engine waited for batch 2 2.7 s' (a span whose end is nan: its helper ended or was stopped first)."""
        with self._changed:
            spans = ", ".join(f"{n} {a:.1f}-{b:.1f} s" for n, (a, b) in sorted(self.spans.items(), key=lambda x: x[1]))
            waits = ", ".join(f"{n} {w:.1f} s" for n, w in self.waits.items() if w >= 0.05) or "nothing"
        return f"{spans or 'no warm-up started'} after the work was sent; the engine waited for {waits}"


class Helpers:
    """The helper processes of one cold start (started by graphs.capture_runner before its warm-ups, stopped after):
    those waiting since launch (prestart) first, new ones for the rest."""

    def __init__(self, source: Source | None, runner, names: list[str]):
        self.procs: list[subprocess.Popen] = []
        self.reports = Reports()
        n = wanted(runner) if source is not None else 0
        if not n:
            return
        dealt = plan([*names, VOCODER], n)
        dealt[0].insert(0, KERNELS)
        # the compile cache's directory: the runner's (resolved after the launch of a waiting helper)
        spec = {"source": asdict(replace(source, max_len=helper_len(runner))), "batch_invariant": invariant.ENABLED,
                "cache_dir": runner.compile_cache}
        for units in dealt:
            p = _waiting.pop() if _waiting else _spawn()
            self.reports.deal(units)
            try:
                p.stdin.write(json.dumps(spec | {"units": units}) + "\n")
                p.stdin.close()
            except OSError:  # it has died (stop counts it failed): its warm-ups are the engine's
                pass
            self.procs.append(p)
            threading.Thread(target=self.reports.follow, args=(p.stdout, units), daemon=True).start()
        log.info("compile helpers: %d processes for %s", len(self.procs), dealt)

    def in_turn(self, units: list[tuple[str, object]]):
        """The named warm-ups, each shape class with the rest of its class (which use its variants) after its first
        warm-up, in this order: classes a helper has compiled (the engine traces them, taking the graphs from the
        cache), then those no helper has (the engine compiles them), then those a helper has still to start (the
        engine compiling one would do that helper's work twice), each group in the given order; a class a helper is
        compiling waits. With only those left, the engine waits for the first helper to be done with one. So the
        engine traces a class as soon as its graphs are in the cache, whichever helper finishes first."""
        firsts: dict[str, str] = {}
        for name, _ in units:
            firsts.setdefault(shape_class(name), name)
        pending = list(units)
        while pending:
            owners = [firsts[shape_class(name)] for name, _ in pending]
            state = {o: self.reports.state(o) for o in dict.fromkeys(owners)}  # once per class
            ready = [(TURN.index(state[o]), i) for i, o in enumerate(owners) if state[o] != "busy"]
            if not ready:
                self.reports.wait_any(list(state))
                continue
            yield pending.pop(min(ready)[1])

    def stop(self) -> dict[str, int]:
        """End the helpers still running (the engine has compiled what they had left) -> how many had finished, were
        stopped so and had failed (an error: the engine compiled their classes itself), also logged."""
        ended = {"finished": 0, "stopped": 0, "failed": 0}
        for p in self.procs:
            running = p.poll() is None
            if running:
                p.kill()
            code = p.wait()
            ended["stopped" if running else "finished" if code == 0 else "failed"] += 1
        if self.procs:
            log.info("compile helpers: %d finished, %d stopped, %d failed; the engine waited %.1f s for them (%s)",
                     *ended.values(), sum(self.reports.waits.values()), self.reports.describe())
        return ended
