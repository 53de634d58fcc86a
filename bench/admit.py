"""What admitting a wave of newcomers costs on the host: `ModelRunner.admit` of N CustomVoice requests at once, by
wave size, and its prompt-embedding part, each the median wall time over --runs (after --warmup), synchronized
before and after (admit returns the wave's code 0 on the device: the sync after it waits for the wave).

The engine is built as `q3tts serve` builds it (TTS.from_pretrained with serve's defaults, then build_engine:
torch.compile and CUDA graphs where serve has them; --slots: serve's --max-concurrent). Prints one JSON object:
per N, admit_ms, embed_ms (the wave's embedding, synchronized) and embed_host_ms (until the embedding call returns,
no sync: its launch cost); with --profile N, the counts of the host-side events of one admit of N that matter here
(copies, syncs) from torch.profiler.

--behind S: whole engine steps as the server runs them (the deadline policy on): S streams running, then --runs
steps per wave size that each admit N newcomers of 3 frames, three steps without newcomers after each (they finish
there). Per N, the median step_ms, its admission phase (admit_phase_ms: the engine's counter) and the steps without
newcomers (plain_step_ms); steps that admitted another number are left out (`admitted_other`).

    python3 -m q3tts.cli make-checkpoint --tiny /tmp/tiny && python3 -m bench.admit --ckpt /tmp/tiny --device cpu
    python3 -m bench.make_checkpoint --model 0.6B-CustomVoice --out /tmp/ck06 && python3 -m bench.admit --ckpt /tmp/ck06

It imports only q3tts, so the same file also runs against an older checkout (a checkout without embed_prompts:
its embedding part is the per-prompt embed_prompt loop that admit ran there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from q3tts import TTS
from q3tts.engine import StreamOptions
from q3tts.models import talker as talker_mod

TEXTS = ["Hello there.", "The quick brown fox jumps over the lazy dog, twice, before breakfast.",
         "A wave of newcomers arrives at once, and every running stream is waiting for its next frame.",
         "Short one.", "How long does it take to embed a prompt on the host and copy it to the device?",
         "Numbers like 1, 2, 3 and 2026 are tokens too.", "你好，今天天气真不错。", "One more sentence of middling length."]
PROFILED = ("cudaMemcpyAsync", "cudaStreamSynchronize", "Memcpy HtoD (Pageable -> Device)",
            "Memcpy HtoD (Pinned -> Device)", "aten::copy_", "aten::addmm", "aten::index_put_", "aten::index")


def wave(tts: TTS, n: int, **kwargs) -> list:
    speakers = sorted(tts.ckpt.cfg.talker.spk_id)
    texts = [TEXTS[i % len(TEXTS)] for i in range(n)]
    return tts.prepare_custom_voice(texts, [speakers[i % len(speakers)] for i in range(n)], ["Auto"] * n, seed=1,
                                    **kwargs)


def embed(runner, prepared: list) -> None:
    """The wave's embedding as admit does it (the per-prompt loop where embed_prompts does not exist)."""
    t = runner.talker
    if hasattr(talker_mod, "embed_prompts"):
        lens = [len(p.layout) for p in prepared]
        L = max(runner.prefill_len(1, n) for n in lens) if len(prepared) <= runner.prefill_alone_max() \
            else runner.prefill_len(len(prepared), max(lens))
        talker_mod.embed_prompts(t, [p.layout for p in prepared], [p.speaker_embedding for p in prepared],
                                 [p.ref_codes for p in prepared], L)
    else:
        for p in prepared:
            talker_mod.embed_prompt(t, p.layout, p.speaker_embedding, p.ref_codes)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, runs: int, warmup: int, synced: bool = True) -> float:
    """Median wall ms of fn() over runs (after warmup calls), synchronized before (and after, if synced)."""
    out = []
    for i in range(warmup + runs):
        sync(device)
        t0 = time.perf_counter()
        fn()
        if synced:
            sync(device)
        if i >= warmup:
            out.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(out), 3)


