"""The vocoder's joins: SnakeBeta, and a causal convolution's input joined to its carried tail in one pass
(q3tts.models.codec)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: F.linear everywhere
    triton = None

from .common import ENABLED


# ------------------------------------------------------------------------------------------- the vocoder's joins
# Before each causal convolution of Code2Wav (time-major [B, N, C]) its input is joined to the carried tail, and
# before most of them it first goes through SnakeBeta: one pass over the activation instead of three to five.
def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """SnakeBeta x + sin^2(x * e^alpha) / (e^beta + 1e-9) of x [..., C] with log-parameters alpha, beta [C]."""
    return x + (1.0 / (beta.exp() + 1e-9)) * torch.sin(x * alpha.exp()).pow(2)


if triton is not None:

    @triton.jit
    def _joined_rows(x_ptr, tail_ptr, a_ptr, b_ptr, xb_ptr, b, rows, rc, N, CTX, sxb, sxn, stb, stn,
                     ACT: tl.constexpr, XB: tl.constexpr):
        # fp32 [rows, channels rc] of the join [tail; act(x + xb); zeros] of batch row b: join rows < CTX are the
        # tail's, the next N are act(x + xb), the rest zero. ACT: SnakeBeta (act(0) = 0); XB: a bias of x
        n = rows - CTX
        in_x = ((n >= 0) & (n < N))[:, None]
        x = tl.load(x_ptr + b * sxb + n[:, None] * sxn + rc[None, :], mask=in_x, other=0.0).to(tl.float32)
        if XB:
            x = tl.where(in_x, x + tl.load(xb_ptr + rc).to(tl.float32)[None, :], 0.0)
        if ACT:
            ea = tl.exp(tl.load(a_ptr + rc).to(tl.float32))
            ib = 1.0 / (tl.exp(tl.load(b_ptr + rc).to(tl.float32)) + 1e-9)
            s = tl.sin(x * ea[None, :])
            x = x + ib[None, :] * s * s
        in_tail = ((rows >= 0) & (rows < CTX))[:, None]
        t = tl.load(tail_ptr + b * stb + rows[:, None] * stn + rc[None, :], mask=in_tail, other=0.0)
        return tl.where(in_tail, t.to(tl.float32), x)

    # N, CTX, L change with every call shape and only bound masks: not specialized on (== 1, % 16), so all the
    # decoder's call shapes share 9 compiled variants (an H100 capture). The strides stay specialized: their multiples
    # of 16 let the loads and stores vectorize
    @triton.jit(do_not_specialize=["N", "CTX", "L"])
    def _snake_join(x_ptr, tail_ptr, a_ptr, b_ptr, xb_ptr, y_ptr, N, C, CTX, L, sxb, sxn, stb, stn,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, ACT: tl.constexpr, XB: tl.constexpr,
                    PAIRS: tl.constexpr):
        # y contiguous; BLOCK_C divides C. Not PAIRS: y [B, L, C] = the join's first L rows. PAIRS: y [B, N, C, 2],
        # y[b, n, c] = (join row CTX + n, join row CTX + n - 1) at channel c
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        b = tl.program_id(1).to(tl.int64)
        rc = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        if PAIRS:  # interleaved in registers, stored contiguous (two stride-2 stores took up to 9x as long, H100)
            cur = _joined_rows(x_ptr, tail_ptr, a_ptr, b_ptr, xb_ptr, b, rt + CTX, rc, N, CTX, sxb, sxn, stb, stn,
                               ACT, XB)
            prev = _joined_rows(x_ptr, tail_ptr, a_ptr, b_ptr, xb_ptr, b, rt + CTX - 1, rc, N, CTX, sxb, sxn, stb,
                                stn, ACT, XB)
            y = tl.reshape(tl.join(cur, prev), (BLOCK_T, 2 * BLOCK_C))
            r2 = tl.program_id(2) * 2 * BLOCK_C + tl.arange(0, 2 * BLOCK_C)
            tl.store(y_ptr + b * N * 2 * C + rt[:, None] * 2 * C + r2[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=(rt < N)[:, None])
        else:
            y = _joined_rows(x_ptr, tail_ptr, a_ptr, b_ptr, xb_ptr, b, rt, rc, N, CTX, sxb, sxn, stb, stn, ACT, XB)
            tl.store(y_ptr + b * L * C + rt[:, None] * C + rc[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=(rt < L)[:, None])


def snake_join(x: torch.Tensor, tail: torch.Tensor | None = None, pad: int = 0, alpha: torch.Tensor | None = None,
               beta: torch.Tensor | None = None, pairs: bool = False,
               x_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The join j = [tail; act(x + x_bias); pad zero rows] along time: x [B, N, C], tail [B, ctx, C] or None
    (channels contiguous in both, any other strides), act = SnakeBeta(alpha, beta [C]), or none when alpha is None,
    x_bias [C] or None (a convolution's bias, added here instead of in a pass of its own).
    Returns j [B, ctx + N + pad, C] contiguous, or with pairs (pad = 0, ctx >= 1) each new row next to the one
    before it, channel by channel: [B, N, C, 2] with [b, n, c] = (j[b, ctx + n, c], j[b, ctx + n - 1, c]).
    On CUDA one Triton launch (SnakeBeta in fp32, rounded once); elsewhere the torch ops."""
    B, N, C = x.shape
    ctx = 0 if tail is None else tail.shape[1]
    assert not pairs or (ctx >= 1 and pad == 0)
    if ENABLED and x.is_cuda and x.stride(-1) == 1 and (tail is None or tail.stride(-1) == 1):
        L = ctx + N + pad
        y = torch.empty((B, N, C, 2) if pairs else (B, L, C), device=x.device, dtype=x.dtype)
        bc = min(128, C & -C)  # the largest power of two dividing C (96 -> 32), at most 128
        bt = 4096 // bc // (2 if pairs else 1)
        t = x if tail is None else tail
        _snake_join[(triton.cdiv(N if pairs else L, bt), B, C // bc)](
            x, t, x if alpha is None else alpha, x if beta is None else beta, x if x_bias is None else x_bias, y, N, C,
            ctx, L, x.stride(0), x.stride(1), t.stride(0), t.stride(1), BLOCK_T=bt, BLOCK_C=bc, ACT=alpha is not None,
            XB=x_bias is not None, PAIRS=pairs, num_warps=4)
        return y
    x = x if x_bias is None else x + x_bias
    parts = [] if tail is None else [tail]
    parts.append(x if alpha is None else snake_beta(x, alpha, beta))
    if pad:
        parts.append(x.new_zeros(B, pad, C))
    j = torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()
    return torch.stack([j[:, ctx:], j[:, ctx - 1: ctx - 1 + N]], -1) if pairs else j


# ------------------------------------------------------------------------------------------- the causal convolutions
# A causal convolution of the time-major decoder over its joined input (above), as an implicit GEMM: output sample n
# of row b is sum over taps j of x[b, n + j*d] @ W[:, :, j].T, K = taps x C_in summed tap by tap, BLOCK_K channels at
# a time. Why not cuDNN: cuDNN builds an execution plan for each new input shape, and the vocoder's calls come in two
# dozen shapes (rows x frames) of ~17 convolutions each: hundreds of plans at every start (BENCHMARKS.md). These
# kernels compile once per tile configuration; their sums run in one order whatever the rows, the frames and the
# sample's position, so a sample's value does not depend on how its stream was cut into calls.
if triton is not None:

    @triton.jit(do_not_specialize=["L", "n_out", "P", "taps", "dil", "C_in", "C_out"])
    def _conv_dense(x_desc, w_desc, b_ptr, y_ptr, L, n_out, P, taps, dil, C_in, C_out,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BIAS: tl.constexpr):
        # x_desc: the input as [P = B*L, C_in] (the batch rows one after another); w_desc: the weight as [C_out,
        # taps*C_in] (the taps-middle storage); y [B, n_out, C_out]. A program takes BLOCK_M consecutive input rows p
        # and stores the outputs of those with n = p mod L < n_out (the others would straddle two batch rows: computed,
        # not stored), so a call of many short rows packs them into full tiles. Each tap's blocks are bulk (TMA) loads.
        # BLOCK_K need not divide C_in: a chunk's columns past C_in load as zeros from x_desc (out of bounds), so the
        # weight columns they meet (the next tap's, or zeros past the last) add exact zeros
        p0 = tl.program_id(0) * BLOCK_M
        n0 = tl.program_id(1) * BLOCK_N
        chunks = tl.cdiv(C_in, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for it in range(taps * chunks):
            j = it // chunks
            c = (it - j * chunks) * BLOCK_K
            a = x_desc.load([p0 + j * dil, c])  # [BLOCK_M, BLOCK_K]; rows past P read as zeros
            w = w_desc.load([n0, j * C_in + c])  # [BLOCK_N, BLOCK_K]
            acc = tl.dot(a, w.T, acc)
        p = p0 + tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        bi = p // L
        n = p - bi * L
        in_n = rn < C_out
        if BIAS:
            acc += tl.load(b_ptr + rn, mask=in_n, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + (bi.to(tl.int64) * n_out + n)[:, None] * C_out + rn[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=((n < n_out) & (p < P))[:, None] & in_n[None, :])

    @triton.jit(do_not_specialize=["L", "n_out", "taps", "dil", "C"])
    def _conv_depthwise(x_ptr, w_ptr, b_ptr, y_ptr, L, n_out, taps, dil, C, swc, swj,
                        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BIAS: tl.constexpr):
        # one input channel per output channel: y[b, n, c] = sum_j x[b, n + j*d, c] * w[c, 0, j] (+ bias[c])
        rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        b = tl.program_id(2).to(tl.int64)
        in_t = rt < n_out
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in range(taps):
            a = tl.load(x_ptr + b * L * C + (rt + j * dil)[:, None] * C + rc[None, :], mask=in_t[:, None], other=0.0)
            acc += a.to(tl.float32) * tl.load(w_ptr + rc * swc + j * swj).to(tl.float32)[None, :]
        if BIAS:
            acc += tl.load(b_ptr + rc).to(tl.float32)[None, :]
        tl.store(y_ptr + b * n_out * C + rt[:, None] * C + rc[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=in_t[:, None])


# (C_in, C_out) -> _conv_dense's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for Code2Wav's convolutions: the fastest
# summed over its 1 x 1, 4 x 16 and 64 x 1 (rows x frames) calls of an H100 sweep (bench/probe_conv.py, BENCHMARKS.md)
_DENSE_TILES = {(512, 1024): (64, 32, 128, 4, 4), (1024, 1536): (64, 128, 128, 4, 4), (768, 768): (64, 256, 64, 4, 4),
                (384, 384): (64, 128, 64, 4, 4), (192, 192): (128, 64, 64, 8, 4), (96, 96): (128, 32, 32, 4, 4),
                (96, 1): (128, 16, 32, 4, 3)}


def dense_tiles(c_in: int, c_out: int) -> tuple[int, int, int, int, int]:
    """_conv_dense's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for these channels. The channels alone choose them, so
    a sample's sums run in one order whatever the call (rows, frames) it is in."""
    if (c_in, c_out) in _DENSE_TILES:
        return _DENSE_TILES[c_in, c_out]
    return 128, min(128, max(16, triton.next_power_of_2(c_out))), 64 if c_in % 64 == 0 else 32, 4, 3


def causal_conv_applies(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """causal_conv runs this convolution: CUDA, 16-bit floats, input channels in multiples of 32, dense with the
    taps-middle weight (channels contiguous) or depthwise."""
    c_in = x.shape[-1]
    return (ENABLED and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and c_in % 32 == 0 and (groups == 1 and weight.stride(1) == 1 or groups == c_in))


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int,
                groups: int, tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """The valid (unpadded) convolution along time of x [B, L, C_in] (contiguous) with weight [C_out, C_in / groups,
    taps] stored taps-middle (stride 1 along C_in): y [B, L - (taps - 1) * dilation, C_out], y[b, n] = sum_j
    x[b, n + j*dilation] @ weight[:, :, j].T (+ bias). groups: 1 or C_in (depthwise). fp32 sums, rounded once.
    tiles: a dense convolution's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) instead of dense_tiles' (the sweep of
    bench/probe_conv.py)."""
    B, L, C_in = x.shape
    C_out, _, taps = weight.shape
    n_out = L - (taps - 1) * dilation
    x = x.contiguous()
    y = torch.empty((B, n_out, C_out), device=x.device, dtype=x.dtype)
    if n_out <= 0 or B == 0:
        return y
    b = weight if bias is None else bias  # a placeholder pointer when there is no bias
    if groups == 1:
        if x.data_ptr() % 16:  # a bulk copy's global address is 16-byte aligned
            x = x.clone()
        bm, bn, bk, warps, stages = tiles or dense_tiles(C_in, C_out)
        x_desc = TensorDescriptor.from_tensor(x.view(B * L, C_in), [bm, bk])
        w_desc = TensorDescriptor.from_tensor(weight.permute(0, 2, 1).reshape(C_out, taps * C_in), [bn, bk])
        _conv_dense[(triton.cdiv(B * L, bm), triton.cdiv(C_out, bn))](
            x_desc, w_desc, b, y, L, n_out, B * L, taps, dilation, C_in, C_out, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            BIAS=bias is not None, num_warps=warps, num_stages=stages)
    else:
        bc = 128 if C_in % 128 == 0 else 32
        bt = 4096 // bc
        _conv_depthwise[(triton.cdiv(n_out, bt), C_in // bc, B)](
            x, weight, b, y, L, n_out, taps, dilation, C_in, weight.stride(0), weight.stride(2),
            BLOCK_T=bt, BLOCK_C=bc, BIAS=bias is not None, num_warps=4)
    return y
