"""Exploration (GPU): skinny GEMMs (M = batch rows, weights [N, K] bf16) inside a CUDA graph, cuBLAS vs
Inductor reduction vs the Triton kernels of q3tts.kernels over launch configs. Per-call microseconds of
20 chained calls in one graph (--cold: weights rotated over more copies than L2 holds).

    python -m bench.probe_gemv [--cold | --topk]
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from bench.ours import graph_of, replay_ms
from q3tts.kernels.gemm import _gemv_row, _gemv_rows  # the shipped kernels; the sweep varies their launch configs


def triton_dot(bn, bk, warps, stages):
    def f(x, w, y):
        M, K = x.shape
        N = w.shape[0]
        _gemv_rows[(N // bn,)](x, w, y, M, N, K, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        return y
    return f


def triton_sum(bn, bk, warps, stages):
    def f(x, w, y):
        N, K = w.shape
        _gemv_row[(N // bn,)](x, w, w, y, N, K, BLOCK_N=bn, BLOCK_K=bk, SCALED=False, num_warps=warps,
                              num_stages=stages)
        return y
    return f


def time_graph(fn, reps=20, iters=30):
    """Microseconds per call of fn, from a graph of reps chained calls."""
    return round(replay_ms(graph_of(lambda: [fn() for _ in range(reps)]), iters) * 1000 / reps, 2)


def topk_vs_sort():
    res = {}
    for B, V in ((1, 2048), (1, 3072), (16, 2048), (64, 2048)):
        x = torch.randn(B, V, device="cuda")
        res[f"b{B}_v{V}"] = {"topk64": time_graph(lambda: x.topk(64, dim=-1)),
                             "sort_stable": time_graph(lambda: x.sort(dim=-1, descending=True, stable=True)),
                             "sort": time_graph(lambda: x.sort(dim=-1, descending=True))}
    print(json.dumps(res), flush=True)
    return res


def cold_sweep():
    """M = 1, weights rotated over copies larger than L2 (as in a real frame: every layer's weight is new)."""
    from q3tts.sampling import top_values
    shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
              "lm_head": (2048, 1024)}
    res = {}
    for name, (N, K) in shapes.items():
        copies = max(4, int(200e6 // (N * K * 2)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        row = {"cublas": time_graph(lambda: [F.linear(x, w) for w in ws], reps=1) / copies}
        best = []
        for bn in (2, 4, 8):
            for bk in (256, 512, 1024):
                for wp in (4, 8):
                    for st in (2, 3, 4):
                        f = triton_sum(bn, bk, wp, st)
                        try:
                            us = time_graph(lambda: [f(x, w, y) for w in ws], reps=1) / copies
                        except Exception:
                            continue
                        best.append((round(us, 2), f"bn{bn} bk{bk} w{wp} s{st}"))
        best.sort()
        row["triton_top5"] = best[:5]
        row["shipped_bn2_bk1024_w4_s3"] = [b for b in best if b[1] == "bn2 bk1024 w4 s3"]
        res[name] = row
        print(name, row, flush=True)
    fn = torch.compile(lambda x: top_values(x, 64), dynamic=False)
    for B in (1, 4, 8):
        x = torch.randn(B, 2048, device="cuda")
        res[f"topvalues_b{B}"] = {"rank_compiled": time_graph(lambda: fn(x)), "topk": time_graph(lambda: x.topk(64, dim=-1))}
    print(json.dumps(res), flush=True)


def main():
    import sys
    if "--topk" in sys.argv:
        return topk_vs_sort()
    if "--cold" in sys.argv:
        return cold_sweep()
    shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
              "lm_head": (2048, 1024), "codec_head": (3072, 1024)}
    red = torch.compile(lambda x, w: (x[:, None, :].float() * w[None].float()).sum(-1).to(x.dtype))
    res = {}
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        for M in (1, 4, 16, 64):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w).float()
            row = {"bytes_MB": round(N * K * 2 / 1e6, 1), "cublas": time_graph(lambda: F.linear(x, w))}
            row["cublas_TBps"] = round(N * K * 2 / row["cublas"] / 1e6, 2)
            if M <= 4:
                try:
                    red(x, w)
                    row["inductor_red"] = time_graph(lambda: red(x, w))
                except Exception as e:
                    row["inductor_red"] = repr(e)[:200]
            best = None
            cands = [("dot", bn, bk, wp, st) for bn in (16, 32, 64) for bk in (128, 256) for wp in (4,) for st in (3, 4)]
            if M == 1:
                cands += [("sum", bn, bk, wp, st) for bn in (4, 8, 16, 32) for bk in (256, 512) for wp in (4, 8) for st in (2, 3)]
            for kind, bn, bk, wp, st in cands:
                if M > 16 and kind == "dot":
                    continue
                if N % bn or K % bk:
                    continue
                f = (triton_dot if kind == "dot" else triton_sum)(bn, bk, wp, st)
                try:
                    f(x, w, y)
                    err = (y.float() - ref).abs().max().item()
                    us = time_graph(lambda: f(x, w, y))
                except Exception as e:
                    print("fail", kind, bn, bk, wp, st, repr(e)[:200], flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, f"{kind} bn{bn} bk{bk} w{wp} s{st}", err)
            if best:
                row["triton_best"] = {"us": best[0], "cfg": best[1], "max_err": best[2],
                                      "TBps": round(N * K * 2 / best[0] / 1e6, 2)}
            res[f"{name}_M{M}"] = row
            print(name, M, row, flush=True)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