def profile(runner, prepared: list, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with prof(activities=acts) as p, torch.inference_mode():
        runner.admit(0, prepared)
        sync(device)
    counts = {e.key: e.count for e in p.key_averages()}
    return {k: counts.get(k, 0) for k in PROFILED}


def steps(tts: TTS, eng, waves: list[int], behind: int, runs: int) -> dict:
    """Whole steps admitting each wave size behind `behind` running streams (--behind)."""
    long = tts.prepare_custom_voice([TEXTS[i % len(TEXTS)] for i in range(behind)], ["vivian"] * behind, seed=1,
                                    max_new_tokens=eng.runner.max_len)
    running = [eng.add_request(p, stream=StreamOptions()) for p in long]
    while any(r.slot is None or r.first_sent_at is None for r in running):
        eng.step()
    c = eng.counters

    def step() -> tuple[float, float, int]:
        admitted, phase = c.admitted, c.phase_s["admit"]
        t0 = time.perf_counter()
        eng.step()
        return 1000 * (time.perf_counter() - t0), 1000 * (c.phase_s["admit"] - phase), c.admitted - admitted

    out = {}
    for n in waves:
        timed_steps, plain, other = [], [], 0
        for _ in range(runs):
            for p in wave(tts, n, max_new_tokens=4):  # 3 frames: done within the plain steps after
                eng.add_request(p, stream=StreamOptions())
            ms, phase, admitted = step()
            if admitted == n:
                timed_steps.append((ms, phase))
            else:
                other += 1
            for _ in range(3):
                plain.append(step()[0])
            while eng.scheduler.queue_depth or eng.scheduler.num_running > behind:
                step()
        med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
        out[n] = {"step_ms": med([t for t, _ in timed_steps]), "admit_phase_ms": med([p for _, p in timed_steps]),
                  "max_step_ms": round(max((t for t, _ in timed_steps), default=0.0), 3),
                  "plain_step_ms": med(plain), "steps": len(timed_steps), "admitted_other": other}
    for r in running:
        eng.abort(r.request_id)
    while eng.has_work():
        eng.step()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="a checkpoint directory (bench.make_checkpoint, or --tiny)")
    ap.add_argument("--device", default=None, help="default: cuda if available")
    ap.add_argument("--waves", default="1,8,16,64", help="wave sizes N, comma-separated")
    ap.add_argument("--slots", type=int, default=128, help="engine slots (serve's --max-concurrent; the issue's "
                    "measurements ran 128)")
    ap.add_argument("--max-seq-len", type=int, default=None, help="serve's --max-seq-len (default: its default)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="also profile one admit of this wave size")
    ap.add_argument("--behind", type=int, default=0, help="also time whole steps admitting each wave behind this "
                    "many running streams")
    a = ap.parse_args(argv)
    waves = [int(n) for n in a.waves.split(",")]
    tts = TTS.from_pretrained(a.ckpt, device=a.device)
    eng = tts.build_engine(max_slots=max(a.slots, max(waves)), max_seq_len=a.max_seq_len,
                           deadline=True if a.behind else None)
    runner, dev = eng.runner, tts.ckpt.device
    assert runner.num_rows >= max(waves), f"{runner.num_rows} slots for a wave of {max(waves)}: pass --slots"
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "dtype": str(tts.ckpt.dtype),
           "slots": runner.num_rows, "max_seq_len": runner.max_len, "graphs": bool(runner.use_graphs),
           "compiled": bool(runner.compiled), "wave_graphs": len(getattr(runner, "wave_graphs", ())),
           "wave_embedding": "embed_prompts" if hasattr(talker_mod, "embed_prompts")
           else "embed_prompt per prompt", "runs": a.runs, "waves": {}}
    for n in waves:
        prepared = wave(tts, n)
        with torch.inference_mode():
            row = {"prompt_tokens": sum(len(p.layout) for p in prepared),
                   "admit_ms": timed(lambda: runner.admit(0, prepared), dev, a.runs, a.warmup),  # noqa: B023
                   "embed_ms": timed(lambda: embed(runner, prepared), dev, a.runs, a.warmup),  # noqa: B023
                   "embed_host_ms": timed(lambda: embed(runner, prepared), dev, a.runs, a.warmup, synced=False)}  # noqa: B023
        out["waves"][n] = row
    if a.profile:
        out["profile"] = {"N": a.profile, "events": profile(runner, wave(tts, a.profile), dev)}
    runner.slots.reset()
    if a.behind:
        out["steps"] = {"behind": a.behind, "waves": steps(tts, eng, waves, a.behind, a.runs)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
