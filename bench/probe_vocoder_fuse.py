"""Exploration: the streaming vocoder's per-call floor is its number of kernels (BENCHMARKS.md, thirty-ninth session).
Each variant below cuts launches from the decoder's pre-transformer or its quantizer; per variant this times the
captured calls (rows x frames), counts the kernels of one replay and compares its audio with the base's.

    python -m bench.probe_vocoder_fuse --ckpt /tmp/ck06 [--variants base,tables,layer,pre,pre+tables]
    python -m bench.probe_vocoder_fuse --ckpt /tmp/ck06 --precision     (CPU: bf16 eager and compiled against fp32)

Variants (combined with '+'):
  base     the package as it is
  tables   each codebook's table (embedding_sum / cluster_usage) made once, not per call
  layer    torch.compile on each pre-transformer layer's forward (dynamic shapes, as the talker's layers)
  pre      torch.compile on the whole pre-transformer forward (its 8 layers in one graph; its capture failed on
           torch 2.11, BENCHMARKS.md)
  compiled the package's StreamingVocoder(compiled=True) (Code2Wav.transformer_step compiled whole, the engine's)
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType

from bench.ours import replay_ms

SHAPES = ((1, 1), (1, 16), (4, 16), (8, 8), (16, 4), (64, 1))


def tables(code2wav) -> None:
    from q3tts.models.codec import ResidualVectorQuantizer
    for rvq in (code2wav.quantizer.rvq_first, code2wav.quantizer.rvq_rest):
        tab = [(cb := layer._codebook).embedding_sum / cb.cluster_usage.clamp(min=1e-5)[:, None]
               for layer in rvq.vq.layers]

        def decode(codes, _tab=tab, _rvq=rvq):
            q = F.embedding(codes[:, 0], _tab[0])
            for i in range(1, codes.shape[1]):
                q = q + F.embedding(codes[:, i], _tab[i])
            return F.linear(q, _rvq.output_proj.weight[:, :, 0])
        assert isinstance(rvq, ResidualVectorQuantizer)
        rvq.decode = decode


def settings() -> None:
    import torch._dynamo
    import torch._inductor.config
    import torch.fx.experimental._config as fx_config
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    fx_config.use_duck_shape = False
    torch._dynamo.config.specialize_float = True
    torch._inductor.config.shape_padding = False


def layer(code2wav) -> None:
    from q3tts.models.codec import TransformerLayer
    settings()
    fwd = torch.compile(TransformerLayer.forward, dynamic=True, fullgraph=True)
    for m in code2wav.pre_transformer.layers:
        m.forward = functools.partial(fwd, m)


def pre(code2wav) -> None:
    from q3tts.models.codec import Transformer
    settings()
    fwd = torch.compile(Transformer.forward, dynamic=True, fullgraph=True)
    code2wav.pre_transformer._inv_freq = None
    code2wav.pre_transformer.forward = functools.partial(fwd, code2wav.pre_transformer)


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
    gen = torch.Generator().manual_seed(0)
    streams = [torch.randint(0, 2048, (19, 16), generator=gen) for _ in range(2)]

    def audio(dtype, compiled):
        code2wav = load_checkpoint(ckpt, device="cpu", dtype=dtype).code2wav.to(dtype)
        voc = StreamingVocoder(code2wav, 2, compiled=compiled)
        rows = voc.open([None] * 2)
        chunks = [voc.decode([(r, s[lo:hi]) for r, s in zip(rows, streams)]) for lo, hi in ((0, 1), (1, 3), (3, 19))]
        return np.concatenate([np.concatenate(parts) for parts in zip(*chunks)])

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
    ap.add_argument("--variants", default="base,tables,layer,layer+tables,pre+tables")
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
    gen = torch.Generator().manual_seed(0)
    streams = [torch.randint(0, 2048, (19, 16), generator=gen) for _ in range(3)]
    for variant in a.variants.split(","):
        ck = load_checkpoint(a.ckpt, device="cuda", dtype=torch.bfloat16)
        for part in variant.split("+"):
            if part not in ("base", "compiled"):
                globals()[part](ck.code2wav)
        voc = StreamingVocoder(ck.code2wav, a.rows, use_graphs=True, compiled="compiled" in variant)
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
        rows = voc.open([None] * 3)
        wav = [voc.decode([(r, s[lo:hi]) for r, s in zip(rows, streams)]) for lo, hi in ((0, 1), (1, 3), (3, 19))]
        wav = [torch.from_numpy(np.concatenate(parts)) for parts in zip(*wav)]  # per stream
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
