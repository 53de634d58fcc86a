"""The elementwise glue of a padded prefill (the forced aligner's bucketed pass, q3tts.models.aligner): the Q/K
RMSNorms and RoPE from the fused q|k|v projection straight into attention's [B, H, S, Dh] layout, and the MLP's
SiLU(gate) * up. Eagerly these are a dozen kernels a layer, half of them strided or in fp32 (BENCHMARKS.md: the
aligner's profile); here two. Each residual add with the norm after it (the LM's RMSNorm, the audio encoder's
LayerNorm: both stacks are pre-norm) is one kernel too: add_rms_norm, add_layer_norm. So is the audio encoder's first
conv with its GELU (conv1_gelu): the taps read from the mel chunks, its activation written once.

Each result is rounded to bf16 where the eager modules store one (models.layers.RMSNorm, apply_rope, F.silu then the
product), so the values are the eager ones up to the last bit of the fp32 statistics (the sum of squares is reduced
in another order). bf16 only: where *_applies is False the caller runs the modules.
"""

from __future__ import annotations

import torch

from .. import invariant
from .common import triton

if triton is not None:
    import triton.language as tl

    from .common import _bf, unspecialized

    @triton.jit
    def _qk_norm_rope(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, S, stride_t, eps,
                      H: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, HP: tl.constexpr):
        # one program per token b * S + s: its H query then HKV key heads as the rows of an [HP, DH] block (HP: the
        # heads padded to a power of two, the padding rows masked)
        t = tl.program_id(0).to(tl.int64)
        b = t // S
        s = t - b * S
        h = tl.arange(0, HP)[:, None]  # [HP, 1]
        d = tl.arange(0, DH)[None, :]  # [1, DH]
        dp = (d + DH // 2) % DH  # rotate_half's partner of d
        real = h < H + HKV
        src = qkv_ptr + t * stride_t + h * DH
        x = tl.load(src + d, mask=real, other=0.0).to(tl.float32)
        xp = tl.load(src + dp, mask=real, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / DH + eps)[:, None]  # RMSNorm's fp32 statistics, a head each
        is_q = h < H
        w = tl.where(is_q, tl.load(qw_ptr + d).to(tl.float32), tl.load(kw_ptr + d).to(tl.float32))
        wp = tl.where(is_q, tl.load(qw_ptr + dp).to(tl.float32), tl.load(kw_ptr + dp).to(tl.float32))
        y = _bf(w * _bf(x * r))  # RMSNorm: the normalized row in bf16, times the weight in bf16
        yp = _bf(wp * _bf(xp * r))
        c = tl.load(cos_ptr + s * DH + d).to(tl.float32)
        sn = tl.load(sin_ptr + s * DH + d).to(tl.float32)
        out = _bf(_bf(y * c) + _bf(tl.where(d < DH // 2, -yp, yp) * sn))  # x * cos + rotate_half(x) * sin
        out = out.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + (t * H + h) * DH + d, out, mask=is_q)  # token-major: [B, S, H, DH]
        tl.store(k_ptr + (t * HKV + h - H) * DH + d, out, mask=real & (h >= H))

    @triton.jit
    def _silu_mul(gu_ptr, out_ptr, N, INTER, BLOCK: tl.constexpr):
        # gate | up rows [R, 2 INTER] -> [R, INTER]; BLOCK outputs per program
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = i < N
        row = i // INTER
        col = i - row * INTER
        g = tl.load(gu_ptr + row * 2 * INTER + col, mask=keep, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * INTER + INTER + col, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, _bf(_bf(g / (1.0 + tl.exp(-g))) * u).to(out_ptr.dtype.element_ty), mask=keep)

    # one compiled variant whatever the bucket's shape (Triton would compile one apart for sizes of 1 or multiples of
    # 16): a new bucket is captured while the engine serves
    @triton.jit(**unspecialized("NP", "W", "M1", "T1", "ITERS"))
    def _conv1_gelu(x_ptr, w_ptr, b_ptr, out_ptr, NP, M, W, M1, T1, C, ITERS,
                    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        # program (channel block, pixel group): ITERS blocks of BLOCK_P output pixels of the flattened [N * M1 * T1],
        # BLOCK_C channels. Each block: the pixels' 3x3 taps of the zero-padded input [N, M, W] gathered as an
        # [BLOCK_P, 16] patch tile (taps 9..15 zero), one tensor-core dot with the weight tile [16, BLOCK_C] (loaded
        # once per program, a few KB from L2) summing the 9 exact bf16 products in fp32, then the bias, the conv's
        # bf16 rounding, the GELU and one store of [BLOCK_P, BLOCK_C] rows contiguous along C. Pixel and input
        # indices fit int32 (the wrapper checks); the output offsets (N * M1 * T1 * C elements) are int64.
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        k = tl.arange(0, 16)  # tap (k // 3, k % 3) of the window at input row 2i - 1, column 2j - 1
        keep_c = c < C
        w = tl.load(w_ptr + c[None, :] * 9 + k[:, None], mask=(k < 9)[:, None] & keep_c[None, :], other=0.0)
        bias = tl.load(b_ptr + c, mask=keep_c, other=0.0).to(tl.float32)[None, :]
        for it in range(ITERS):
            q = (tl.program_id(1) * ITERS + it) * BLOCK_P + tl.arange(0, BLOCK_P)  # pixel n * M1 * T1 + i * T1 + j
            keep = q < NP
            n = q // (M1 * T1)
            p = q - n * (M1 * T1)
            i = p // T1
            j = p - i * T1
            r = 2 * i[:, None] + k[None, :] // 3 - 1  # [BLOCK_P, 16]
            s = 2 * j[:, None] + k[None, :] % 3 - 1
            tap = keep[:, None] & (k < 9)[None, :] & (r >= 0) & (r < M) & (s >= 0) & (s < W)
            a = tl.load(x_ptr + n.to(tl.int64)[:, None] * M * W + r * W + s, mask=tap, other=0.0)
            h = _bf(tl.dot(a, w) + bias)  # the conv's output as the module stores it
            g = h * 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))  # exact GELU in fp32, as F.gelu computes it
            dst = out_ptr + q.to(tl.int64)[:, None] * C + c[None, :]  # channels-last: [N, M1, T1, C]
            tl.store(dst, g.to(out_ptr.dtype.element_ty), mask=keep[:, None] & keep_c[None, :])

    @triton.jit
    def _add_ln(x_ptr, d_ptr, w_ptr, b_ptr, s_ptr, y_ptr, D, eps, ADD: tl.constexpr, BD: tl.constexpr):
        # one row per program: (ADD) s = x + delta rounded to the dtype and stored, else s = x; then LayerNorm of s in
        # fp32 (mean, then the variance of the centred row: two sums over the block), rounded once, as F.layer_norm
        # of a bf16 input stores it. Both variants reduce the same fp32 row in the same block: add then norm gives
        # the fused kernel's bits.
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BD)
        x = tl.load(x_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
        if ADD:
            s = (x + tl.load(d_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + row * D + d, s, mask=d < D)
            x = s.to(tl.float32)
        mean = tl.sum(x, axis=0) / D
        xc = tl.where(d < D, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(xc * xc, axis=0) / D + eps)
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        bias = tl.load(b_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * D + d, (xc * rstd * w + bias).to(y_ptr.dtype.element_ty), mask=d < D)


def prefill_glue_applies(x: torch.Tensor) -> bool:
    """Whether qk_norm_rope and silu_mul serve a layer whose activations are x: Triton there, x on CUDA in bf16."""
    return triton is not None and x.is_cuda and x.dtype == torch.bfloat16


def qk_norm_rope(qkv: torch.Tensor, q_norm: torch.nn.Module, k_norm: torch.nn.Module, cos: torch.Tensor,
                 sin: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [B, S, (H + 2 Hkv) Dh] (rows contiguous) -> q [B, H, S, Dh], k [B, Hkv, S, Dh]: RMSNorm (q_norm / k_norm:
    per-head weights [Dh], their eps) then RoPE with cos / sin [S, Dh] (rotate_half convention), as
    apply_rope(q_norm(q), cos, sin). Both are laid out token-major ([B, S, heads, Dh] transposed, as v lies in qkv):
    attention's output comes in q's layout, so merging its heads back into [B, S, H * Dh] is a view, not a copy."""
    B, S, _ = qkv.shape
    H, Hkv = num_heads, num_kv_heads
    Dh = cos.shape[-1]
    assert qkv.stride(-1) == 1 and qkv.stride(0) == S * qkv.stride(1) and cos.is_contiguous() and sin.is_contiguous()
    assert q_norm.eps == k_norm.eps
    q = qkv.new_empty(B, S, H, Dh)
    k = qkv.new_empty(B, S, Hkv, Dh)
    _qk_norm_rope[(B * S,)](qkv, q_norm.weight, k_norm.weight, cos, sin, q, k, S, qkv.stride(1), q_norm.eps,
                            H=H, HKV=Hkv, DH=Dh, HP=triton.next_power_of_2(H + Hkv), num_warps=4)
    return q.transpose(1, 2), k.transpose(1, 2)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 inter] (gate | up, contiguous) -> F.silu(gate) * up [..., inter]."""
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    N = out.numel()
    BLOCK = 1024
    _silu_mul[(triton.cdiv(N, BLOCK),)](gate_up.contiguous(), out, N, inter, BLOCK=BLOCK, num_warps=4)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the RMSNorm after it in one pass: x, delta [..., D] (contiguous, x's dtype), weight [D]
    -> (s = x + delta, invariant.rms_norm(s, weight, eps)), both bit for bit the two eager steps' (s rounded to the
    dtype first, the norm from the rounded s in _rms's order). Reads x and delta, writes s and y: four passes over
    [..., D] where the add then the norm make five, in one launch instead of two."""
    D = x.shape[-1]
    assert x.shape == delta.shape and x.is_contiguous() and delta.is_contiguous() and weight.dtype == x.dtype
    s, y = torch.empty_like(x), torch.empty_like(x)
    R = x.numel() // D
    if R:
        invariant._rms[(R,)](x, delta, weight, s, y, R, D, eps, ADD=True, BD=triton.next_power_of_2(D), num_warps=4)
    return s, y


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the LayerNorm after it in one pass: x, delta [..., D] (contiguous, x's dtype), weight /
    bias [D] -> (s = x + delta rounded to the dtype, LayerNorm of s: fp32 statistics, one rounding at the end, as
    F.layer_norm of a bf16 input; the statistics summed in another order than torch's, so a value can sit a bf16
    step away from F.layer_norm's). delta None: the norm of x alone (s is x), whose bits the fused form gives for
    the same s: add then norm with this function equals the fused call bit for bit."""
    D = x.shape[-1]
    assert x.is_contiguous() and weight.dtype == bias.dtype == x.dtype
    assert delta is None or (delta.shape == x.shape and delta.is_contiguous())
    s = x if delta is None else torch.empty_like(x)
    y = torch.empty_like(x)
    R = x.numel() // D
    if R:
        _add_ln[(R,)](x, x if delta is None else delta, weight, bias, s, y, D, eps, ADD=delta is not None,
                      BD=triton.next_power_of_2(D), num_warps=4)
    return s, y


def conv1_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """F.gelu(F.conv2d(x[:, None], weight, bias, stride=2, padding=1)) for one input channel, in one pass: x [N, M, W],
    weight [C, 1, 3, 3], bias [C] -> [N, C, M1, T1] in channels-last memory ([N, M1, T1, C] permuted), the conv's
    output rounded to the dtype before the GELU (as the module stores it), the GELU's once after. The taps are read
    from x itself (no patch tensor) and the activation, the encoder's largest, is written once: eagerly the conv's
    output is written, then read and written again by the GELU."""
    N, M, W = x.shape
    C = weight.shape[0]
    assert weight.shape == (C, 1, 3, 3) and weight.is_contiguous() and bias.shape == (C,)
    M1, T1 = (M - 1) // 2 + 1, (W - 1) // 2 + 1
    NP = N * M1 * T1
    out = x.new_empty(N, M1, T1, C)
    # The exact GELU's erf, not the memory traffic, bounds this kernel: small blocks keep few values live through it
    # (128 pixels x 32 channels in 4 warps: 32 fp32 accumulators a thread; wider channel blocks ran slower). Up to 16
    # blocks a program, so the weight tile is loaded once for many, once there are about 512 pixel groups (a few
    # per SM) to spread.
    BLOCK_P, BLOCK_C = 128, 32
    iters = max(1, min(16, NP // (BLOCK_P * 512)))
    assert (NP + BLOCK_P * iters) < 2**31 and N * M * W < 2**31  # the kernel's pixel and input indices are int32
    if NP:
        _conv1_gelu[(triton.cdiv(C, BLOCK_C), triton.cdiv(NP, BLOCK_P * iters))](
            x.contiguous(), weight, bias, out, NP, M, W, M1, T1, C, iters, BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C,
            num_warps=4)
    return out.permute(0, 3, 1, 2)
