"""GPU memory of the engine: `q3tts serve` defaults, one stream per quantization, small GPUs, streams per H100.

    python -m bench.memory --ckpt /tmp/ck06 --out $OUT/memory.json      # makes the checkpoint if DIR is empty

Every case runs in its own process (clean peak counters, nothing cached from another case) and prints one JSON
line; the parent collects them, prints a table and writes one JSON file. A random 0.6B checkpoint at the real
dimensions (bench/make_checkpoint.py: EOS impossible), so each stream makes exactly the frames asked for
(20 s = 250 frames: max_new_tokens 251). Figures per case:
  weights_gib       torch.cuda.memory_allocated() after loading (talker + code predictor + Code2Wav)
  ready_*           once the engine is built (sizing, caches, CUDA graphs) and warmed up: allocated / reserved by
                    PyTorch, device_used = total - free (CUDA context included; polluted while another case runs:
                    `concurrent` names it), nvidia_smi_mib (this pid's used_memory; None where pids are not visible)
  peak_*            the same after the load (max_memory_allocated / max_memory_reserved: the peaks)
  slots, seq_len    what the engine chose (sizing) or was given; streams / load_s / ok: the load run and whether
                    every stream got its 250 frames

Cases, in this order (serve-compiled runs in the background from the second case on, mostly compiling on the
CPU; the cases whose sizing reads the device's free memory wait for it; --time-budget skips what would start late):
  serve            `q3tts serve` with no flags (server.app.create_app), compile off: warm-up, then a burst of
                   `slots` concurrent 20 s streams
  small-16gb       the same in a simulated 16 GB GPU (torch.cuda.set_per_process_memory_fraction)
  quant-none/int8/fp8  one stream (max_concurrent 1) in a 3 GB budget (`--gpu-memory 3` + a 3 GB fraction set
                   after loading; load_peak_gib: loading's own peak, bf16 before quantization): 20 s
  fit-before-64/128    the pre-#15 engine's workspaces on this code (legacy knobs: vocoder calls of every row,
                   unchunked attention scores) at 64 / 128 slots x 512 positions, all streams: the slope of the
                   peak per slot gives the old count of 20 s streams per GPU
  serve-paged-16gb `q3tts serve --kv-block-size 64` in a simulated 16 GB GPU (paged KV: 32 slots; burst of 32,
                   whose load_s compares with serve's: the paging's cost in speed)
  serve-compiled   serve with compile on
  fit-after-512    contiguous caches: the sizing's slots at 512 positions without the 32-slot cap (engine built
                   with all of them; min(slots, 128) streams run)
  fit-paged-4096   paged at up to 4096 positions: slots = the 20 s streams the block pool holds (min(slots, 128) run)
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
RUN_CAP = 128  # streams actually run in the fit-after / fit-paged cases
GIB = 1 << 30
CASES = ("serve", "small-16gb", "quant-none", "quant-int8", "quant-fp8", "fit-before-64", "fit-before-128",
         "serve-paged-16gb", "serve-compiled", "fit-after-512", "fit-paged-4096")
BACKGROUND = "serve-compiled"  # started after the first case
AFTER_BACKGROUND = ("fit-after-512", "fit-paged-4096")  # their sizing reads the free memory: wait for it


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


def _serve(case: str, ckpt: str, res: dict):
    """The engine as `q3tts serve` builds it (flags: none, or --kv-block-size 64), warmed up as the server does."""
    import torch

    from q3tts.server.app import create_app, load_model
    from q3tts.server.settings import parse_args
    os.environ["Q3TTS_COMPILE"] = "1" if case == "serve-compiled" else "0"
    flags = ["--kv-block-size", "64"] if "paged" in case else []
    settings = parse_args(["--model", ckpt, "--voice-dir", f"/tmp/q3tts-bench-voices-{os.getpid()}", *flags],
                          environ={})
    t0 = time.perf_counter()
    tts = load_model(settings)
    res["weights_gib"] = torch.cuda.memory_allocated() / GIB
    app = create_app(tts, settings)  # builds the engine: sizing, caches, graphs
    serving, aeng = app.state.serving, app.state.engine
    asyncio.run(serving.warmup())
    res["startup_s"] = time.perf_counter() - t0
    res["warmup_error"] = serving.warmup_error
    return tts, aeng


def _engine(case: str, ckpt: str, res: dict):
    import torch

    from q3tts.api import TTS
    from q3tts.engine import memory as M
    from q3tts.engine.async_engine import AsyncEngine
    from q3tts.engine.engine import Engine
    quant = case.removeprefix("quant-") if case.startswith("quant-") else None
    tts = TTS.from_pretrained(ckpt, quantization=None if quant == "none" else quant, compile=False)
    res["weights_gib"] = torch.cuda.memory_allocated() / GIB
    res["load_peak_gib"] = torch.cuda.max_memory_allocated() / GIB  # bf16 weights before quantization included
    if quant:  # a 3 GB GPU from here on (loading quantizes from bf16 on the device: its peak is load_peak_gib)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.set_per_process_memory_fraction(3e9 / torch.cuda.get_device_properties(0).total_memory)
        res["simulated_gpu_gb"] = 3
    opts: dict = dict(compile=False)
    ck = tts.ckpt
    if quant:
        opts.update(max_slots=1, max_seq_len=None, gpu_memory=3.0)
    elif case.startswith("fit-before"):
        _legacy_knobs()
        opts.update(max_slots=int(case.rsplit("-", 1)[1]), max_seq_len=512)
    else:
        torch.cuda.empty_cache()
        per = M.slot_bytes(ck.cfg.talker, 2, M.vocoder_state_bytes(ck.code2wav, ck.dtype))
        room = M.device_room(ck.device)
        if case == "fit-after-512":
            p = M.plan(room, per, lambda s, k: M.workspace(ck.cfg.talker, s, k), max_seq_len=512, cap_slots=8192)
            res["plan"] = p.describe()
            opts.update(max_slots=p.max_slots, max_seq_len=512)
        else:  # fit-paged-4096: as many slots as the pool holds 20 s streams
            L = len(_prepared(tts, 1)[0].layout)
            per_stream = (L + FRAMES) // 64 + 1  # blocks of one 20 s stream
            block = 64 * M.kv_bytes_per_position(ck.cfg.talker)
            other = per(4096) - 4096 // 64 * block  # a slot's state besides its KV: trailing text, ...
            # the frame's gathered keys / values grow with slots x 4096: a per-slot cost of the paged cache
            other += M.paged_workspace(ck.cfg.talker, 1, 4096)
            free = room - M.workspace(ck.cfg.talker, 64, 4096) - block  # (the scratch block)
            slots = max(1, min(8192, free // (other + per_stream * block)))
            res["blocks_per_stream"] = per_stream
            opts.update(max_slots=slots, max_seq_len=4096, kv_block_size=64)
    t0 = time.perf_counter()
    eng = Engine(ck, **opts)
    res["startup_s"] = time.perf_counter() - t0
    res["num_blocks"] = getattr(eng.runner, "num_blocks", None)
    return tts, AsyncEngine(eng)


def run_case(case: str, ckpt: str) -> dict:
    import torch
    res: dict = {"case": case}
    total = torch.cuda.get_device_properties(0).total_memory
    res["device"] = torch.cuda.get_device_name(0)
    res["device_total_gib"] = total / GIB
    if "16gb" in case:
        torch.cuda.set_per_process_memory_fraction(16e9 / total)
        res["simulated_gpu_gb"] = 16
    tts, aeng = (_serve if case.startswith("serve") or case == "small-16gb" else _engine)(case, ckpt, res)
    eng = aeng.engine
    res.update(slots=eng.scheduler.max_slots, seq_len=eng.runner.max_len, **_snap("ready"))
    n = min(eng.scheduler.max_slots, RUN_CAP) if case.startswith("fit-after") or case.startswith("fit-paged") \
        else eng.scheduler.max_slots
    t0 = time.perf_counter()
    frames = asyncio.run(_burst(aeng, _prepared(tts, n)))
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
            "peak_max_allocated_gib", "peak_max_reserved_gib", "peak_device_used_gib", "peak_nvidia_smi_mib", "streams",
            "startup_s", "load_s", "ok")
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
    ap.add_argument("--time-budget", type=float, default=400.0, help="seconds; cases that would start later are "
                                                                   "skipped")
    ap.add_argument("--case-timeout", type=float, default=150.0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child_main(a.child, a.ckpt)
    t_start = time.perf_counter()
    ck = Path(a.ckpt)
    if not (ck / "config.json").exists():
        from q3tts.randomckpt import make_checkpoint as make
        print(f"making a random 0.6B-CustomVoice checkpoint in {ck} ...", flush=True)
        make("0.6B-CustomVoice", ck)
    out = a.out or (os.path.join(os.environ["OUT"], "memory.json") if os.environ.get("OUT") else None)
    results: dict[str, dict] = {}
    skipped = []

    def start(case):
        cmd = [sys.executable, "-m", "bench.memory", "--ckpt", str(ck), "--child", case]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}), time.perf_counter()

    def finish(case, proc, t0, timeout):
        try:
            stdout, err = proc.communicate(timeout=max(1.0, timeout))
            line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else {"case": case, "ok": False, "error": "no result"}
            if not res.get("ok"):
                res["stderr_tail"] = err[-3000:]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            res = {"case": case, "ok": False, "error": "timeout"}
        res["case_s"] = round(time.perf_counter() - t0, 1)
        results[case] = res
        print(json.dumps({k: v for k, v in res.items() if k != "stderr_tail"}), flush=True)
        if out:  # partial results survive a kill
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps({"results": results, "partial": True}, indent=2))

    cases = [c for c in a.cases.split(",") if c]
    bg_case = BACKGROUND if BACKGROUND in cases[1:] else None
    bg = None  # (process, start time) of the background case while it runs

    def left():
        return a.time_budget - (time.perf_counter() - t_start)

    for i, case in enumerate(c for c in cases if c != bg_case):
        if bg is not None and case in AFTER_BACKGROUND:
            finish(bg_case, *bg, left() + 60)
            bg = None
        if left() < 25:
            skipped.append(case)
            continue
        finish(case, *start(case), min(a.case_timeout, left()))
        if bg is not None:
            results[case]["concurrent"] = bg_case  # device_used includes the other process
        if i == 0 and bg_case:
            if left() > 200:
                bg = start(bg_case)
            else:
                skipped.append(bg_case)
    if bg is not None:
        finish(bg_case, *bg, left() + 60)
    total_gib = next((r["device_total_gib"] for r in results.values() if "device_total_gib" in r), None)
    summary = {"fit_before_extrapolated": _fit_before(results, 0.9 * total_gib) if total_gib else None,
               "streams_20s": {
                   "before: serve default (fixed 32 x 4096)": 32,
                   "after: serve default (no flags, sized, at most 32)": results.get("serve", {}).get("slots"),
                   "after: --max-seq-len 512 (sized, no cap)": results.get("fit-after-512", {}).get("slots"),
                   "after: --kv-block-size 64, up to 4096 positions": results.get("fit-paged-4096", {}).get("slots"),
                   "16 GB, before: 32 x 4096 (15 GB of KV + weights: does not start)": 0,
                   "16 GB, after: serve default": results.get("small-16gb", {}).get("slots"),
                   "16 GB, after: --kv-block-size 64": results.get("serve-paged-16gb", {}).get("slots")},
               "burst_32_load_s": {c: results.get(c, {}).get("load_s") for c in ("serve", "serve-paged-16gb")},
               "skipped": skipped, "total_s": round(time.perf_counter() - t_start, 1)}
    fb = summary["fit_before_extrapolated"]
    if fb:
        summary["streams_20s"]["before: --max-seq-len 512 (legacy knobs, extrapolated)"] = fb["streams"]
    print(_table(results))
    print(json.dumps(summary, indent=2))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"results": results, "summary": summary}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
