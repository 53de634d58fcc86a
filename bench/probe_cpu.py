"""Where a CPU frame's fixed costs come from (exploration): per-call time of the quantized GEMMs at the 0.6B's decode
shapes (one row) by thread count, weights hot (one matrix again and again: the code predictor's 5 layers run 15
times a frame) and cold (cycling through 48 matrices, as the talker's 28 layers do: beyond the L2 caches, though a
large L3 may hold them); the cost of an empty parallel region; the same GEMMs compiled by Inductor with frozen
weights and its C++ GEMM templates (max-autotune), against the aten kernels the engine calls. --vocoder CKPT: the
streaming vocoder's cost per frame in fp32 and bf16 instead.

    CUDA_VISIBLE_DEVICES= python -m bench.probe_cpu --threads 16,8,4 --out probe.json
    CUDA_VISIBLE_DEVICES= OMP_WAIT_POLICY=ACTIVE python -m bench.probe_cpu ...     # spinning OpenMP workers

Run it once per environment: OpenMP reads its settings when torch loads.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from q3tts.models.quant import QuantLinear

# (out, in) of the per-frame linears of the 0.6B talker and code predictor (q/k/v and gate/up fused)
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "cp_head": (2048, 1024)}
COLD_COPIES = 48  # int4 gate_up: 48 x 3 MiB, past the 16-core Xeon's 32 MiB of L2 (its L3 is 300 MiB)


def per_call_us(fn, xs, n: int) -> float:
    for x in xs[:4]:
        fn(x, 0)
    t = time.perf_counter()
    for i in range(n):
        fn(xs[i % len(xs)], i)
    return 1e6 * (time.perf_counter() - t) / n


def gemms(threads: list[int], n: int) -> list[dict]:
    rows = []
    for name, (N, K) in SHAPES.items():
        x = torch.randn(1, K, dtype=torch.bfloat16)
        for mode in ("int4", "int8"):
            mods = [QuantLinear(torch.randn(N, K) * 0.02, None, mode) for _ in range(COLD_COPIES)]
            for th in threads:
                torch.set_num_threads(th)
                hot = per_call_us(lambda x, i: mods[0](x), [x], n)
                cold = per_call_us(lambda x, i: mods[i % len(mods)](x), [x], n)
                rows.append(dict(shape=name, N=N, K=K, mode=mode, threads=th, hot_us=round(hot, 1),
                                 cold_us=round(cold, 1)))
                print(json.dumps(rows[-1]), flush=True)
        w = torch.randn(N, K, dtype=torch.bfloat16)
        for th in threads:
            torch.set_num_threads(th)
            rows.append(dict(shape=name, N=N, K=K, mode="bf16", threads=th,
                             hot_us=round(per_call_us(lambda x, i: torch.nn.functional.linear(x, w), [x], n), 1)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def parallel_region(threads: list[int], n: int) -> list[dict]:
    """An elementwise op big enough for aten to split it over threads (grain 32768): mostly fork/join."""
    a, b = torch.randn(65536), torch.randn(65536)
    out = []
    for th in threads + [1]:
        torch.set_num_threads(th)
        out.append(dict(threads=th, add_64k_us=round(per_call_us(lambda x, i: torch.add(a, b), [a], n), 1)))
        print(json.dumps(out[-1]), flush=True)
    return out


def inductor_templates(threads: int, n: int) -> list[dict]:
    """The same one-row GEMMs compiled with frozen weights and Inductor's C++ GEMM templates (max-autotune)."""
    import torch._inductor.config as ic
    torch.set_num_threads(threads)
    ic.freezing = True
    ic.max_autotune = True
    ic.max_autotune_gemm_backends = "CPP,ATEN"
    rows = []
    for name, (N, K) in SHAPES.items():
        x = torch.randn(1, K, dtype=torch.bfloat16)
        for mode in ("int4", "int8"):
            q = QuantLinear(torch.randn(N, K) * 0.02, None, mode).eval()
            with torch.no_grad():
                ref = q(x)
                t = time.perf_counter()
                try:
                    f = torch.compile(q, dynamic=False)
                    y = f(x)
                except Exception as e:  # noqa: BLE001 (exploration: record why)
                    rows.append(dict(shape=name, mode=mode, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                compile_s = time.perf_counter() - t
                us = per_call_us(lambda x, i: f(x), [x], n)
                aten = per_call_us(lambda x, i: q(x), [x], n)
            rows.append(dict(shape=name, mode=mode, threads=threads, compiled_us=round(us, 1), aten_us=round(aten, 1),
                             compile_s=round(compile_s, 1), max_abs_diff=float((y.float() - ref.float()).abs().max())))
            print(json.dumps(rows[-1]), flush=True)
            torch._dynamo.reset()
    return rows


def vocoder(ckpt: str, threads: int, frames: int = 40) -> list[dict]:
    """The exact streaming vocoder on the CPU, fp32 (the engine's CPU dtype) and bf16: ms per 80 ms frame decoding a
    whole utterance at once (pieces of 16) and on the streaming schedule (chunks 1, 2, 4, 8, 16, ...)."""
    from q3tts.engine.vocoder import StreamingVocoder
    from q3tts.models.loaders import load_checkpoint
    torch.set_num_threads(threads)
    code2wav = load_checkpoint(ckpt, "cpu", torch.float32).code2wav
    codes = torch.randint(0, 2048, (frames, code2wav.cfg.num_quantizers))
    chunks, k = [], 0
    while sum(chunks) < frames:
        chunks.append(min(16, 1 << k, frames - sum(chunks)))
        k += 1
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        voc = StreamingVocoder(code2wav.to(dtype), max_rows=1)
        for name, cuts in (("whole", [frames]), ("stream", chunks)):
            best = None
            for _ in range(3):
                row = voc.open([None])[0]
                t, start = time.perf_counter(), 0
                for c in cuts:
                    voc.decode([(row, codes[start:start + c])])
                    start += c
                dt = time.perf_counter() - t
                voc.close(row)
                best = dt if best is None else min(best, dt)
            rows.append(dict(dtype=str(dtype), schedule=name, threads=threads,
                             ms_per_frame=round(1000 * best / frames, 2)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="16,8,4")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--skip-inductor", action="store_true")
    ap.add_argument("--vocoder", default=None, help="a checkpoint: time its vocoder (fp32, bf16) instead")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    threads = [int(t) for t in a.threads.split(",")]
    if a.vocoder:
        res = {"torch": torch.__version__, "vocoder": vocoder(a.vocoder, threads[0])}
        if a.out:
            open(a.out, "w").write(json.dumps(res, indent=1))
        return
    res = {"torch": torch.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "parallel_region": parallel_region(threads, a.calls * 5), "gemms": gemms(threads, a.calls)}
    if not a.skip_inductor:
        res["inductor"] = inductor_templates(threads[0], a.calls)
    if a.out:
        open(a.out, "w").write(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
