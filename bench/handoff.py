"""How long a streamed chunk waits between the engine's thread and the caller of `generate_*_stream` (any device):
per run, first audio (call to first chunk in hand) and the part of it after the engine made the chunk (`elapsed_s`):
the cross-thread handoff. Runs alternate between the loop as it is and the loop without its yield after a delivery
(async_engine's NOTE(handoff)), in one process, so both see the same machine load. On an older q3tts (PYTHONPATH to
its copy) it times that one as it is.

    OMP_NUM_THREADS=1 python -m bench.handoff --runs 100            # a tiny checkpoint on the CPU
    PYTHONPATH=<old copy> python bench/handoff.py --ckpt <tiny checkpoint> --runs 100
    python -m bench.handoff --ckpt /tmp/ck06 --device cuda --runs 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from q3tts import TTS
from q3tts.engine import async_engine

TEXT = "Hello there, this is a test of the first audio latency of the engine."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", help="a checkpoint directory (default: a tiny random one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=100, help="runs per mode")
    ap.add_argument("--frames", type=int, default=40)
    a = ap.parse_args(argv)
    ckpt = a.ckpt or tempfile.mkdtemp(prefix="q3tts-handoff-")
    if not a.ckpt:
        from q3tts.randomckpt import make_tiny
        make_tiny(ckpt)
    tts = TTS.from_pretrained(ckpt, device=a.device, max_batch_size=4, max_seq_len=256)
    kw = dict(speaker="ryan", language="English", max_new_tokens=a.frames, seed=0)
    # (a q3tts without the yield, e.g. ceed380's, whose caller stepped the engine itself: one mode, as it is)
    real = getattr(async_engine, "_yield_cpu", None)
    modes = {"yield": real, "no yield": lambda: None} if real else {"as is": None}
    first, after = {m: [] for m in modes}, {m: [] for m in modes}
    for i in range(len(modes) * a.runs + 2):  # the first two warm up
        mode = list(modes)[i % len(modes)]
        if real:
            async_engine._yield_cpu = modes[mode]
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        it = tts.generate_custom_voice_stream(TEXT, **kw)
        chunk = next(it)
        t1 = time.perf_counter()
        for _ in it:
            pass
        if i >= 2:
            first[mode].append(1000 * (t1 - t0))
            after[mode].append(1000 * (t1 - t0 - chunk.elapsed_s))
    if real:
        async_engine._yield_cpu = real
    stat = lambda v: dict(p50=round(statistics.median(v), 3), mean=round(statistics.mean(v), 3),  # noqa: E731
                          p90=round(statistics.quantiles(v, n=10)[8], 3))
    res = {"device": a.device, "runs_per_mode": a.runs, "frames": a.frames, "torch": torch.__version__,
           "first_audio_ms": {m: stat(v) for m, v in first.items()},
           "after_chunk_made_ms": {m: stat(v) for m, v in after.items()}}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
