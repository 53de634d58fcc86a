"""A random bf16 decoder layer of the real head shape and its float64 twin, shared by the tests of the fused
layer kernels (gemm's one-row GEMVs, attention's decode attention); the accuracy bar they are held to."""

import pytest
import torch


def bf16_layer(hidden: int, seed: int):
    """A bf16 decoder layer of the real models' head shape (16 x 128, 8 KV heads, MLP 3 x hidden) with random weights
    (norm weights away from 1), its projections fused, and its float64 twin (the same bf16 values, unfused)."""
    import copy

    from q3tts.config import DecoderLayerConfig
    from q3tts.models import layers
    torch.manual_seed(seed)
    lay = layers.DecoderLayer(DecoderLayerConfig(hidden, 3 * hidden, 1, 16, 8, 128, 1e-6, 1e6, 2048))
    with torch.no_grad():
        for p in lay.parameters():
            p.normal_(0, 0.05)
        for m in (lay.input_layernorm, lay.post_attention_layernorm, lay.self_attn.q_norm, lay.self_attn.k_norm):
            m.weight.normal_(1, 0.3)
    lay = lay.to("cuda", torch.bfloat16)
    exact = copy.deepcopy(lay).double()
    layers.fuse_projections(lay)
    return lay, exact


def random_layer(hidden: int, n: int, B: int):
    """bf16_layer, one token per row at positions < n (row 0 at n - 1) and caches of 300 positions holding random
    older keys and values."""
    from q3tts.models import layers
    Hkv, Dh = 8, 128
    lay, exact = bf16_layer(hidden, hidden + 100 * n + B)
    x = torch.randn(B, 1, hidden, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, B, Hkv, 300, Dh, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, n, (B, 1), device="cuda")
    pos[0] = n - 1
    mask = torch.arange(n, device="cuda")[None, None, None, :] <= pos[:, None, :, None]
    inv_freq = layers.rope_inv_freq(Dh, 1e6).to("cuda")

    def run(module, dtype, fused: bool, part=lambda m: m, write: bool = False):
        """(output, caches) of part(module) run in dtype; fused False: with the module's own ops; write: the fused
        attention writes the caches itself."""
        cache = kv.to(dtype, copy=True)
        cos, sin = layers.rope_cos_sin(pos, inv_freq, dtype)
        with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
            if not fused:
                mp.setattr(layers, "decode_attention_applies", lambda *a: False)
                mp.setattr(layers, "gemv_ex_applies", lambda *a: False)
            ctx = layers.AttnContext(pos, mask, fused_attention=fused, write_kv_in_attention=write)
            out = part(module)(x.to(dtype), cos, sin, cache[0], cache[1], ctx)
        return out.double(), cache.double()

    return lay, exact, x, kv, run


def no_less_accurate(fused, eager, exact, what: str):
    """The fused kernels' error against the float64 result is that of the module's own bf16 ops: both round each
    op's result to bf16 and sum in fp32, in other orders, so neither is the reference; the fused one may not be
    worse on average (1.25x: run-to-run spread of which elements a rounding flips) nor at its worst (2x)."""
    ef, ee = (fused - exact).abs(), (eager - exact).abs()
    print(f"{what}: mean error fused {ef.mean():.3g} / eager {ee.mean():.3g}, max {ef.max():.3g} / {ee.max():.3g}")
    assert ef.mean() <= 1.25 * ee.mean() and ef.max() <= 2 * ee.max()
