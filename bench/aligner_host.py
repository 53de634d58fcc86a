"""The host's share of one batched ForcedAligner.align() (graphs=True, rows alone): the host time before the device
can start, between its two launches and after its last result, on the CPU.

    OMP_NUM_THREADS=1 python3 -m bench.aligner_host --utterances 64 --seconds 5 --repeats 20 [--profile]

The tiny checkpoint of the golden fixtures on the CPU, with the two CUDA graphs emulated (each "replay" recomputes
its static output in place from its static inputs, as tests/test_align_graphs.py does), so that align() takes the
route it takes on CUDA: checks, staging, the encoder's launch, the prompts, the LM's launch, the results. The
replays' own time (the device's work on a GPU) is left out; what remains is host work on the critical path:
  before:  align()'s call -> the encoder's launch (checks, items, index rows, masks, the samples' staging);
           before_pass: the part of it before the padded pass's entry (align()'s checks)
  between: the encoder's launch returns -> the LM's launch (prompts: overlaps the encoder on a GPU)
  after:   the LM's launch returns -> align() returns (the results' copy, checks, slicing, times, WordTimes)
rows_write: the samples written into one [B, L] array on one thread, the staging's floor that "before" holds.
Medians over --repeats calls after a warm-up; --profile prints cProfile's top host functions of one more call.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.aligner import make_checkpoint, utterance
from q3tts.align import ForcedAligner


class _TimedReplay:
    """A CUDA graph's contract on the CPU (the output is one static tensor that replay() recomputes from the static
    inputs), each replay's (start, end) recorded in spans."""

    def __init__(self, fn, spans: list[tuple[float, float]]):
        self.fn, self.spans, self.out = fn, spans, fn()

    def replay(self):
        t0 = time.perf_counter()
        self.out.copy_(self.fn())
        self.spans.append((t0, time.perf_counter()))


def host_phases(a: ForcedAligner, wavs, sr: int, texts: list[str], spans: list) -> dict[str, float]:
    """One align() of the batch -> ms of each host phase (see the module doc)."""
    spans.clear()
    t0 = time.perf_counter()
    a.align(wavs, sr, texts, "English", rows_alone=True)
    t1 = time.perf_counter()
    assert len(spans) == 3, f"expected the pass's entry, the encoder's and the LM's replay, got {len(spans)}"
    (p0, _), (e0, e1), (l0, l1) = spans
    return dict(before=(e0 - t0) * 1e3, before_pass=(p0 - t0) * 1e3, between=(l0 - e1) * 1e3,
                after=(t1 - l1) * 1e3, device=(e1 - e0 + l1 - l0) * 1e3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--utterances", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top 25 functions of one call")
    a = ap.parse_args(argv)
    ckpt = make_checkpoint("tiny", Path(tempfile.mkdtemp(prefix="q3tts-aligner-host-")), torch.float32)
    aligner = ForcedAligner.from_pretrained(ckpt, device="cpu", graphs=True, resample_on_device=True)
    spans: list[tuple[float, float]] = []
    p = aligner._padded
    p._graph = lambda fn: (lambda g: (g, g.out))(_TimedReplay(fn, spans))
    p.capture = True
    call = type(p).__call__
    type(p).__call__ = lambda self, *args: spans.append((time.perf_counter(), 0.0)) or call(self, *args)
    sr = 24000
    items = [utterance(a.seconds, sr, i) for i in range(a.utterances)]
    wavs, texts = [w for w, _ in items], [t for _, t in items]
    aligner.align(wavs, sr, texts, "English", rows_alone=True)  # the bucket's two "graphs" made
    runs = [host_phases(aligner, wavs, sr, texts, spans) for _ in range(a.repeats)]
    out = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    rows = np.zeros((len(wavs), max(w.shape[0] for w in wavs)), np.float32)

    def write_rows() -> float:
        t0 = time.perf_counter()
        for b, w in enumerate(wavs):
            rows[b, :w.shape[0]] = w
        return (time.perf_counter() - t0) * 1e3
    out["rows_write"] = round(statistics.median(write_rows() for _ in range(a.repeats)), 3)
    out["critical"] = round(out["before"] + out["after"], 3)  # (between overlaps the encoder on a GPU)
    print(json.dumps(dict(bench="aligner_host", utterances=a.utterances, seconds=a.seconds, rate=sr,
                          repeats=a.repeats, ms=out)))
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        aligner.align(wavs, sr, texts, "English", rows_alone=True)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
