"""The vocoder's causal convolutions one by one: cuDNN (the channels-last views Code2Wav used before
kernels.causal_conv) against the engine's Triton kernel over a grid of tiles, each captured in a CUDA graph and timed
as bench.ours times graphs; per layer and call shape (rows x frames), with the tiles `kernels.vocoder.dense_tiles`
chooses marked. The source of that table (BENCHMARKS.md, nineteenth session).

    python -m bench.probe_conv --out conv.json [--layers b4d1,b4d9]

Layers: pre (pre_conv), dec0 (the decoder's first conv), b<i>d<d> (block i's residual conv at dilation d), final.
Random weights and inputs (timing only); bf16, CUDA with Triton.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch

from bench.ours import graph_of, replay_ms
from q3tts.config import Code2WavConfig

CALLS = ((1, 1), (4, 16), (64, 1))  # rows x frames: a first chunk, four streams' 16-frame chunks, 64 streams' frames
TILES = list(itertools.product((64, 128, 256), (16, 32, 64, 128, 256), (32, 64, 128),
                               ((4, 3), (8, 3), (4, 4), (8, 4))))  # BLOCK_M, BLOCK_N, BLOCK_K, (warps, stages)


def layers(cfg: Code2WavConfig) -> list[tuple[str, int, int, int, int, int]]:
    """(name, C_in, C_out, taps, dilation, input samples per frame) of each dense causal conv of Code2Wav."""
    up = math.prod(cfg.upsampling_ratios)
    out = [("pre", cfg.codebook_dim, cfg.latent_dim, 3, 1, 1), ("dec0", cfg.latent_dim, cfg.decoder_dim, 7, 1, up)]
    for i, rate in enumerate(cfg.upsample_rates):
        up *= rate
        c = cfg.decoder_dim // 2 ** (i + 1)
        out += [(f"b{i + 1}d{d}", c, c, 7, d, up) for d in (1, 3, 9)]
    return out + [("final", cfg.decoder_dim // 2 ** len(cfg.upsample_rates), 1, 7, 1, up)]


def cudnn_conv(x, w, b, d):
    """Code2Wav's convolution through cuDNN (CausalConv._valid: the [B, C, 1, L] view, or undilated over the d
    phases); x padded to whole phases."""
    from q3tts.models.codec import CausalConv
    C_out, C_in, k = w.shape
    conv = CausalConv(C_in, C_out, k, d).to(x.device, x.dtype)
    conv.conv.weight.data, conv.conv.bias.data = w, b
    return lambda: conv._valid(x)


def triton_conv(x, w, b, d, tiles):
    """kernels.causal_conv with these tiles (its own: kernels.vocoder.dense_tiles)."""
    from q3tts.kernels import causal_conv
    return lambda: causal_conv(x, w, b, d, 1, tiles=tiles)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write the table (us per layer, call and tiles) here as JSON")
    ap.add_argument("--layers", help="comma-separated layer names (default: all)")
    a = ap.parse_args()
    import triton

    from q3tts.kernels.vocoder import dense_tiles
    dev, dt = "cuda", torch.bfloat16
    only = a.layers.split(",") if a.layers else None
    res, t0 = {}, time.time()
    for name, ci, co, k, d, spf in layers(Code2WavConfig()):
        if only and name not in only:
            continue
        w = (torch.randn(co, ci, k, device=dev) / 30).to(dt).permute(0, 2, 1).contiguous().permute(0, 2, 1)
        b = torch.randn(co, device=dev).to(dt)
        chosen = "x".join(map(str, dense_tiles(ci, co)))
        for R, t in CALLS:
            ctx, N = (k - 1) * d, t * spf
            x = torch.randn(R, ctx + N + (-(ctx + N) % d), ci, device=dev).to(dt)  # padded to whole phases for cuDNN
            row = {"cudnn": None}
            for label, fn in [("cudnn", cudnn_conv(x, w, b, d))] + [
                    ("x".join(map(str, (bm, bn, bk, nw, ns))), (bm, bn, bk, nw, ns)) for bm, bn, bk, (nw, ns) in TILES
                    if bk <= triton.next_power_of_2(ci) and bn <= max(16, triton.next_power_of_2(co))
                    and (co == 1 or bn > 16)]:
                try:
                    f = fn if label == "cudnn" else triton_conv(x[:, :ctx + N].contiguous(), w, b, d, fn)
                    f()
                    row[label] = round(replay_ms(graph_of(f), 20) * 1000, 1)
                except Exception as e:  # a tile past the shared memory
                    row[label] = None
                    row.setdefault("error", f"{label}: {type(e).__name__}: {str(e)[:200]}")
            timed = {c: us for c, us in row.items() if c not in ("cudnn", "error") and us is not None}
            best = min(timed, key=timed.get)
            res[f"{name}_r{R}_t{t}"] = row
            print(f"{name} {R} x {t}: cuDNN {row['cudnn']} us; dense_tiles {chosen}: {row.get(chosen)} us; "
                  f"best {best}: {timed[best]} us  [{time.time() - t0:.0f} s]", flush=True)
            if a.out:  # after each row: a sweep cut off by a time limit keeps what it timed
                with open(a.out, "w") as fh:
                    json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
