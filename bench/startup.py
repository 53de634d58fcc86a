"""Start-up time: process start -> engine ready, with an empty compile cache (cold), with the cache the cold
process left (warm), and with --artifact: an empty compile cache and the compiled artifact the cold process saved
(q3tts.engine.artifact: a fresh machine with the file), each in its own Python process. One JSON on --out, a table
on stderr.

    python -m bench.startup --ckpt /tmp/ck06 --device cpu --quantization int8dyn,none --max-slots 4 --max-seq-len 1024
    bash bench/startup.sh                                                                   # the GPU machine

"Ready" is what `q3tts serve` waits for before /ready says true: TTS.from_pretrained(compile=True), the engine
built with the server's sizes (CUDA: fitted to the memory budget, graphs captured) and the server's warm-up
request (8 frames, streamed). Each start reports the graphs Dynamo traced (`traced`), the functions whose cached
Dynamo entries it installed (`dynamo_hit`) and its seconds in Dynamo (`dynamo_s`: tracing, or installing entries).
Each run: a fresh temporary cache directory (cold), then a second process on the
same directory (warm); with --artifact a third on another fresh directory with the cold start's artifact. Each
start's Triton cache (the engine's own kernels) is as its compile cache: fresh for cold and artifact, the cold one's
for warm. The child reports its phases and the compile-cache counters (q3tts.engine.compile).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time


def child(a) -> None:
    """One start, as the server does it; prints one JSON line (times in seconds since the process started)."""
    t_start = float(os.environ["Q3TTS_STARTUP_T0"])  # the parent's clock just before it spawned this process
    import torch

    from q3tts import TTS
    from q3tts.engine.compile import compile_counts, dynamo_seconds
    t_import = time.time()
    prof = PhaseProfile() if a.profile else None
    quant = None if a.quantization in (None, "none") else a.quantization
    tts = TTS.from_pretrained(a.ckpt, device=a.device, compile=True, quantization=quant,
                              compile_cache=a.compile_cache, compile_artifact=a.compile_artifact)
    t_load = time.time()
    tts.build_engine(max_slots=a.max_slots, max_seq_len=a.max_seq_len, max_queue=256)  # as create_app
    t_engine = time.time()
    counts_engine = compile_counts()
    prepared = [tts.warmup_request()]  # serve's warm-up
    for _ in tts.stream(prepared, first_chunk_frames=1, chunk_frames=4):
        pass
    if tts.device.type == "cuda":
        torch.cuda.synchronize()
    t_ready = time.time()
    if a.save_artifact:  # (after ready: not part of the start's time)
        from q3tts.engine.artifact import save_artifact
        save_artifact(a.save_artifact, tts.ckpt)
    print(json.dumps({"artifact_loaded": tts.engine.artifact is not None if a.compile_artifact else None,
                      "artifact_bytes": os.path.getsize(a.save_artifact) if a.save_artifact else None,
                      "import_s": t_import - t_start, "load_s": t_load - t_import, "engine_s": t_engine - t_load,
                      "warmup_s": t_ready - t_engine, "ready_s": t_ready - t_start,
                      "graphs": tts.engine.num_graphs,
                      "engine_counts": counts_engine, "counts": compile_counts(), "dynamo_s": dynamo_seconds(),
                      "device": torch.cuda.get_device_name() if tts.device.type == "cuda" else "cpu",
                      "max_slots": tts.engine.runner.num_rows, "max_seq_len": tts.engine.runner.max_len,
                      "threads": torch.get_num_threads(),
                      # torch's modules read from bytecode (else compiled from source in this start)
                      "torch_bytecode": os.path.exists(importlib.util.cache_from_source(torch.__file__)),
                      **({"profile": prof.report()} if prof else {})}), flush=True)


class PhaseProfile:
    """--profile: wall time of each warm-up frame key, prefill shape and vocoder capture (synchronised), and Dynamo's
    per-function compile times: where a cold start goes."""

    def __init__(self):
        import torch

        from q3tts.engine import runner, vocoder
        self.calls: list[tuple[str, float]] = []

        def sync():  # (not while a CUDA graph is being captured: a sync there invalidates the capture)
            if torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize()

        def wrap(cls, name, label):
            orig = getattr(cls, name)

            def timed(this, *args, **kw):
                sync()
                t = time.time()
                out = orig(this, *args, **kw)
                sync()
                self.calls.append((label(args), time.time() - t))
                return out
            setattr(cls, name, timed)
        wrap(runner.ModelRunner, "_frame", lambda a: f"frame B={a[0]} n={a[1]} capped={a[2] if len(a) > 2 else False}")
        wrap(runner.ModelRunner, "prefill_padded", lambda a: f"prefill N={a[1].shape[0]} L={a[1].shape[1]}")
        wrap(runner.ModelRunner, "capture_graphs", lambda a: "runner capture_graphs")
        wrap(vocoder.StreamingVocoder, "capture_graphs", lambda a: "vocoder capture_graphs")

    def report(self) -> dict:
        import torch._dynamo.utils as du
        first: dict[str, float] = {}
        for label, s in self.calls:  # the first call per label: compilation + warm-up; later ones: capture, replays
            first.setdefault(label, s)
        slow = sorted(first.items(), key=lambda kv: -kv[1])
        return {"first_call_s": dict(slow), "sum_first_calls_s": sum(first.values()),
                "sum_all_calls_s": sum(s for _, s in self.calls), "num_calls": len(self.calls),
                "unique_graphs": du.counters["stats"]["unique_graphs"],
                "dynamo_compile_times": du.compile_times(repr="str", aggregate=True)[-6000:]}


def start(a, quantization: str, cache: str, artifact: tuple[str, str] | None = None, threads: int | None = None) -> dict:
    """One child start on compile cache `cache` (its Triton cache: cache/triton-eager); artifact: ("save" | "load",
    file); threads: torch's CPU threads in it (OMP_NUM_THREADS; None: the environment's)."""
    env = dict(os.environ, Q3TTS_STARTUP_T0=repr(time.time()), TRITON_CACHE_DIR=os.path.join(cache, "triton-eager"))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("Q3TTS_PRECOMPILE", "1")  # as `q3tts serve` starts (engine.compile.serve_precompile)
    for k in ("TORCHINDUCTOR_CACHE_DIR", "Q3TTS_COMPILE_CACHE"):
        env.pop(k, None)  # the child's only caches are the ones given (--compile-cache, TRITON_CACHE_DIR)
    cmd = [sys.executable, "-m", "bench.startup", "--child", "--ckpt", a.ckpt, "--quantization", quantization,
           "--compile-cache", cache] + (["--device", a.device] if a.device else [])
    if artifact:
        cmd += ["--save-artifact" if artifact[0] == "save" else "--compile-artifact", artifact[1]]
    cmd += ["--profile"] if a.profile else []
    cmd += [x for k in ("max_slots", "max_seq_len") if getattr(a, k) for x in (f"--{k.replace('_', '-')}",
                                                                               str(getattr(a, k)))]
    if a.profile:
        env["TORCH_LOGS"] = "recompiles"  # why each variant compiled: into the child's stderr, kept beside --out
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    if a.profile and a.out:
        with open(f"{a.out}.{quantization}.{os.path.basename(cache)}.{int(time.time())}.stderr.txt", "w") as f:
            f.write(out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    ap.add_argument("--quantization", default="none", help="comma-separated: none (exact), int8dyn, int8, fp8, ...")
    ap.add_argument("--max-slots", type=int, default=None, help="engine slots (default: as `q3tts serve`: fitted "
                    "to the memory budget: at most 32 on CUDA, 4 on a CPU)")
    ap.add_argument("--max-seq-len", type=int, default=None, help="KV positions per slot (default: as `q3tts serve`)")
    ap.add_argument("--runs", type=int, default=2, help="cold + warm pairs per quantization")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="time each warm-up frame key, prefill shape and the "
                    "vocoder's capture, and record Dynamo's compile times per function (in each run's JSON)")
    ap.add_argument("--cold-only", action="store_true", help="skip the warm restart")
    ap.add_argument("--artifact", action="store_true", help="the cold start saves a compiled artifact, and a third "
                    "start on an empty compile cache loads it (a fresh machine with `q3tts serve --load-artifact`)")
    ap.add_argument("--cold-threads", type=int, default=None, help="torch's CPU threads in the cold start only (the "
                    "artifact's builder with another CPU count than the server: on CUDA the warm and artifact starts "
                    "still trace nothing; on a CPU Inductor's kernels are built for the count, so they trace again)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile-cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compile-artifact", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save-artifact", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    res = {"bench": "startup", "command": " ".join([os.path.basename(sys.executable), "-m", "bench.startup",
                                                     *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "runs": []}
    print(f"{'quantization':<12} {'run':>3} {'cache':<8} {'ready s':>8} {'import':>7} {'load':>6} {'engine':>7} "
          f"{'warm-up':>8} {'fx hit/miss':>12} {'traced':>6} {'dynamo s':>8} {'threads':>7}", file=sys.stderr)
    for q in a.quantization.split(","):
        for i in range(a.runs):
            cache = tempfile.mkdtemp(prefix="q3tts-startup-cache-")
            fresh = tempfile.mkdtemp(prefix="q3tts-startup-cache-")  # the artifact start's empty compile cache
            art = os.path.join(tempfile.gettempdir(), f"q3tts-startup-{os.getpid()}-{i}.q3c")
            kinds = ("cold",) if a.cold_only else ("cold", "warm")
            try:
                for kind in kinds + (("artifact",) if a.artifact else ()):
                    how = {"cold": ("save", art) if a.artifact else None, "artifact": ("load", art)}.get(kind)
                    r = dict(start(a, q, fresh if kind == "artifact" else cache, how,
                                   a.cold_threads if kind == "cold" else None), quantization=q, run=i, cache=kind)
                    res["runs"].append(r)
                    save(res, a.out)
                    res["device"] = r["device"]
                    c = r["counts"]
                    print(f"{q:<12} {i:>3} {kind:<8} {r['ready_s']:>8.1f} {r['import_s']:>7.1f} {r['load_s']:>6.1f} "
                          f"{r['engine_s']:>7.1f} {r['warmup_s']:>8.1f} {c['fx_hit']:>6}/{c['fx_miss']:<5} "
                          f"{c['traced']:>6} {r['dynamo_s']:>8.1f} {r['threads']:>7}",
                          file=sys.stderr, flush=True)
            finally:
                for d in (cache, fresh):
                    shutil.rmtree(d, ignore_errors=True)
                if os.path.exists(art):
                    os.remove(art)
    print(save(res, a.out))


def save(res: dict, path: str | None) -> str:
    """Written after every run, so a call cut short keeps what it measured."""
    import torch
    res["torch"] = torch.__version__
    out = json.dumps(res, indent=1)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(out)
    return out


if __name__ == "__main__":
    main()
