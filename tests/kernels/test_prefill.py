"""q3tts.kernels.prefill: the aligner's fused prefill glue against the eager modules it replaces, in bf16, both held
to a float64 twin of the same values.

Each kernel rounds to bf16 where the modules do, in fp32 between, but its fp32 steps are not the module's bit for bit
(the sum of squares is reduced in another order; Triton's division and reciprocal square root differ from torch's in
the last bits), and a rounded value that sits near a bf16 tie then moves one step; RoPE's x cos + rotate_half(x) sin
can cancel, so one step of a term can be several of a small result (on an H100 a sizeable share of the Q/K elements
moved a step: BENCHMARKS.md). The bar is therefore the eager module's own error against float64: the glue's may not be
larger than it by more than a quarter (max) or a tenth (mean)."""

import pytest
import torch
import torch.nn.functional as F

from q3tts import kernels
from q3tts.kernels.prefill import conv1_gelu, qk_norm_rope, silu_mul

from .layer import bf16_layer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")]


def assert_as_accurate(glue: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor):
    assert glue.shape == eager.shape == exact.shape and glue.dtype == eager.dtype
    e_glue, e_eager = (glue.double() - exact).abs(), (eager.double() - exact).abs()
    assert e_glue.max() <= 1.25 * e_eager.max(), (e_glue.max().item(), e_eager.max().item())
    assert e_glue.mean() <= 1.1 * e_eager.mean(), (e_glue.mean().item(), e_eager.mean().item())


def random_layer(seed: int):
    """layer.bf16_layer at the aligner LM's width (1024), the twin's projections fused too."""
    from q3tts.models import layers
    lay, exact = bf16_layer(1024, seed)
    layers.fuse_projections(exact)
    return lay, exact


def rope(S: int, dtype: torch.dtype):
    from q3tts.models import layers
    cos, sin = layers.rope_cos_sin(torch.arange(S, device="cuda")[None], layers.rope_inv_freq(128, 1e6).cuda(), dtype)
    return cos[0], sin[0]


def test_qk_norm_rope_is_the_eager_norms_and_rope():
    from q3tts.models import layers
    lay, exact = random_layer(0)
    B, S, H, Hkv, Dh = 3, 40, 16, 8, 128
    qkv = (torch.randn(B, S, (H + 2 * Hkv) * Dh, device="cuda") * 2).to(torch.bfloat16)

    def modules(a, x, cos, sin):
        q, k, _ = x.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        return (layers.apply_rope(a.q_norm(q.reshape(B, S, H, Dh)), cos, sin).transpose(1, 2).contiguous(),
                layers.apply_rope(a.k_norm(k.reshape(B, S, Hkv, Dh)), cos, sin).transpose(1, 2).contiguous())

    with torch.inference_mode():
        q, k = qk_norm_rope(qkv, lay.self_attn.q_norm, lay.self_attn.k_norm, *rope(S, torch.bfloat16), H, Hkv)
        qe, ke = modules(lay.self_attn, qkv, *rope(S, torch.bfloat16))
        q64, k64 = modules(exact.self_attn, qkv.double(), *(t.double() for t in rope(S, torch.bfloat16)))
    assert q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous()  # token-major
    assert_as_accurate(q, qe, q64)
    assert_as_accurate(k, ke, k64)


def test_silu_mul_is_silu_times_up():
    torch.manual_seed(1)
    gu = (torch.randn(5, 7, 2 * 3072, device="cuda") * 3).to(torch.bfloat16)
    gate, up = gu.chunk(2, dim=-1)
    g64, u64 = gu.double().chunk(2, dim=-1)
    assert_as_accurate(silu_mul(gu), F.silu(gate) * up, F.silu(g64) * u64)


