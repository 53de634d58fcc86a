"""Exploration: the streaming vocoder's per-call floor is its number of kernels (BENCHMARKS.md, thirty-ninth session).
Per variant this times the captured calls (rows x frames), counts the kernels of one replay and compares its audio with
the first variant's.

    python -m bench.probe_vocoder_fuse --ckpt /tmp/ck06 [--variants base,compiled,pre]
    python -m bench.probe_vocoder_fuse --ckpt /tmp/ck06 --precision     (CPU: bf16 eager and compiled against fp32)

Variants:
  base      the package's StreamingVocoder eager (its codebook tables made once: EuclideanCodebook.table)
  compiled  as the engine runs it: StreamingVocoder(compiled=True), each pre-transformer layer compiled (compile_codec)
  pre       the alternative not taken: the whole pre-transformer forward compiled as one graph, patched onto the module
            (its capture failed on torch 2.11, BENCHMARKS.md)
The fortieth session's call 1 also ran the start commit with the tables and the per-layer compile as patches
(`tables`, `layer`): the probe as of 9908175 has them; they are the package's own now.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np
import torch
from torch.autograd import DeviceType

from bench.ours import replay_ms

SHAPES = ((1, 1), (1, 16), (4, 16), (8, 8), (16, 4), (64, 1))


def pre(code2wav) -> None:
    from q3tts.engine.compile import _settings
    from q3tts.models.codec import Transformer
    _settings()
    fwd = torch.compile(Transformer.forward, dynamic=True, fullgraph=True)
    code2wav.pre_transformer._inv_freq = None
    code2wav.pre_transformer.forward = functools.partial(fwd, code2wav.pre_transformer)


def stream_audio(voc, streams: list[torch.Tensor]) -> list[np.ndarray]:
    """Each stream's [19, K] codes through its own fresh row in chunks of 1, 2 and 16 frames -> its audio."""
    rows = voc.open([None] * len(streams))
    chunks = [voc.decode([(r, s[lo:hi]) for r, s in zip(rows, streams)]) for lo, hi in ((0, 1), (1, 3), (3, 19))]
    return [np.concatenate(parts) for parts in zip(*chunks)]


def random_streams(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 2048, (19, 16), generator=gen) for _ in range(n)]


def kernels_per_replay(g, n=3) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            g.replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA) // n


def precision(ckpt: str) -> dict:
    """On the CPU: the package's vocoder audio (2 streams x chunks 1, 2, 16) in bf16, eager and compiled, and in fp32
    compiled, each against fp32 eager from the same weights: how far the compiled layer's rounding is from bf16's own."""
    from q3tts.engine.vocoder import StreamingVocoder
    from q3tts.models.loaders import load_checkpoint
    streams = random_streams(2)

    def audio(dtype, compiled):
        code2wav = load_checkpoint(ckpt, device="cpu", dtype=dtype).code2wav.to(dtype)
        return np.concatenate(stream_audio(StreamingVocoder(code2wav, 2, compiled=compiled), streams))

    ref = audio(torch.float32, False)
    res = {"rms_fp32": float(np.sqrt(np.mean(ref ** 2)))}
    for name, dtype, compiled in (("bf16_eager", torch.bfloat16, False), ("bf16_compiled", torch.bfloat16, True),
                                  ("fp32_compiled", torch.float32, True)):
        d = audio(dtype, compiled) - ref
        res[name] = {"max_abs": float(np.abs(d).max()), "rms": float(np.sqrt(np.mean(d ** 2)))}
        print(name, res[name], flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--variants", default="base,compiled,pre")
    ap.add_argument("--precision", action="store_true", help="only the CPU's precision check (precision())")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.precision:
        print(json.dumps(precision(a.ckpt)))
        return
    from q3tts.engine.vocoder import StreamingVocoder
    from q3tts.models.loaders import load_checkpoint
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}}
    ref = None
    streams = random_streams(3)
    for variant in a.variants.split(","):
        if variant not in ("base", "compiled", "pre"):
            raise SystemExit(f"unknown variant {variant!r}: base, compiled or pre")
        ck = load_checkpoint(a.ckpt, device="cuda", dtype=torch.bfloat16)
        if variant == "pre":
            pre(ck.code2wav)
        voc = StreamingVocoder(ck.code2wav, a.rows, use_graphs=True, compiled=variant == "compiled")
        t0 = time.perf_counter()
        try:
            voc.capture_graphs()
        except Exception as e:  # noqa: BLE001 (exploration: report and go on)
            res["variants"][variant] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            print(variant, res["variants"][variant], flush=True)
            continue
        row = {"capture_s": round(time.perf_counter() - t0, 1)}
        for R, t in SHAPES:
            if (R, t) in voc.graphs:
                g = voc.graphs[(R, t)][0]
                row[f"{R}x{t}"] = {"ms": round(replay_ms(g, 30), 3), "kernels": kernels_per_replay(g)}
        wav = [torch.from_numpy(w) for w in stream_audio(voc, streams)]
        if ref is None:
            ref = wav
        else:
            row["max_abs_diff_vs_base"] = max(float((x - y).abs().max()) for x, y in zip(wav, ref))
            row["rms_base"] = float(torch.cat(ref).pow(2).mean().sqrt())
        res["variants"][variant] = row
        print(variant, json.dumps(row), flush=True)
        del voc, ck
        torch.cuda.empty_cache()
    print("| variant | capture s | " + " | ".join(f"{R}x{t} ms (kernels)" for R, t in SHAPES) + " | max diff |")
    for v, row in res["variants"].items():
        cells = [f"{row[k]['ms']} ({row[k]['kernels']})" if k in row else "-" for k in (f"{R}x{t}" for R, t in SHAPES)]
        print(f"| {v} | {row.get('capture_s', 'err')} | " + " | ".join(cells) + f" | {row.get('max_abs_diff_vs_base', '')} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
