"""The vocoder's joins: SnakeBeta, and a causal convolution's input joined to its carried tail in one pass
(q3tts.models.codec)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
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
