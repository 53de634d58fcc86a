"""The engine's Triton kernels for decoding: skinny GEMMs (y = x @ w.T for a handful of rows: a decode step, rows =
batch <= 16); for one stream, a decoder layer pass in a few launches (gemv_ex: GEMVs that carry the RMSNorms, the
SiLU gate and the residual adds; decode_attention: one token's attention from q|k|v to the output); the sampling
noise of a frame in one launch (frame_noise_cuda) and top-k sampling in two (sample_top).

Why: one decode frame runs 103 decoder layers at one row each, and cuBLAS picks poor kernels for such
shapes. Measured on an H200 in a CUDA graph, one row, bf16, weights read from HBM as in a frame
(bench/probe_gemv.py --cold): o_proj 2048->1024 12.8 us with cuBLAS vs 3.5 us here, down 3072->1024
7.4 vs 4.4, gate_up 1024->6144 6.1 vs 5.0, qkv 1024->4096 5.3 vs 4.0, lm_head 1024->2048 4.7 vs 3.0. The kernels stream the weight once with fp32 accumulation; the result can
differ from cuBLAS's in the last bf16 bit (different summation order), as cuBLAS's own kernels differ
between batch sizes.

`linear` dispatches: these kernels on CUDA in bf16/fp16 for <= MAX_ROWS rows and divisible sizes;
F.linear everywhere else (CPU, fp32, prefill, big batches). Q3TTS_SKINNY_GEMM=0 turns every kernel here off.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from . import invariant

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear everywhere
    triton = None

MAX_ROWS = 16
ENABLED = triton is not None and os.environ.get("Q3TTS_SKINNY_GEMM", "1") != "0"  # the engine's Triton kernels


@functools.cache
def pdl() -> bool:
    """Programmatic dependent launch (Hopper and later): a kernel is scheduled while the one before it finishes, and
    loads what does not depend on it (its weights) before waiting for it (griddepcontrol). Measured on an H100, one
    stream: the whole-frame graph 3.80 -> 3.47 ms (Inductor's kernels do not take part: engine.runner.compile_layers
    says why). Q3TTS_PDL=0 turns it off. Asked at the first launch (CUDA is up by then)."""
    return (ENABLED and os.environ.get("Q3TTS_PDL", "1") != "0" and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


if triton is not None:

    @triton.jit
    def _gemv_row(x_ptr, w_ptr, s_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SCALED: tl.constexpr):
        # one row: each program owns BLOCK_N outputs and streams their weight rows over K. SCALED: an int8 / fp8
        # weight (dequantized in registers) with a per-output-channel scale at s_ptr (ignored otherwise)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + rk).to(tl.float32)
            w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :]).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        if SCALED:
            acc *= tl.load(s_ptr + rn)
        tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty))

    @triton.jit
    def _gemv_rows(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
        # 2..16 rows padded to a 16-row tensor-core tile; the weight is still read once
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :])
            acc += tl.dot(x, tl.trans(w))
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)

    @torch.library.custom_op("q3tts::skinny_linear", mutates_args=())
    def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x: [M, K] contiguous, M <= MAX_ROWS; w: [N, K] contiguous -> [M, N]. Needs N % 32 == 0, K % 512 == 0."""
        M, K = x.shape
        N = w.shape[0]
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        if M == 1:  # block sizes: the fastest of a sweep with weights not in L2 on an H200 (bench/probe_gemv.py --cold)
            bk = 1024 if K % 1024 == 0 else 512
            # s_ptr = w: a placeholder, never read unless SCALED
            _gemv_row[(N // 2,)](x, w, w, y, N, K, BLOCK_N=2, BLOCK_K=bk, SCALED=False, num_warps=4, num_stages=3)
        else:
            _gemv_rows[(N // 32,)](x, w, y, M, N, K, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
        return y

    @skinny_linear.register_fake
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @triton.jit
    def _qgemm(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
        # any number of rows: tiles of BLOCK_M rows; int8 / fp8 -> bf16 is exact, so tl.dot sees the stored values
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :]).to(x.dtype)
            acc += tl.dot(x, tl.trans(w))
        acc *= tl.load(s_ptr + rn)[None, :]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)

    @torch.library.custom_op("q3tts::quant_linear_triton", mutates_args=())
    def quant_linear_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x: [M, K] bf16/fp16 contiguous; w: [N, K] int8 or float8_e4m3fn; scale: [N] fp32 -> x @ (w * scale).T.
        Needs N % 32 == 0 and K % 256 == 0."""
        M, K = x.shape
        N = w.shape[0]
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        if M == 1:
            bk = 1024 if K % 1024 == 0 else 256
            _gemv_row[(N // 2,)](x, w, scale, y, N, K, BLOCK_N=2, BLOCK_K=bk, SCALED=True, num_warps=4,
                                 num_stages=3)
        else:
            bm = 16 if M <= 16 else 64
            _qgemm[(N // 32, triton.cdiv(M, bm))](x, w, scale, y, M, N, K, BLOCK_M=bm, BLOCK_N=32,
                                                   BLOCK_K=256 if bm == 16 else 128, num_warps=4, num_stages=3)
        return y

    @quant_linear_triton.register_fake
    def _(x, w, scale):
        return x.new_empty((x.shape[0], w.shape[0]))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), through the skinny kernels when they apply. x: [..., K]; w: [N, K], or a quantized
    linear module (q3tts.models.quant.QuantLinear, whose `.weight` is itself), which runs its own kernel."""
    if isinstance(w, torch.nn.Module):
        assert bias is None, "a quantized linear carries its own bias"
        return w(x)
    if invariant.matmul_applies(x, w):  # batch-invariant mode: one kernel for every number of rows
        return invariant.matmul(x, w, bias)
    if (ENABLED and bias is None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and x.numel() <= MAX_ROWS * x.shape[-1] and w.shape[0] % 32 == 0 and w.shape[1] % 512 == 0
            and w.is_contiguous()):
        y = torch.ops.q3tts.skinny_linear(x.reshape(-1, x.shape[-1]).contiguous(), w)
        return y.view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, bias)


def quant_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """CUDA weight-only quantized GEMM: x [M, K] @ (w [N, K] int8/fp8 * scale [N] fp32)[:, None]).T -> [M, N]
    in x's dtype. The Triton kernel streams the 1-byte weight once; other shapes dequantize (slow, correct)."""
    if triton is not None and x.dtype in (torch.bfloat16, torch.float16) and w.shape[0] % 32 == 0 \
            and w.shape[1] % 256 == 0:
        return torch.ops.q3tts.quant_linear_triton(x.contiguous(), w, scale)
    return F.linear(x, (w.to(torch.float32) * scale[:, None]).to(x.dtype))


# ---------------------------------------------------------------------------------------------- one-row layer GEMVs
# One token of one row (a stream's frame): the decoder layer's RMSNorms, SiLU gate and residual adds ride in its
# GEMVs (normed input computed per program, epilogues on the outputs) instead of a kernel each between them: 3 of a
# layer pass's ~9 launches. Rounded where the eager module rounds, as the attention kernel below.
#
# GEMV_EX_LAUNCH, read at each call: block_n output rows per program, the weight streamed in blocks of up to
# max_block_k columns. The fastest of `python -m bench.probe --sections kernels --gemv ...` (the frame's graphs under
# each launch, one process, H100). One-stream frame, 0.6B: 3.44 ms; 3.51 with 2 rows per program; 3.67 with 2 rows and
# blocks of 1024 (the launch before). 1.7B: 4.20 ms; 4.29 with 2 rows per program
GEMV_EX_LAUNCH = {"block_n": 4, "max_block_k": 4096, "num_warps": 4}

if triton is not None:

    @triton.jit
    def _bf(x):  # round fp32 to bf16 and back: where the eager module stores a bf16 result
        return x.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def _gemv_row_ex(x_ptr, w_ptr, nw_ptr, r_ptr, y_ptr, N, K, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NORM: tl.constexpr, GLU: tl.constexpr, RES: tl.constexpr, PDL: tl.constexpr):
        # y [N] = x [K] @ w.T; NORM: x is first RMSNormed (weight nw); GLU: w is [gate; up] (2N rows) and
        # y = silu(gate) * up; RES: y += r. The weight streams in blocks of BLOCK_K (a power of two, masked past K);
        # the first block is loaded before waiting for the kernel that wrote x and r (PDL), so where BLOCK_K >= K the
        # whole weight read overlaps the kernel before
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        km = (rk < K)[None, :]
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=km, other=0.0).to(tl.float32)
        wu = tl.load(w_ptr + (N + rn)[:, None] * K + rk[None, :], mask=km, other=0.0).to(tl.float32) if GLU else w
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if NORM:
            ss = tl.zeros((BLOCK_K,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xv = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
                ss += xv * xv
            r = 1.0 / tl.sqrt_rn(tl.sum(ss, axis=0) / K + eps)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            if k0 > 0:
                km = (kk < K)[None, :]
                w = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=km, other=0.0).to(tl.float32)
                if GLU:
                    wu = tl.load(w_ptr + (N + rn)[:, None] * K + kk[None, :], mask=km, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            if NORM:
                xv = _bf(_bf(xv * r) * tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32))
            acc += tl.sum(w * xv[None, :], axis=1)
            if GLU:
                acc_up += tl.sum(wu * xv[None, :], axis=1)
        y = _bf(acc)
        if GLU:  # F.silu on bf16 computes x / (1 + exp(-x)) in fp32, rounded; times up, rounded
            y = _bf(_bf(y / (1.0 + tl.exp(-y))) * _bf(acc_up))
        if RES:
            y = _bf(y + tl.load(r_ptr + rn).to(tl.float32))
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty))

    @torch.library.custom_op("q3tts::gemv_ex", mutates_args=())
    def gemv_ex_op(x: torch.Tensor, w: torch.Tensor, norm_w: torch.Tensor | None, residual: torch.Tensor | None,
                   eps: float, glu: bool) -> torch.Tensor:
        """See gemv_ex."""
        K = x.shape[-1]
        N = w.shape[0] // 2 if glu else w.shape[0]
        y = torch.empty((1, N), device=x.device, dtype=x.dtype)
        c = GEMV_EX_LAUNCH
        _gemv_row_ex[(N // c["block_n"],)](
            x, w, w if norm_w is None else norm_w, w if residual is None else residual, y, N, K, eps,
            BLOCK_N=c["block_n"], BLOCK_K=min(triton.next_power_of_2(K), c["max_block_k"]), NORM=norm_w is not None,
            GLU=glu, RES=residual is not None, PDL=pdl(), num_warps=c["num_warps"], num_stages=3, launch_pdl=pdl())
        return y

    @gemv_ex_op.register_fake
    def _(x, w, norm_w, residual, eps, glu):
        return x.new_empty((1, w.shape[0] // 2 if glu else w.shape[0]))


def gemv_ex_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether gemv_ex serves x [..., K] (one row in all) with these weights (bf16 [N, K], contiguous)."""
    return (ENABLED and not invariant.ENABLED and x.is_cuda and x.dtype == torch.bfloat16 and x.numel() == x.shape[-1]
            and all(isinstance(w, torch.Tensor) and w.dtype == x.dtype and w.is_contiguous()
                    and w.shape[0] % (2 * GEMV_EX_LAUNCH["block_n"]) == 0 and w.shape[1] % 512 == 0 for w in weights))


def gemv_ex(x: torch.Tensor, w: torch.Tensor, norm: torch.nn.Module | None = None,
            residual: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """One row: [norm(x)] @ w.T [silu(gate) * up for w = [gate; up]] [+ residual] -> x's shape with N outputs. norm:
    an RMSNorm module (its weight and eps); residual: N values. Only where gemv_ex_applies."""
    y = torch.ops.q3tts.gemv_ex(x.reshape(1, -1).contiguous(), w, None if norm is None else norm.weight,
                                None if residual is None else residual.reshape(1, -1).contiguous(),
                                0.0 if norm is None else norm.eps, glu)
    return y.view(*x.shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------------------------------- decode attention
# One query token per row over a short span (a code-predictor step: 16 positions): q/k
# norms, RoPE, scores, softmax and the weighted values in one kernel per (row, KV head), instead of Inductor's
# norm/RoPE kernels, two cuBLAS batched GEMMs and the softmax. It rounds where the eager module rounds (each bf16
# op's result, the scores before and after the scale, the probabilities), so it gives the eager layer's values up
# to fp32 summation order (which can move a result by one bf16 step).
ATTN_FUSED_MAX_SPAN = 64  # one block of positions per program (a 256-position span looped in one program per KV head
# took 30 us on an H100, the batched GEMMs ~11: they spread over many SMs)

if triton is not None:

    @triton.jit
    def _norm_rope(x, x_rot, w, w_rot, cos, sin, sign, eps, DH: tl.constexpr):
        # x [R, DH] fp32 (bf16 values), x_rot the same rows with halves swapped (rotate_half's order): RMSNorm
        # (fp32 statistics, weight times the bf16-rounded normed value) then x * cos + rotate_half(x) * sin
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / DH + eps)[:, None]
        xn = _bf(_bf(x * r) * w[None, :])
        xn_rot = _bf(_bf(x_rot * r) * w_rot[None, :])
        return _bf(_bf(xn * cos[None, :]) + _bf(sign[None, :] * xn_rot * sin[None, :]))

    @triton.jit
    def _decode_attn(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, wpos_ptr, mask_ptr, out_ptr, kvnew_ptr,
                     s_qkv, s_cos, s_wpos, s_mask, skb, skh, skl, svb, svh, svl, n, eps, scale,
                     H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DH: tl.constexpr,
                     BLOCK_N: tl.constexpr, WRITE: tl.constexpr, PDL: tl.constexpr):
        # WRITE: this token's key and value go into the caches at its position (after this program read them: each
        # program reads and writes its own (row, KV head) only); else into kvnew for the caller to write
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0)
        hk = tl.program_id(1)
        d = tl.arange(0, DH)
        rot = (d + DH // 2) % DH
        sign = tl.where(d < DH // 2, -1.0, 1.0)
        row = qkv_ptr + b * s_qkv
        cos = tl.load(cos_ptr + b * s_cos + d).to(tl.float32)
        sin = tl.load(sin_ptr + b * s_cos + d).to(tl.float32)
        qw, qw_rot = tl.load(qw_ptr + d).to(tl.float32), tl.load(qw_ptr + rot).to(tl.float32)
        kw, kw_rot = tl.load(kw_ptr + d).to(tl.float32), tl.load(kw_ptr + rot).to(tl.float32)
        # this token's key (normed, rotated) and value: returned for the cache write; the cache still holds the old
        # ones at this token's position wp, so the attention takes these there
        wp = tl.load(wpos_ptr + b * s_wpos)
        koff = (H + hk) * DH
        k = _norm_rope(tl.load(row + koff + d[None, :]).to(tl.float32),
                       tl.load(row + koff + rot[None, :]).to(tl.float32), kw, kw_rot, cos, sin, sign, eps, DH)  # [1, DH]
        v = tl.load(row + (H + HKV + hk) * DH + d[None, :])
        if not WRITE:
            tl.store(kvnew_ptr + (b * 2 * HKV + hk) * DH + d[None, :], k.to(kvnew_ptr.dtype.element_ty))
            tl.store(kvnew_ptr + ((b * 2 + 1) * HKV + hk) * DH + d[None, :], v.to(kvnew_ptr.dtype.element_ty))
        # the G query heads of this KV head, padded to GP rows for tensor-core dots
        g = tl.arange(0, GP)
        qoff = (hk * G + g)[:, None] * DH
        qmask = (g < G)[:, None]
        q = _norm_rope(tl.load(row + qoff + d[None, :], mask=qmask, other=0.0).to(tl.float32),
                       tl.load(row + qoff + rot[None, :], mask=qmask, other=0.0).to(tl.float32),
                       qw, qw_rot, cos, sin, sign, eps, DH).to(tl.bfloat16)  # [GP, DH]
        pos = tl.arange(0, BLOCK_N)
        here = (pos == wp)[:, None]
        kb = tl.load(kc_ptr + b * skb + hk * skh + pos[:, None] * skl + d[None, :], mask=(pos < n)[:, None], other=0.0)
        kb = tl.where(here, k, kb.to(tl.float32)).to(tl.bfloat16)
        vb = tl.load(vc_ptr + b * svb + hk * svh + pos[:, None] * svl + d[None, :], mask=(pos < n)[:, None], other=0.0)
        vb = tl.where(here, v, vb)
        # as the eager module: scores rounded to bf16, scaled and rounded again, masked; fp32 softmax; probabilities
        # rounded to bf16 times the values
        ok = (tl.load(mask_ptr + b * s_mask + pos, mask=pos < n, other=0) != 0)[None, :]
        s = tl.where(ok, _bf(_bf(tl.dot(q, tl.trans(kb))) * scale), float("-inf"))
        e = tl.where(ok, tl.exp(s - tl.max(s, axis=1)[:, None]), 0.0)
        p = (e / tl.sum(e, axis=1)[:, None]).to(tl.bfloat16)
        acc = tl.dot(p, vb.to(tl.bfloat16))
        tl.store(out_ptr + b * (H * DH) + qoff + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=qmask)
        if WRITE:
            tl.store(kc_ptr + b * skb + hk * skh + wp * skl + d[None, :], k.to(kc_ptr.dtype.element_ty))
            tl.store(vc_ptr + b * svb + hk * svh + wp * svl + d[None, :], v.to(vc_ptr.dtype.element_ty))

    def _decode_attention(qkv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, write_pos, mask, num_heads, eps,
                          kv_new):
        B, Hkv, _, Dh = k_cache.shape
        G = num_heads // Hkv
        n = mask.shape[-1]
        out = torch.empty((B, 1, num_heads * Dh), device=qkv.device, dtype=qkv.dtype)
        m = mask.reshape(mask.shape[0], n)
        _decode_attn[(B, Hkv)](qkv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, write_pos, m.view(torch.uint8),
                               out, k_cache if kv_new is None else kv_new, qkv.stride(0), cos.stride(0),
                               write_pos.stride(0), m.stride(0) if m.shape[0] > 1 else 0, *k_cache.stride()[:3],
                               *v_cache.stride()[:3], n, eps, Dh ** -0.5, H=num_heads, HKV=Hkv, G=G,
                               GP=max(16, triton.next_power_of_2(G)), DH=Dh, BLOCK_N=max(16, triton.next_power_of_2(n)),
                               WRITE=kv_new is None, PDL=pdl(), num_warps=4, launch_pdl=pdl())
        return out

    @torch.library.custom_op("q3tts::decode_attention", mutates_args=())
    def decode_attention_op(qkv: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write_pos: torch.Tensor,
                            mask: torch.Tensor, num_heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """See decode_attention (write False)."""
        B, Hkv, _, Dh = k_cache.shape
        kv_new = torch.empty((B, 1, 2, Hkv, Dh), device=qkv.device, dtype=k_cache.dtype)
        out = _decode_attention(qkv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, write_pos, mask, num_heads, eps,
                                kv_new)
        return out, kv_new

    @decode_attention_op.register_fake
    def _(qkv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, write_pos, mask, num_heads, eps):
        B, Hkv, _, Dh = k_cache.shape
        return qkv.new_empty((B, 1, num_heads * Dh)), k_cache.new_empty((B, 1, 2, Hkv, Dh))

    @torch.library.custom_op("q3tts::decode_attention_write", mutates_args=("k_cache", "v_cache"))
    def decode_attention_write_op(qkv: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  write_pos: torch.Tensor, mask: torch.Tensor, num_heads: int,
                                  eps: float) -> torch.Tensor:
        """See decode_attention (write True)."""
        return _decode_attention(qkv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, write_pos, mask, num_heads, eps,
                                 None)

    @decode_attention_write_op.register_fake
    def _(qkv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, write_pos, mask, num_heads, eps):
        return qkv.new_empty((k_cache.shape[0], 1, num_heads * k_cache.shape[3]))


def decode_attention_applies(x: torch.Tensor, k_cache: torch.Tensor, n: int) -> bool:
    """Whether decode_attention serves a one-token step on x [B, 1, D] over n positions of this cache."""
    return (ENABLED and x.is_cuda and x.shape[1] == 1 and x.dtype == torch.bfloat16 and k_cache.dtype == x.dtype
            and n <= ATTN_FUSED_MAX_SPAN and k_cache.stride(-1) == 1)


def decode_attention(qkv, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, write_pos, mask, num_heads: int,
                     eps: float, write: bool = False):
    """One query token per row. qkv [B, 1, (H + 2 Hkv) * Dh] (the fused projection's output); q_norm_w,
    k_norm_w [Dh]; cos, sin [B, 1, Dh]; k_cache, v_cache [B, Hkv, L, Dh]; write_pos [B, 1]: this token's position;
    mask [B | 1, 1, 1, n] bool over the first n positions -> (attention output [B, 1, H * Dh] before o_proj, this
    token's key (normed, rotated) and value [B, 1, 2, Hkv, Dh]) for the caller to write into the caches, or with
    write the output only: the kernel wrote them. Only where the two caches alias neither each other nor another
    input of a compiled graph: torch.compile hands a custom op that mutates aliased inputs copies of them (here the
    whole cache, for every write), where it updates an index_put's target in place."""
    args = (qkv.contiguous(), q_norm_w, k_norm_w, cos.contiguous(), sin.contiguous(), k_cache, v_cache, write_pos,
            mask.contiguous(), num_heads, eps)
    return torch.ops.q3tts.decode_attention_write(*args) if write else torch.ops.q3tts.decode_attention(*args)


# ---------------------------------------------------------------------------------------------- sampling noise
if triton is not None:

    @triton.jit
    def _hash31(x):  # q3tts.sampling._hash31 on int64 values < 2**31
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0x7FFFFFFF
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0x7FFFFFFF
        return (x >> 16) ^ x

    @triton.jit
    def _frame_noise(seed_ptr, step_ptr, out_ptr, B, V, first_stream, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # stream-major rows: stream row // B, batch row row % B
        b = row % B
        seed = tl.load(seed_ptr + b)
        step = tl.load(step_ptr + b)
        key = _hash31(_hash31(_hash31(seed & 0x7FFFFFFF) ^ (step & 0x7FFFFFFF)) ^ (first_stream + row // B))
        for v0 in range(0, V, BLOCK):
            idx = v0 + tl.arange(0, BLOCK)
            h = _hash31(_hash31(key ^ idx.to(tl.int64)) ^ 0x2545F49)
            tl.store(out_ptr + row * V + idx, (h.to(tl.float32) + 0.5) * (1.0 / (1 << 31)), mask=idx < V)


def frame_noise_cuda(seed: torch.Tensor, step: torch.Tensor, vocab: int, first_stream: int,
                     num_streams: int) -> torch.Tensor:
    """q3tts.sampling.frame_noise in one launch (the same values bit for bit: the same integer hash, the same
    int -> fp32 rounding); the torch version is ~60 tiny kernels, a few % of a one-stream frame."""
    B = seed.shape[0]
    out = torch.empty((num_streams, B, vocab), device=seed.device, dtype=torch.float32)
    _frame_noise[(num_streams * B,)](seed, step.contiguous(), out, B, vocab, first_stream, BLOCK=1024, num_warps=4)
    return out


# ------------------------------------------------------------------------------------------- top-k sampling
# q3tts.sampling.sample_topk in two launches instead of Inductor's ~7 (the ranking, scatters, gathers, two softmaxes,
# cumsum, argmax: ~17 us of a code-predictor step's ~160 on an H100, 15 steps per frame): each token's rank among
# its row (how many go before it: larger, or equal at a lower index, a stable descending sort's order) counted over
# the row by programs of TOP_RANK_ROWS tokens, the top TOPK_CAP written to their rank's slot; then one program per
# row warps and draws from those.
TOP_RANK_ROWS = 16  # tokens per ranking program: 128 programs for 2048 logits, each 16 x 2048 comparisons
TOP_RANK_COLS = 512
# V^2 comparisons per row: cheaper than torch.topk and the warps' ~7 kernels for a decode step's few rows, dearer for
# many (H100, 0.6B, frame graphs: batch 16 5.36-5.38 ms with it, 5.74 in an earlier session without; batch 64 7.36
# with it, 6.70 without)
TOP_KERNEL_MAX_ROWS = 16

if triton is not None:

    @triton.jit
    def _top_rank(x_ptr, noise_ptr, vals_ptr, idx_ptr, nsel_ptr, V, CAP: tl.constexpr, BI: tl.constexpr,
                  BJ: tl.constexpr, PDL: tl.constexpr):
        b = tl.program_id(0)
        i = tl.program_id(1) * BI + tl.arange(0, BI)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = x_ptr + b * V
        xi = tl.load(row + i).to(tl.float32)
        nz = tl.load(noise_ptr + b * V + i)
        count = tl.zeros((BI, BJ), tl.int32)  # summed across the row once, after the loop
        for j0 in range(0, V, BJ):
            j = j0 + tl.arange(0, BJ)
            xj = tl.load(row + j).to(tl.float32)
            count += ((xj[None, :] > xi[:, None]) | ((xj[None, :] == xi[:, None]) & (j[None, :] < i[:, None]))).to(
                tl.int32)
        rank = tl.sum(count, axis=1)
        keep = rank < CAP  # ranks are distinct: each of the CAP slots is written once
        tl.store(vals_ptr + b * CAP + rank, xi, mask=keep)
        tl.store(idx_ptr + b * CAP + rank, i.to(tl.int64), mask=keep)
        tl.store(nsel_ptr + b * CAP + rank, nz, mask=keep)  # the token's noise, for the draw

    @triton.jit
    def _top_draw(vals_ptr, idx_ptr, nsel_ptr, ds_ptr, t_ptr, k_ptr, p_ptr, out_ptr, emb_ptr, embo_ptr, D,
                  CAP: tl.constexpr, EMB: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        # sample_topk's warps on the CAP best values (descending): temperature, top-k, top-p (drop the tokens whose
        # tail mass, this one's and every less likely one's, is <= 1 - top_p; never the first), then the
        # exponential race with each token's own noise; greedy rows take the first
        b = tl.program_id(0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        r = tl.arange(0, CAP)
        idx = tl.load(idx_ptr + b * CAP + r)
        x = tl.load(vals_ptr + b * CAP + r) / tl.load(t_ptr + b)
        x = tl.where(r >= tl.load(k_ptr + b), float("-inf"), x)
        e = tl.exp(x - tl.max(x, axis=0))
        tail = tl.cumsum(e / tl.sum(e, axis=0), axis=0, reverse=True)
        x = tl.where((tail <= 1 - tl.load(p_ptr + b)) & (r > 0), float("-inf"), x)
        e = tl.exp(x - tl.max(x, axis=0))
        score = (e / tl.sum(e, axis=0)) / -tl.log(tl.load(nsel_ptr + b * CAP + r))
        choice = tl.argmax(score, axis=0)
        sampled = tl.sum(tl.where(r == choice, idx, 0), axis=0)
        greedy = tl.sum(tl.where(r == 0, idx, 0), axis=0)
        token = tl.where(tl.load(ds_ptr + b) != 0, sampled, greedy)
        tl.store(out_ptr + b, token)
        if EMB:  # the token's row of the embedding table [*, D]: the next step's input
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + tl.arange(0, BLOCK_D)
                tl.store(embo_ptr + b * D + dd, tl.load(emb_ptr + token * D + dd, mask=dd < D), mask=dd < D)

    @torch.library.custom_op("q3tts::sample_top", mutates_args=())
    def sample_top_op(logits: torch.Tensor, do_sample: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, noise: torch.Tensor, cap: int,
                      emb: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """See sample_top."""
        B, V = logits.shape
        vals, nsel = torch.empty((2, B, cap), device=logits.device, dtype=torch.float32)
        idx = torch.empty((B, cap), device=logits.device, dtype=torch.int64)
        out = torch.empty((B,), device=logits.device, dtype=torch.int64)
        D = 0 if emb is None else emb.shape[1]
        rows = logits.new_empty((B, D), dtype=logits.dtype if emb is None else emb.dtype)
        _top_rank[(B, V // TOP_RANK_ROWS)](logits, noise, vals, idx, nsel, V, CAP=cap, BI=TOP_RANK_ROWS,
                                           BJ=TOP_RANK_COLS, PDL=pdl(), num_warps=4, launch_pdl=pdl())
        _top_draw[(B,)](vals, idx, nsel, do_sample.view(torch.uint8), temperature, top_k, top_p, out,
                        rows if emb is None else emb, rows, D, CAP=cap, EMB=emb is not None, BLOCK_D=1024, PDL=pdl(),
                        num_warps=1, launch_pdl=pdl())
        return out, rows

    @sample_top_op.register_fake
    def _(logits, do_sample, temperature, top_k, top_p, noise, cap, emb):
        B = logits.shape[0]
        return (logits.new_empty((B,), dtype=torch.int64),
                logits.new_empty((B, 0)) if emb is None else emb.new_empty((B, emb.shape[1])))


def sample_top_applies(logits: torch.Tensor, cap: int) -> bool:
    """Whether sample_top serves these logits [B, V] (CUDA, fp32 / bf16 / fp16, B <= TOP_KERNEL_MAX_ROWS, or any B in
    batch-invariant mode: one path for every batch) with this cap (a power of two)."""
    B, V = logits.shape
    return (ENABLED and logits.is_cuda and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (B <= TOP_KERNEL_MAX_ROWS or invariant.ENABLED) and V % TOP_RANK_ROWS == 0 and V % TOP_RANK_COLS == 0
            and cap & (cap - 1) == 0 and cap <= V)


def sample_top(logits, do_sample, temperature, top_k, top_p, noise, cap: int,
               emb: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q3tts.sampling.sample_topk on CUDA: logits [B, V] (fp32 / bf16 / fp16, computed on in fp32); do_sample [B]
    bool; temperature, top_p [B] fp32; top_k [B] int64 (1..cap); noise [B, V] fp32 -> tokens [B] int64, and with an
    embedding table emb [*, D] also the tokens' rows [B, D]. The same ranking (ties in index order) and the same warps
    in fp32, summed in another order: a sampled token can differ only where two race scores, or a tail mass and
    1 - top_p, are within float rounding of each other. Only where sample_top_applies."""
    tokens, rows = torch.ops.q3tts.sample_top(
        logits.contiguous(), do_sample.contiguous(), temperature.float().contiguous(), top_k.long().contiguous(),
        top_p.float().contiguous(), noise.contiguous(), cap, None if emb is None else emb.contiguous())
    return tokens if emb is None else (tokens, rows)


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

