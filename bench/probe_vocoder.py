"""The streaming vocoder's cost per call shape: its captured graphs (rows x frames), and where one call's GPU time
goes (kernel table of the 4 rows x 16 frames call, the steady state of four streams' 16-frame chunks). Replays are
timed as bench.ours times graphs (CUDA events over back-to-back replays).

    python -m bench.probe_vocoder --ckpt /tmp/ck06

The engine decodes each step's due chunks in such calls (q3tts.engine.vocoder); at 64 served streams they took as long
as the frame itself (BENCHMARKS.md, eighth session).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.ours import graph_of, replay_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--rows", type=int, default=64, help="the vocoder's rows (the engine's slots)")
    ap.add_argument("--compile-whole", action="store_true", help="exploration: also one decode step compiled whole "
                    "by torch.compile (static shapes) against the same step eager, both as CUDA graphs")
    ap.add_argument("--conv-options", action="store_true", help="also time one residual unit's causal conv three ways "
                    "at each block's channels (codec.CausalConv._valid says which it takes)")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from q3tts.engine.vocoder import StreamingVocoder
    from q3tts.models.loaders import load_checkpoint
    ck = load_checkpoint(a.ckpt, device="cuda", dtype=torch.bfloat16)
    voc = StreamingVocoder(ck.code2wav, a.rows, use_graphs=True)
    t0 = time.perf_counter()
    voc.capture_graphs()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "capture_s": round(time.perf_counter() - t0, 2)}
    for R, t in ((1, 1), (1, 16), (4, 16), (8, 8), (16, 4), (64, 1)):
        if (R, t) not in voc.graphs:
            continue
        ms = replay_ms(voc.graphs[(R, t)][0], 20)
        res[f"rows{R}_frames{t}"] = {"ms": round(ms, 3), "us_per_frame": round(ms * 1000 / (R * t), 1)}
    g = voc.graphs[(4, 16)][0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=18), flush=True)
    top = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
    res["profile_rows4_frames16"] = [{"kernel": e.key[:300], "us_per_call": round(e.device_time_total / 5, 1),
                                      "launches_per_call": e.count // 5} for e in top]
    if a.compile_whole:
        res["decode_step_graph_ms"] = compile_whole(ck.code2wav)
    if a.conv_options:
        res["conv_options_us"] = conv_options()
    print(json.dumps(res, indent=1))


def conv_options() -> dict:
    """A k=7 conv of C channels at dilation d over 4 rows x 16 frames of samples (bf16, captured, us): F.conv1d on
    [B, C, L]; conv2d on the channels-last [B, C, 1, L] view with dilation (1, d); conv2d undilated, kernel (7, 1), over
    the d phases viewed as [B, L/d, d, C]."""
    import torch.nn.functional as F
    out = {}
    for C, samples_per_frame in ((768, 32), (384, 160), (192, 640), (96, 1920)):
        B, N = 4, 16 * samples_per_frame
        for d in (1, 3, 9):
            L = 6 * d + N
            Lp = -(-L // d) * d
            w = torch.randn(C, C, 7, device="cuda", dtype=torch.bfloat16) / 30
            b = torch.randn(C, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(B, Lp, C, device="cuda", dtype=torch.bfloat16)  # time-major
            ncw = x.transpose(1, 2).contiguous()[..., :L]
            w_w, w_h = (w.unsqueeze(i).contiguous(memory_format=torch.channels_last) for i in (2, 3))
            ways = {"ncw_conv1d": lambda: F.conv1d(ncw, w, b, dilation=d),  # noqa: B023 (timed in this iteration)
                    "nhwc_dilated": lambda: F.conv2d(x[:, :L].transpose(1, 2)[:, :, None], w_w, b,  # noqa: B023
                                                     dilation=(1, d)),  # noqa: B023
                    "nhwc_phases": lambda: F.conv2d(x.view(B, Lp // d, d, C).permute(0, 3, 1, 2), w_h, b)}  # noqa: B023
            row = {}
            for name, fn in ways.items():
                fn()
                row[name] = round(replay_ms(graph_of(fn), 20) * 1000, 1)
            out[f"C{C}_N{N}_d{d}"] = row
            print(f"C {C}, N {N}, d {d}: {row}", flush=True)
    return out


def compile_whole(code2wav) -> dict:
    """One decode step (no pool gather/scatter), eager vs compiled whole, each captured, per (rows, frames)."""
    out = {}
    step = torch.compile(code2wav.decode_step, dynamic=False)
    for R, t in ((4, 16), (64, 1)):
        codes = torch.randint(0, 2048, (R, code2wav.cfg.num_quantizers, t), device="cuda")
        state = code2wav.init_state(R, "cuda", torch.bfloat16)
        for name, fn in (("eager", code2wav.decode_step), ("compiled", step)):
            t0 = time.perf_counter()
            try:
                for _ in range(3):
                    fn(codes, state)
            except Exception as e:  # torch 2.11: an Inductor codegen error (pytorch/pytorch#178676)
                out[f"rows{R}_frames{t}_{name}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"rows {R} x frames {t}, {name}: {out[f'rows{R}_frames{t}_{name}']}", flush=True)
                continue
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            g = graph_of(lambda: fn(codes, state))  # noqa: B023 (called here, in this iteration)
            out[f"rows{R}_frames{t}_{name}"] = {"ms": round(replay_ms(g, 20), 3), "first_calls_s": round(first_s, 1)}
            print(f"rows {R} x frames {t}, {name}: {out[f'rows{R}_frames{t}_{name}']}", flush=True)
    return out


if __name__ == "__main__":
    main()