@pytest.mark.parametrize("N, W", [(7, 100), (5, 37)])
def test_conv1_gelu_is_the_conv_and_gelu(N, W):
    """kernels.conv1_gelu (the aligner encoder's first conv, 1 -> 480 channels, 3x3, stride 2, padding 1, and its exact
    GELU in one kernel) against the path it replaces (audio_encoder.conv1_gemm_gelu: a GEMM over the 3x3 patches, the
    bias in its epilogue, then F.gelu) and a float64 twin of the same bf16 values. Both paths round twice: the fp32
    sum of the 9 products (each exact: bf16 x bf16 fits fp32) plus the bias to bf16, then the GELU computed in fp32 to
    bf16. The sums differ only in their order (cuBLAS's tensor-core GEMM against the kernel's Triton dot), that is in
    the last fp32 bits, so a conv output moves one bf16 step only where it sits within those bits of a rounding tie, and its
    GELU (slope under 1.13) then a step or two: rare, and of the size of the roundings both paths make. Hence the
    module's bar (no larger error against float64 than the GEMM path's, by more than a quarter (max) / a tenth
    (mean)) and at most one element in a thousand apart from the GEMM path. Width 100 (a chunk) and 37 (odd: the
    edge taps' masks); N * 64 * t1 pixels not a multiple of the kernel's pixel block."""
    from q3tts.models.audio_encoder import conv1_gemm_gelu
    torch.manual_seed(6)
    conv = torch.nn.Conv2d(1, 480, 3, 2, 1).to("cuda", torch.bfloat16)
    x = torch.randn(N, 128, W, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        got = conv1_gelu(x, conv.weight, conv.bias)
        gemm = conv1_gemm_gelu(conv, x)
        exact = F.gelu(F.conv2d(x[:, None].double(), conv.weight.double(), conv.bias.double(), stride=2, padding=1))
    assert got.shape == gemm.shape == (N, 480, 64, (W - 1) // 2 + 1) and got.stride() == gemm.stride()
    assert got.is_contiguous(memory_format=torch.channels_last)  # as cuDNN's next conv reads it
    assert_as_accurate(got, gemm, exact)
    assert (got != gemm).double().mean() <= 1e-3


def test_padded_lm_layer_with_the_glue_is_the_eager_layer(monkeypatch):
    """models.aligner.lm_layer_padded on CUDA bf16 (the glue) and the same layer with the modules (glue off): the
    GEMMs and attention are the same calls; both against the float64 layer."""
    from q3tts.models import aligner
    lay, exact = random_layer(2)
    x = torch.randn(4, 48, 1024, device="cuda").to(torch.bfloat16)
    cos, sin = rope(48, torch.bfloat16)

    def layer(lay, x, cos, sin):  # the layer's output (its input_layernorm stands in for the next norm)
        return aligner.lm_layer_padded(lay, x, aligner._norm(lay.input_layernorm, x), cos, sin, lay.input_layernorm)[0]
    with torch.inference_mode():
        glue = layer(lay, x, cos, sin)
        want = layer(exact, x.double(), cos.double(), sin.double())
        monkeypatch.setattr(aligner, "prefill_glue_applies", lambda t: False)
        eager = layer(lay, x, cos, sin)
    e_glue, e_eager = (glue.double() - want).abs(), (eager.double() - want).abs()
    assert e_glue.max() <= 1.25 * e_eager.max() and e_glue.mean() <= 1.1 * e_eager.mean()


def residual_rows(D: int, seed: int):
    """x and delta [12, 3, D] in bf16, each row at its own magnitude from 1e-5 to 1e5 (delta's in the reverse order:
    rows where the add cancels into the smaller term, others where it rounds it away), norm weight and bias [D]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = 10.0 ** torch.linspace(-5, 5, 12, device="cuda")[:, None, None]
    x = (torch.randn(12, 3, D, device="cuda", generator=g) * scale).to(torch.bfloat16)
    delta = (torch.randn(12, 3, D, device="cuda", generator=g) * scale.flip(0)).to(torch.bfloat16)
    delta[0, 0] = -x[0, 0]  # a row that adds to zeros
    w = (1 + 0.3 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    b = (0.2 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
    return x, delta, w, b


@pytest.mark.parametrize("D", [1024, 1000])
def test_add_rms_norm_is_the_add_then_rms_norm_bit_for_bit(D):
    """kernels.add_rms_norm: the sum the eager bf16 add stores, and invariant.rms_norm of it (the unfused path of the
    aligner's LM), bit for bit."""
    from q3tts import invariant
    from q3tts.kernels.prefill import add_rms_norm
    x, delta, w, _ = residual_rows(D, 3)
    with torch.inference_mode():
        s, y = add_rms_norm(x, delta, w, 1e-6)
        want_s = x + delta
        want_y = invariant.rms_norm(want_s, w, 1e-6)
    assert torch.equal(s, want_s)
    assert torch.equal(y, want_y)
    assert y.isfinite().all() and y[1:].abs().amax(-1).min() > 0  # row 0, 0: zeros


@pytest.mark.parametrize("D", [1024, 1000])
def test_add_layer_norm_is_the_add_then_layer_norm(D):
    """kernels.add_layer_norm: the sum the eager bf16 add stores, and the norm of it bit for bit what the kernel
    without the add gives (the unfused path of the audio encoder); that norm as accurate as F.layer_norm of the same
    bf16 rows against float64 (fp32 statistics summed in another order than torch's: a value can move a bf16 step)."""
    from q3tts.kernels.prefill import add_layer_norm
    x, delta, w, b = residual_rows(D, 4)
    with torch.inference_mode():
        s, y = add_layer_norm(x, delta, w, b, 1e-5)
        want_s = x + delta
        s_alone, want_y = add_layer_norm(want_s, None, w, b, 1e-5)
        eager = F.layer_norm(want_s, (D,), w, b, 1e-5)
        exact = F.layer_norm(want_s.double(), (D,), w.double(), b.double(), 1e-5)
    assert torch.equal(s, want_s) and s_alone is want_s
    assert torch.equal(y, want_y)
    assert_as_accurate(y, eager, exact)


def test_padded_encoder_layer_with_the_glue_is_the_eager_layer(monkeypatch):
    """models.audio_encoder.encoder_layer_padded on CUDA bf16 (its LayerNorms in kernels.add_layer_norm, each fused
    with the residual add before it) and the same layer with the modules (glue off): both against the float64
    layer, at the aligner encoder's width."""
    import copy

    from q3tts.models import audio_encoder as ae
    torch.manual_seed(5)
    lay = ae.AudioEncoderLayer(ae.AudioEncoderConfig(d_model=1024, encoder_attention_heads=16, encoder_ffn_dim=4096))
    with torch.no_grad():
        for p in lay.parameters():
            p.normal_(0, 0.05)
        for m in (lay.self_attn_layer_norm, lay.final_layer_norm):
            m.weight.normal_(1, 0.3)
    lay = lay.to("cuda", torch.bfloat16)
    exact = copy.deepcopy(lay).double()
    x = torch.randn(4, 65, 1024, device="cuda").to(torch.bfloat16)
    mask = torch.ones(4, 65, dtype=torch.bool, device="cuda")
    mask[3, 40:] = False

    def layer(lay, x):  # the layer's output and the next norm of it (its own first norm standing in)
        a = lay.self_attn
        w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        h = ae._layer_norm(lay.self_attn_layer_norm, x)
        return ae.encoder_layer_padded(lay, w, b, x, h, mask, lay.self_attn_layer_norm)
    with torch.inference_mode():
        glue = layer(lay, x)
        want = layer(exact, x.double())
        monkeypatch.setattr(ae, "prefill_glue_applies", lambda t: False)
        eager = layer(lay, x)
    for g, w, e in zip(glue, want, eager):
        e_glue, e_eager = (g.double() - w).abs(), (e.double() - w).abs()
        assert e_glue.max() <= 1.25 * e_eager.max() and e_glue.mean() <= 1.1 * e_eager.mean()
