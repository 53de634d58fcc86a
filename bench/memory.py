"""GPU memory of the engine: `q3tts serve` defaults, one stream per quantization, small GPUs, streams per H100.

    python -m bench.memory --ckpt /tmp/ck06 --out $OUT/memory.json      # makes the checkpoint if DIR is empty

Every case runs in its own process (clean peak counters, nothing cached from another case) and prints one JSON
line; the parent collects them, prints a table and writes one JSON file. A random checkpoint at the real
dimensions (bench/make_checkpoint.py: EOS impossible), so each stream makes exactly the frames asked for
(20 s = 250 frames: max_new_tokens 251). Figures per case:
  weights_gib       torch.cuda.memory_allocated() after loading (talker + code predictor + Code2Wav)
  ready_*           once the engine is built (caches, CUDA graphs) and warmed up: allocated / reserved by PyTorch,
                    device_used = total - free (CUDA context included; one process on the GPU)
  peak_*            the same after the load: max_memory_allocated / max_memory_reserved / device_used then
  nvidia_smi_mib    this process's used_memory per nvidia-smi (None where pids are not visible)
  slots, seq_len    what the engine chose (sizing) or was given
  ok / error        whether every stream of the load finished with 250 frames

Cases (--cases, default all in this order; the total stays within --time-budget seconds, skipping the rest):
  serve        the engine exactly as `q3tts serve` builds it with no flags (server.app.create_app), compile off, its
               warm-up request, then one burst of `slots` concurrent 20 s streams
  quant-*      one stream (max_concurrent 1), quantization none / int8 / fp8, compile off: a 20 s stream
  small-16gb   serve defaults in a simulated 16 GB GPU (torch.cuda.set_per_process_memory_fraction), burst of all slots
  small-3gb    `--gpu-memory 3` (+ a 3 GB fraction), one 20 s stream, for none and int8
  serve-compiled  as serve with compile on (adds ~3 min of compilation)
  fit-*        streams of 20 s that fit the H100: after = the sizing's slots at 512 / 4096 positions without the
               32-slot cap, all run at once; before = the pre-#15 engine's figures (legacy knobs on this code:
               uncapped vocoder calls, unchunked attention, power-of-two rows) at 64 and 128 slots x 512, whose
               peak slope gives the old per-slot cost and so the old count for the same budget
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FRAMES = 250  # 20 s of audio
GIB = 1 << 30
CASES = ("serve", "quant-none", "quant-int8", "quant-fp8", "small-16gb", "small-3gb", "small-3gb-int8", "serve-compiled",
         "fit-before-64", "fit-before-128", "fit-after-4096", "fit-after-512")


# --------------------------------------------------------------------------- one case (child process)
def _smi_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()):
            return float(parts[1])
    return None


def _snap(prefix: str) -> dict:
    import torch
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {f"{prefix}_allocated_gib": torch.cuda.memory_allocated() / GIB,
            f"{prefix}_reserved_gib": torch.cuda.memory_reserved() / GIB,
            f"{prefix}_max_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            f"{prefix}_max_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
            f"{prefix}_device_used_gib": (total - free) / GIB, f"{prefix}_nvidia_smi_mib": _smi_mib()}


def _prepared(tts, n: int):
    kw = dict(max_new_tokens=FRAMES + 1, seed=0)
    spk = tts.get_supported_speakers()[0]
    return [tts.prepare_custom_voice(f"Stream {i}: the quick brown fox jumps over the lazy dog.", spk, **kw)[0]
            for i in range(n)]


async def _burst(aeng, prepared) -> list[int]:
    """All at once through the AsyncEngine (streamed: the exact vocoder, 1 then doubling to 16-frame chunks)."""
    from q3tts.engine.request import StreamOptions

    async def one(i, p):
        frames = 0
        async for c in aeng.generate(p, StreamOptions(1, 16), request_id=f"load-{i}"):
            frames += c.num_frames
        return frames

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prepared))))


def _legacy_knobs() -> None:
    """The pre-#15 engine's workspaces on this code: vocoder calls of every row at once, attention scores of all heads
    at once (rows are made a power of two by the caller)."""
    import q3tts.engine.vocoder as V
    import q3tts.models.layers as L
    d = list(V.StreamingVocoder.__init__.__defaults__)
    d[-1] = 1 << 20  # max_call_frames
    V.StreamingVocoder.__init__.__defaults__ = tuple(d)
    L.ATTN_SCORES_CHUNK = 1 << 62


def run_case(case: str, ckpt: str) -> dict:
    import torch
    res: dict = {"case": case}
    total = torch.cuda.get_device_properties(0).total_memory
    res["device"] = torch.cuda.get_device_name(0)
    res["device_total_gib"] = total / GIB
    frac_gb = {"small-16gb": 16, "small-3gb": 3, "small-3gb-int8": 3}.get(case)
    if frac_gb:
        torch.cuda.set_per_process_memory_fraction(frac_gb * 1e9 / total)
        res["simulated_gpu_gb"] = frac_gb
    if case.startswith("serve") or case == "small-16gb":
        os.environ["Q3TTS_COMPILE"] = "1" if case == "serve-compiled" else "0"
        from q3tts.server.app import create_app, load_model
        from q3tts.server.settings import parse_args
        settings = parse_args(["--model", ckpt, "--voice-dir", f"/tmp/q3tts-bench-voices-{os.getpid()}"], environ={})
        t0 = time.perf_counter()
        tts = load_model(settings)
        res["weights_gib"] = torch.cuda.memory_allocated() / GIB
        app = create_app(tts, settings)  # builds the engine: sizing, caches, graphs
        serving, aeng = app.state.serving, app.state.engine
        asyncio.run(serving.warmup())
        res["startup_s"] = time.perf_counter() - t0
        res["warmup_error"] = serving.warmup_error
        eng = aeng.engine
        res.update(slots=eng.scheduler.max_slots, seq_len=eng.runner.max_len, **_snap("ready"))
        frames = asyncio.run(_burst(aeng, _prepared(tts, eng.scheduler.max_slots)))
        aeng.shutdown()
    else:
        from q3tts.api import TTS
        from q3tts.engine import memory as M
        from q3tts.engine.engine import Engine
        quant = {"quant-int8": "int8", "quant-fp8": "fp8", "small-3gb-int8": "int8"}.get(case)
        tts = TTS.from_pretrained(ckpt, quantization=quant, compile=False)
        res["weights_gib"] = torch.cuda.memory_allocated() / GIB
        res["quantization"] = quant or "none"
        opts: dict = dict(compile=False)
        if case.startswith("quant") or case.startswith("small-3gb"):
            opts.update(max_slots=1, max_seq_len=None)
            if case.startswith("small-3gb"):
                opts["gpu_memory"] = 3.0
        elif case.startswith("fit-after"):
            n = int(case.rsplit("-", 1)[1])
            torch.cuda.empty_cache()
            ckp = tts.ckpt
            row = ckp.code2wav.init_state(1, "meta", ckp.dtype)
            per = M.slot_bytes(ckp.cfg.talker, 2, sum(t.nbytes for t in (*row.tails, row.keys, row.values)))
            room = M.device_room(ckp.device)
            p = M.plan(room, per, lambda s, k: M.workspace(ckp.cfg.talker, s, k), max_seq_len=n, cap_slots=4096)
            res["plan"] = p.describe()
            opts.update(max_slots=p.max_slots, max_seq_len=n)
        elif case.startswith("fit-before"):
            _legacy_knobs()
            opts.update(max_slots=int(case.rsplit("-", 1)[1]), max_seq_len=512)
        t0 = time.perf_counter()
        eng = Engine(tts.ckpt, **opts)
        res["startup_s"] = time.perf_counter() - t0
        res.update(slots=eng.scheduler.max_slots, seq_len=eng.runner.max_len, **_snap("ready"))
        from q3tts.engine.async_engine import AsyncEngine
        aeng = AsyncEngine(eng)
        t0 = time.perf_counter()
        frames = asyncio.run(_burst(aeng, _prepared(tts, eng.scheduler.max_slots)))
        res["load_s"] = time.perf_counter() - t0
        aeng.shutdown()
    res.update(_snap("peak"))
    res["streams"] = len(frames)
    res["ok"] = all(f == FRAMES for f in frames)
    if not res["ok"]:
        res["frames"] = sorted(set(frames))
    return res


def child_main(case: str, ckpt: str) -> None:
    try:
        res = run_case(case, ckpt)
    except Exception as e:  # OOM or a refusal: a result too
        import traceback
        traceback.print_exc()
        res = {"case": case, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        try:
            res.update(_snap("peak"))
        except Exception:
            pass
    print("RESULT " + json.dumps(res), flush=True)


# --------------------------------------------------------------------------- the parent
def _fit_before(results: dict, budget_gib: float) -> dict | None:
    """Old streams per GPU: the peak grows linearly with slots at 512 positions; fit the 64 -> 128 slope."""
    a, b = results.get("fit-before-64"), results.get("fit-before-128")
    if not (a and b and a.get("ok") and b.get("ok")):
        return None
    slope = (b["peak_max_reserved_gib"] - a["peak_max_reserved_gib"]) / 64  # GiB per slot
    base = a["peak_max_reserved_gib"] - 64 * slope
    return {"gib_per_slot": slope, "base_gib": base, "budget_gib": budget_gib,
            "streams": int((budget_gib - base) / slope) if slope > 0 else None}


def _table(results: dict) -> str:
    cols = ("case", "slots", "seq_len", "weights_gib", "ready_reserved_gib", "ready_device_used_gib",
            "peak_max_allocated_gib", "peak_max_reserved_gib", "peak_device_used_gib", "peak_nvidia_smi_mib", "ok")
    rows = [cols]
    for r in results.values():
        rows.append(tuple((f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "-"))) for c in cols))
    w = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(x.ljust(w[i]) for i, x in enumerate(r)) for r in rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="a 0.6B checkpoint dir (made with bench.make_checkpoint if empty)")
    ap.add_argument("--out", default=None, help="JSON file (default: $OUT/memory.json if $OUT is set)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--time-budget", type=float, default=440.0, help="seconds; cases that would start later are "
                                                                   "skipped (serve-compiled needs ~240 s)")
    ap.add_argument("--case-timeout", type=float, default=240.0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child_main(a.child, a.ckpt)
    t_start = time.perf_counter()
    ck = Path(a.ckpt)
    if not (ck / "config.json").exists():
        from bench.make_checkpoint import make
        print(f"making a random 0.6B-CustomVoice checkpoint in {ck} ...", flush=True)
        make("0.6B-CustomVoice", ck)
    out = a.out or (os.path.join(os.environ["OUT"], "memory.json") if os.environ.get("OUT") else None)
    results: dict[str, dict] = {}
    skipped = []
    for case in [c for c in a.cases.split(",") if c]:
        left = a.time_budget - (time.perf_counter() - t_start)
        need = 240 if case == "serve-compiled" else 25
        if left < need:
            skipped.append(case)
            continue
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "bench.memory", "--ckpt", str(ck), "--child", case]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=min(a.case_timeout, left + 30),
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else {"case": case, "ok": False, "error": "no result",
                                                     "stderr_tail": p.stderr[-3000:]}
            if not res.get("ok"):
                res.setdefault("stderr_tail", p.stderr[-3000:])
        except subprocess.TimeoutExpired:
            res = {"case": case, "ok": False, "error": "timeout"}
        res["case_s"] = round(time.perf_counter() - t0, 1)
        results[case] = res
        print(json.dumps({k: v for k, v in res.items() if k != "stderr_tail"}), flush=True)
    total_gib = next((r["device_total_gib"] for r in results.values() if "device_total_gib" in r), None)
    summary = {"fit_before_extrapolated": _fit_before(results, 0.9 * total_gib) if total_gib else None,
               "streams_20s": {
                   "before_default (fixed 32 x 4096)": 32,
                   "after_default (serve, no flags)": results.get("serve", {}).get("slots"),
                   "after_sized_512": results.get("fit-after-512", {}).get("slots"),
                   "after_sized_4096": results.get("fit-after-4096", {}).get("slots")},
               "skipped": skipped, "total_s": round(time.perf_counter() - t_start, 1)}
    fb = summary["fit_before_extrapolated"]
    if fb:
        summary["streams_20s"]["before_at_512 (legacy knobs, extrapolated)"] = fb["streams"]
    print(_table(results))
    print(json.dumps(summary, indent=2))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"results": results, "summary": summary}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
