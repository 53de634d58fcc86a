"""Long form: one request of N minutes of narration, its sentences decoded in parallel, against the same segments
decoded one after another in the same process.

    python -m bench.longform --ckpt /tmp/ck06 --out $OUT/longform-0.6B.json        # makes the checkpoint if empty
    python -m bench.longform --ckpt /tmp/ck17 --model 1.7B-CustomVoice --minutes 60
    python -m bench.longform --tiny                                                # CPU smoke run (tests' checkpoint)

The checkpoint has random real-size weights with EOS impossible (bench/make_checkpoint's eos_zero), so every
segment runs to its max_new_tokens: the text is built of sentences of --words words, each given the frames a
narrator takes for it (--wpm words per minute at 12.5 frames per second), so the audio is --minutes long. Both runs
stream (`generate_custom_voice_stream(..., split_granularity="sentence")`, the exact stateful decoder); the
sequential one is q3tts.longform.stream with a window of one segment. Figures per run:
  wall_s          request in -> last chunk out
  first_audio_s   request in -> first chunk with audio
  audio_s         audio made (must equal segments x frames / 12.5 + pauses: checked)
  rtf             audio_s / wall_s
  peak_gib        CUDA: torch.cuda.max_memory_allocated over the run; CPU: the process's peak RSS (not reset)
The sequential run stops after --sequential-budget-s (its figures then cover the segments it finished: reported
with `segments`, and `projected_wall_s` = wall_s x all / done, labelled as a projection).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.golden: the tiny checkpoint (--tiny)

FPS = 12.5
WORDS = ("the old house stood at the end of a long road where the river turned toward the hills and every "
         "morning a quiet mist rose from the water while birds called across the fields").split()


def narration(num_sentences: int, words: int) -> list[str]:
    """Sentences of `words` words each (distinct, so no two prompts are the same)."""
    out = []
    for i in range(num_sentences):
        body = " ".join(WORDS[(i * 5 + k * 3) % len(WORDS)] for k in range(words - 2))
        out.append(f"Part {i} {body}.".capitalize())
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def run(tts, text: str, kw: dict, window: int | None, budget_s: float | None = None) -> dict:
    """One long request, streamed; window 1: one segment at a time."""
    from q3tts import longform
    from q3tts.engine.request import StreamOptions
    device = tts.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    opts = longform.make_options("sentence", kw.pop("pause_ms", 0))
    stream = longform.stream(tts, lambda t, **k: tts.prepare_custom_voice(t, kw["speaker"], "English", **k), text,
                             opts, {k: v for k, v in kw.items() if k != "speaker"}, StreamOptions(1, 16),
                             window=window)
    first, samples, stopped = None, 0, False
    for chunk in stream:
        if first is None and chunk.audio.size:
            _sync(device)
            first = time.perf_counter() - t0
        samples += chunk.audio.size
        if budget_s is not None and time.perf_counter() - t0 > budget_s and not chunk.is_last:
            stopped = True
            break
    stream.close()
    _sync(device)
    wall = time.perf_counter() - t0
    done = stream.segments_done
    res = {"segments": done, "wall_s": round(wall, 3), "first_audio_s": round(first, 4) if first else None,
           "audio_s": round(samples / tts.sample_rate, 3), "rtf": round(samples / tts.sample_rate / wall, 2),
           "peak_gib": round(_peak_gib(device), 3), "stopped_by_budget": stopped}
    if stopped and done:
        res["projected_wall_s"] = round(wall * stream.num_segments / done, 1)  # a projection, not a measurement
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (made with bench.make_checkpoint if empty)")
    ap.add_argument("--model", default="0.6B-CustomVoice", choices=["0.6B-CustomVoice", "1.7B-CustomVoice"])
    ap.add_argument("--minutes", type=float, default=60.0, help="minutes of narration")
    ap.add_argument("--words", type=int, default=15, help="words per sentence (one segment each)")
    ap.add_argument("--wpm", type=float, default=150.0, help="narration rate: words per minute")
    ap.add_argument("--pause-ms", type=int, default=0)
    ap.add_argument("--slots", type=int, default=None, help="engine slots (default: as many as the memory holds)")
    ap.add_argument("--sequential-budget-s", type=float, default=300.0, help="stop the sequential run after this")
    ap.add_argument("--no-sequential", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: the tests' tiny checkpoint, 20 s of audio")
    ap.add_argument("--out", default=None, help="write the result JSON here too")
    a = ap.parse_args(argv)
    from q3tts import TTS

    if a.tiny:
        from tests.golden import fixtures
        torch.set_num_threads(1)
        tts = TTS.from_pretrained(fixtures.checkpoint("cv06"), device="cpu", dtype=torch.float32, max_seq_len=256,
                                  max_batch_size=a.slots or 4)
        a.minutes, a.words, a.sequential_budget_s = min(a.minutes, 20 / 60), min(a.words, 15), 60.0
    else:
        if not a.ckpt:
            ap.error("--ckpt DIR is required (or --tiny)")
        if not (Path(a.ckpt) / "config.json").exists():
            from bench.make_checkpoint import make
            print(json.dumps(make(a.model, a.ckpt)), file=sys.stderr)
        tts = TTS.from_pretrained(a.ckpt, max_batch_size=a.slots)
    frames = max(3, round(a.words / a.wpm * 60 * FPS))  # per segment
    n = max(2, round(a.minutes * 60 * FPS / frames))
    sentences = narration(n, a.words)
    text = " ".join(sentences)
    kw = {"speaker": "ryan", "max_new_tokens": frames + 1, "seed": 0, "pause_ms": a.pause_ms}
    engine = tts.engine
    warm = " ".join(narration(2 * engine.scheduler.max_slots, a.words))  # compiles, graphs, every batch size
    run(tts, warm, dict(kw, max_new_tokens=4), None)
    expect_s = n * frames / FPS + (n - 1) * a.pause_ms / 1000
    result = {"model": "tiny-cv06" if a.tiny else a.model, "device": str(torch.cuda.get_device_name())
              if tts.device.type == "cuda" else "cpu", "slots": engine.scheduler.max_slots, "segments": n,
              "words": n * a.words, "chars": len(text), "frames_per_segment": frames, "pause_ms": a.pause_ms,
              "expected_audio_s": round(expect_s, 3)}
    result["parallel"] = par = run(tts, text, dict(kw), None)
    assert abs(par["audio_s"] - expect_s) < 1e-3, (par, expect_s)
    print(json.dumps({"parallel": par}), file=sys.stderr)
    if not a.no_sequential:
        result["sequential"] = seq = run(tts, text, dict(kw), 1, a.sequential_budget_s)
        if not seq["stopped_by_budget"]:
            assert abs(seq["audio_s"] - expect_s) < 1e-3, (seq, expect_s)
            result["speedup"] = round(seq["wall_s"] / par["wall_s"], 2)
    print(json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
