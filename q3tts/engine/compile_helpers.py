"""Compile helpers: processes that compile part of a cold start's warm-ups into the shared compile cache while the
engine's own process runs all of them.

A runner's warm-ups (q3tts.engine.graphs.warm_ups) fall into shape classes, each of which compiles its own variants of
the layers, the code predictor's step and the samplers (a one-row frame per sampler, a frame of two rows and more per
sampler, one prompt's prefill, a wave, a batched prefill, a long prompt). The engine's process works through them in
order, compiling each class's variants as it reaches it. A helper is a fresh process that loads the same checkpoint,
builds a runner of the same geometry and runs only the first warm-up of the classes it is given, then exits: Inductor's
FX graphs and the AOTAutograd entries it writes are keyed by the traced graph, so when the engine reaches those classes
it traces them (Dynamo runs in every process) and takes the rest from the cache. Nothing a helper does changes what the
engine computes: a cache hit is the graph the engine would have compiled; a helper that fails or is late only leaves
the engine compiling that class itself.

Off unless $Q3TTS_COMPILE_HELPERS says otherwise: "auto" (which `q3tts serve` sets; not `q3tts warmup`, a build step
whose speed matters less than its artifact holding what one process compiled) or a number. Started only for a cold start
(no Dynamo entry installed from the cache or an artifact) of a compiled, captured runner with a contiguous cache, and
only as many as the CPU cores and the free GPU memory hold (each builds a runner of the engine's size).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch

from .. import invariant
from .compile import compile_counts

ENV = "Q3TTS_COMPILE_HELPERS"
ENTRY = "q3tts.engine.helper_process"  # a helper's process: python -m ENTRY SPEC (a module of its own: it imports the
# runner and the warm-ups, which import this one)
MAX_HELPERS = 5
log = logging.getLogger("q3tts.engine")


@dataclass(slots=True)
class Source:
    """What a helper needs to build the engine's runner again: the checkpoint as loaded and the runner's geometry."""

    model_dir: str
    device: str
    dtype: str  # e.g. "bfloat16"
    quantization: str | None
    max_slots: int
    max_len: int


def shape_class(name: str) -> str:
    """The compiled variants a named warm-up (graphs.warm_ups) shares with others: frames by one row or more and
    sampler ('frame 1 capped', 'frame 2+ full'), the rest by kind ('prefill', 'wave', 'batch 2', 'long')."""
    kind, *rest = name.split()
    if kind == "frame":
        return f"frame {'1' if rest[0] == '1' else '2+'} {rest[1]}"
    return " ".join([kind, *rest[:1]]) if kind == "batch" else kind


def plan(names: list[str], helpers: int) -> list[list[str]]:
    """Per helper, the warm-ups it runs: the first of each shape class after the engine's own first one, dealt in
    the engine's order (so the classes the engine reaches first are compiled first)."""
    firsts, seen = [], set()
    for name in names:
        c = shape_class(name)
        if c not in seen:
            seen.add(c)
            firsts.append(name)
    rest = firsts[1:]
    return [rest[i::helpers] for i in range(min(helpers, len(rest)))]


def wanted(runner) -> int:
    """How many helpers this cold start gets: $Q3TTS_COMPILE_HELPERS ('auto': up to MAX_HELPERS), bounded by the
    cores (a helper is one busy core plus Inductor's compile workers: half the cores, less one for the engine) and by
    the GPU memory free beyond what the engine may still take (a tenth of the device, outside its budget, and a
    quarter of what it holds now plus 2 GiB for its captures and warm-ups), each helper holding what the engine holds
    now (the same runner) plus 1 GiB (its context and warm-up activations); 0 where helpers cannot help (no
    compilation, no CUDA graphs, a paged cache, Dynamo entries already installed: a warm start)."""
    setting = os.environ.get(ENV, "0").strip().lower()
    if setting in ("", "0", "off", "no", "false") or not (runner.compiled and runner.use_graphs):
        return 0
    if setting != "auto" and not setting.isdigit():
        raise ValueError(f"${ENV}={setting!r}: expected auto, 0 (off) or a number of helper processes")
    if runner.block_table is not None or compile_counts()["dynamo_hit"]:
        return 0
    n = MAX_HELPERS if setting == "auto" else int(setting)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = min(n, max(0, cores // 2 - 1))
    dev = runner.device
    free, total = torch.cuda.mem_get_info(dev)
    used = torch.cuda.memory_allocated(dev)
    spare = free - total * 0.1 - used * 0.25 - (2 << 30)
    return max(0, min(n, int(spare // (used + (1 << 30)))))


class Helpers:
    """The helper processes of one cold start (started by graphs.capture_runner before its warm-ups, stopped after)."""

    def __init__(self, source: Source | None, runner, names: list[str]):
        self.procs: list[subprocess.Popen] = []
        n = wanted(runner) if source is not None else 0
        if not n:
            return
        env = dict(os.environ, **{ENV: "0"})  # (the compile cache's directory is in it: engine.compile)
        dealt = plan(names, n)
        for units in dealt:
            spec = json.dumps({"source": asdict(source), "units": units, "batch_invariant": invariant.ENABLED})
            self.procs.append(subprocess.Popen([sys.executable, "-m", ENTRY, spec], env=env,
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
        log.info("compile helpers: %d processes for %s", len(self.procs), dealt)

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
            log.info("compile helpers: %d finished, %d stopped, %d failed", *ended.values())
        return ended
