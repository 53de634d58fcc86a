"""q3tts.kernels.vocoder: the SnakeBeta join against the torch ops in float64; the causal convolutions against a
float64 convolution, and their outputs independent of how a call is cut."""

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


def _taps_middle(w: torch.Tensor) -> torch.Tensor:
    return w.permute(0, 2, 1).contiguous().permute(0, 2, 1)  # as codec._taps_middle_ stores a conv weight


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("c_in, c_out, taps, d, groups, bias", [
    (96, 96, 7, 9, 1, False), (192, 192, 7, 3, 1, True), (768, 768, 7, 1, 1, False), (1024, 1536, 7, 1, 1, True),
    (512, 1024, 3, 1, 1, True), (96, 1, 7, 1, 1, True), (1024, 1024, 7, 1, 1024, True), (32, 32, 7, 1, 32, False)])
def test_causal_conv_matches_a_float64_conv(dtype, c_in, c_out, taps, d, groups, bias):
    """The vocoder's causal convolution (every shape Code2Wav runs, and a depthwise one at the tiny model's 32 channels)
    against F.conv1d in float64 on the same values: one rounding of an fp32 sum."""
    _check_against_float64(dtype, c_in, c_out, taps, d, groups, bias)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("c_in, c_out, d, tiles", [
    (96, 96, 9, (128, 128, 128, 4, 3)), (96, 96, 1, (256, 64, 64, 8, 3)), (192, 192, 3, (128, 64, 128, 8, 3)),
    (96, 1, 1, (128, 16, 128, 4, 3))])
def test_causal_conv_with_k_tiles_past_the_channels(c_in, c_out, d, tiles):
    """A K tile wider than the channels it has left (BLOCK_K not dividing C_in): the columns past C_in load as zeros
    and meet the next tap's weights, which must add nothing."""
    _check_against_float64(torch.bfloat16, c_in, c_out, 7, d, 1, True, tiles)


def _check_against_float64(dtype, c_in, c_out, taps, d, groups, bias, tiles=None):
    import torch.nn.functional as F
    torch.manual_seed(c_in + c_out + taps + d)
    B, L = 3, 300 + (taps - 1) * d
    x = torch.randn(B, L, c_in, device="cuda").to(dtype)
    w = _taps_middle((torch.randn(c_out, c_in // groups, taps, device="cuda") / (c_in // groups * taps) ** 0.5)
                     .to(dtype))
    b = torch.randn(c_out, device="cuda").to(dtype) if bias else None
    assert kernels.causal_conv_applies(x, w, groups)
    out = kernels.causal_conv(x, w, b, d, groups, tiles)
    assert out.shape == (B, 300, c_out) and out.dtype == dtype and out.is_contiguous()

    def conv64(x, w, b):
        return F.conv1d(x.double().cpu().transpose(1, 2), w.double().cpu(), None if b is None else b.double().cpu(),
                        dilation=d, groups=groups).transpose(1, 2)
    ref = conv64(x, w, b)
    mag = conv64(x.abs(), w.abs(), None if b is None else b.abs())  # sum of the terms' magnitudes
    # one rounding to dtype (relative 2**-8 for bf16, 2**-11 for fp16) of an fp32 sum of K = taps * c_in / groups exact
    # products (16-bit x 16-bit fits fp32's mantissa), each addition rounding by at most 2**-24 of the running magnitude
    rel = 2**-8 if dtype == torch.bfloat16 else 2**-11
    K = taps * c_in // groups
    assert ((out.double().cpu() - ref).abs() <= ref.abs() * rel + mag * K * 2**-24 + 1e-6).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("c, taps, d, groups", [(96, 7, 9, 1), (768, 7, 1, 1), (1024, 7, 1, 1024), (96, 7, 1, 1)])
def test_causal_conv_output_does_not_depend_on_the_call(c, taps, d, groups):
    """A sample's value is the same bits whatever else the call holds: its row alone or among others, and its time
    window cut anywhere (each piece with its context), as the streaming vocoder cuts a stream into calls."""
    torch.manual_seed(c + d)
    ctx = (taps - 1) * d
    x = torch.randn(5, ctx + 777, c, device="cuda").to(torch.bfloat16)
    w = _taps_middle((torch.randn(c, c // groups, taps, device="cuda") / (c // groups * taps) ** 0.5)
                     .to(torch.bfloat16))
    b = torch.randn(c, device="cuda").to(torch.bfloat16)
    whole = kernels.causal_conv(x, w, b, d, groups)  # [5, 777, c]
    for r in (0, 3):
        assert torch.equal(kernels.causal_conv(x[r: r + 1], w, b, d, groups)[0], whole[r])
    cuts = [0, 1, 17, 300, 301, 777]
    pieces = [kernels.causal_conv(x[:, lo: hi + ctx], w, b, d, groups) for lo, hi in zip(cuts, cuts[1:])]
    assert torch.equal(torch.cat(pieces, 1), whole)
