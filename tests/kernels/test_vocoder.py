"""q3tts.kernels.vocoder: the SnakeBeta join against the torch ops in float64."""

import pytest
import torch

from q3tts import kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C, ctx, pad, act, pairs, xb", [
    (96, 54, 3, True, False, False), (192, 6, 0, True, False, False), (1024, 6, 0, False, False, False),
    (768, 0, 0, True, False, True), (96, 18, 5, True, False, True), (1536, 1, 0, True, True, False),
    (192, 1, 0, True, True, False), (96, 2, 0, False, True, True)])
def test_snake_join_matches_the_torch_ops(dtype, C, ctx, pad, act, pairs, xb):
    """The vocoder's join: the tail rows copied bit for bit, SnakeBeta of a strided x (a slice, as a convolution's
    output is) plus a bias, computed in fp32 from the same values and rounded once, zero pad rows; or the pairs of
    rows."""
    torch.manual_seed(C + ctx)
    B, N = 3, 200
    x = (torch.randn(B, N + 7, C, device="cuda") * 3).to(dtype)[:, 2: N + 2]  # batch stride (N + 7) * C
    tail = torch.randn(B, ctx + 1, C, device="cuda").to(dtype)[:, 1:] if ctx else None  # strided too
    alpha, beta = (torch.randn(C, device="cuda") * 0.5).to(dtype), (torch.randn(C, device="cuda") * 0.5).to(dtype)
    ab = (alpha, beta) if act else (None, None)
    x_bias = torch.randn(C, device="cuda").to(dtype) if xb else None
    out = kernels.snake_join(x, tail, pad, *ab, pairs=pairs, x_bias=x_bias)
    # the torch ops on the same values in float64

    def f64(t):
        return None if t is None else t.double().cpu()
    ref = kernels.snake_join(f64(x), f64(tail), pad, *map(f64, ab), pairs=pairs, x_bias=f64(x_bias)).to(out.device)
    assert out.shape == ref.shape == ((B, N, C, 2) if pairs else (B, ctx + N + pad, C))
    assert out.dtype == dtype and out.is_contiguous()
    if pairs:
        assert torch.equal(out[:, 0, :, 1], tail[:, -1]) and torch.equal(out[:, 1:, :, 1], out[:, :-1, :, 0])
        body, ref = out[..., 0].double(), ref[..., 0]
    else:
        if ctx:
            assert torch.equal(out[:, :ctx], tail)
        assert torch.equal(out[:, ctx + N:], torch.zeros_like(out[:, ctx + N:]))
        body, ref = out[:, ctx: ctx + N].double(), ref[:, ctx: ctx + N]
    # one rounding to `dtype` (relative 2**-8 for bf16, 2**-24 for fp32 with a few more ulps from the sums), plus the
    # fp32 rounding of sin's argument (x + x_bias) * e^alpha (relative ~2**-22 with exp's and the sum's errors),
    # through a slope |sin 2u| <= 1, scaled by 1 / e^beta
    rel = 2**-8 if dtype == torch.bfloat16 else 2**-21
    xs = x.double() if x_bias is None else x.double().abs() + x_bias.double().abs()
    arg_err = (xs * alpha.double().exp()).abs() * 2**-20 / beta.double().exp() if act else 0
    assert ((body - ref).abs() <= ref.abs() * rel + arg_err + 1e-7).all()
