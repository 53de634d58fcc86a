"""CPU benchmark: the engine as shipped, fp32 vs int8 / int4 (weight-only) / int8dyn (int8 weights and activations),
at several thread counts.

    python -m bench.make_checkpoint --model 0.6B-CustomVoice --out /tmp/ck06
    CUDA_VISIBLE_DEVICES= python -m bench.cpu --ckpt /tmp/ck06 --threads 2,16 --out cpu.json

Random weights at the real dimensions (the checkpoint's EOS row is zero, so every run decodes exactly the
frames asked for). Per (quantization, threads), after a warm-up:
- decode: codes only (prefill + N frames), ms per frame and real-time factor of the frames alone
- end to end, non-streaming (prompt, frames, exact vocoder): real-time factor
- streaming (first chunk 1 frame, the default schedule, the exact streaming vocoder): time to first audio
  p50 and the streaming real-time factor
- a batch of --batch streams decoded together: aggregate audio seconds per second
Prints a table and writes one JSON (--out). --compile adds the compiled variant (decoder layers compiled one by one,
the code-predictor step whole for one stream). The JSON records the settings that shape the CPU
path (ISA torch dispatches to, VNNI, threads, compile).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from bench.peers import DEFAULT_TEXT as TEXT

FRAME_S = 0.08


def clock(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(tts, N: int, repeats: int, batch: int, ttfa_runs: int, speaker: str) -> dict:
    kw = dict(speaker=speaker, language="English", max_new_tokens=N + 1, seed=0)
    pr = tts.prepare_custom_voice(TEXT, **kw)
    # each path once before it is timed: compilation (when on) and first-use allocations stay out of the clocks
    tts.generate_codes(pr)
    dec = statistics.median(clock(lambda: tts.generate_codes(pr))[0] for _ in range(repeats))
    tts.generate_custom_voice(TEXT, **kw)
    e2e = statistics.median(clock(lambda: tts.generate_custom_voice(TEXT, **kw))[0] for _ in range(repeats))
    ttfa, walls = [], []
    for i in range(ttfa_runs + 1):
        t0 = time.perf_counter()
        it = tts.generate_custom_voice_stream(TEXT, **kw)
        first = next(it)
        t_first = time.perf_counter() - t0
        n = len(first.audio) + sum(len(c.audio) for c in it)
        if i > 0:  # run 0 warms up
            ttfa.append(t_first)
            walls.append(time.perf_counter() - t0)
        assert n == N * tts.samples_per_frame, n
    r = dict(decode_ms_per_frame=round(1000 * dec / N, 1), decode_rtf=round(N * FRAME_S / dec, 3),
             e2e_rtf=round(N * FRAME_S / e2e, 3), ttfa_ms_p50=round(1000 * statistics.median(ttfa), 1),
             stream_rtf=round(N * FRAME_S / statistics.median(walls), 3))
    if batch > 1:
        texts = [TEXT] * batch
        tts.generate_custom_voice(texts, **kw)
        t = statistics.median(clock(lambda: tts.generate_custom_voice(texts, **kw))[0] for _ in range(max(1, repeats - 1)))
        r[f"batch{batch}_audio_s_per_s"] = round(batch * N * FRAME_S / t, 3)
    return r


def profile(tts, N: int, speaker: str, top: int = 25) -> dict:
    """One decode of N frames under torch.profiler (after the timed runs: nothing compiles in it). Per frame: wall ms,
    and the `top` ops by self CPU time (ms and calls per frame); 'other_ms' is the self time of every other op."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    pr = tts.prepare_custom_voice(TEXT, speaker=speaker, language="English", max_new_tokens=N + 1, seed=0)
    with prof(activities=[ProfilerActivity.CPU]) as p:
        wall, _ = clock(lambda: tts.generate_codes(pr))
    ev = sorted(p.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [dict(op=e.key, self_ms=round(e.self_cpu_time_total / 1000 / N, 2), calls=round(e.count / N, 1))
           for e in ev[:top]]
    return dict(frames=N, wall_ms_per_frame=round(1000 * wall / N, 1), ops=ops,
                other_ms=round(sum(e.self_cpu_time_total for e in ev[top:]) / 1000 / N, 2))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--modes", default="fp32,int8,int4,int8dyn", help="fp32 (unquantized) and/or quantizations")
    ap.add_argument("--threads", default="2", help="comma-separated torch.set_num_threads values")
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ttfa-runs", type=int, default=3)
    ap.add_argument("--compile", default="off", help="off, on, or both (torch.compile of the decode steps)")
    ap.add_argument("--speaker", default="ryan")
    ap.add_argument("--inductor", default="", help="Inductor settings before anything compiles (bench.ours' flag), "
                    "e.g. cpp_wrapper=True")
    ap.add_argument("--profile", type=int, default=0, help="also profile a decode of N frames per run: the ops with "
                    "the most self CPU time, per frame (JSON key 'profile')")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from bench.ours import set_inductor
    from q3tts import TTS
    inductor = set_inductor(a.inductor)
    res = {"engine": "q3tts", "device": "cpu", "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "frames": a.frames, "batch": a.batch,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": [],
           "settings": {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "vnni": torch.cpu._is_vnni_supported(),
                        "amx": torch.cpu._is_amx_tile_supported(), "mkldnn": torch.backends.mkldnn.is_available(),
                        "fused_qkv_gate_up": "quantized modes",
                        "int8dyn_reduce_range": not torch.cpu._is_vnni_supported(),
                        **({"inductor": inductor} if inductor else {})}}
    try:
        res["cpu"] = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    compiles = {"off": [False], "on": [True], "both": [False, True]}[a.compile]
    for mode in a.modes.split(","):
        for comp in compiles:
            tts = TTS.from_pretrained(a.ckpt, device="cpu", max_batch_size=max(a.batch, 1), max_seq_len=512,
                                      compile=comp, quantization=None if mode == "fp32" else mode)
            for th in (int(t) for t in a.threads.split(",")):
                torch.set_num_threads(th)
                r = dict(quantization=mode, compile=comp, threads=th,
                         **measure(tts, a.frames, a.repeats, a.batch, a.ttfa_runs, a.speaker))
                if a.profile:
                    r["profile"] = profile(tts, a.profile, a.speaker)
                res["runs"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
                if a.out:  # after every run: a run cut short by a time limit keeps what it measured
                    open(a.out, "w").write(json.dumps(res, indent=1))
            del tts
    base = {(r["threads"], r["compile"]): r["decode_ms_per_frame"] for r in res["runs"] if r["quantization"] == "fp32"}
    for r in res["runs"]:
        b = base.get((r["threads"], False))
        if b:
            r["decode_speedup_vs_fp32"] = round(b / r["decode_ms_per_frame"], 2)
    out = json.dumps(res, indent=1)
    if a.out:
        open(a.out, "w").write(out)
    print(f"\n{res['cpu']}, torch {res['torch']}, {a.frames} frames")
    print(f"| weights | compile | threads | decode ms/frame | x fp32 | decode RTF | e2e RTF | TTFA p50 ms | stream RTF | "
          f"batch {a.batch} audio s/s |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in res["runs"]:
        print(f"| {r['quantization']} | {'on' if r['compile'] else 'off'} | {r['threads']} | {r['decode_ms_per_frame']} | "
              f"{r.get('decode_speedup_vs_fp32', '')} | {r['decode_rtf']} | {r['e2e_rtf']} | {r['ttfa_ms_p50']} | "
              f"{r['stream_rtf']} | {r.get(f'batch{a.batch}_audio_s_per_s', '')} |")


if __name__ == "__main__":
    main()
