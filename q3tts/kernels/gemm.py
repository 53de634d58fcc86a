"""Skinny GEMMs (y = x @ w.T for a handful of rows), the weight-only quantized GEMM, and the one-row layer GEMVs
(gemv_ex) that carry a decoder layer's norms, gate and residual adds: the models' linears."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear everywhere
    triton = None

from .. import invariant
from .common import ENABLED, MAX_ROWS, pdl

if triton is not None:
    from .common import _bf

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

    @torch.library.custom_op("q3tts::rows_linear", mutates_args=())
    def rows_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x: [M, K]; w: [N, K] contiguous (skinny_linear's sizes) -> x @ w.T [M, N]: skinny_linear up to MAX_ROWS
        rows, F.linear (cuBLAS) beyond. The choice is made here, when the op runs, not where it is called: a
        compiled caller (the decoder layer, dynamic in batch and length) then holds no guard on its row count, and
        one compilation serves both sides of MAX_ROWS (BENCHMARKS.md: start-up)."""
        if x.shape[0] <= MAX_ROWS:
            return skinny_linear(x.contiguous(), w)
        return F.linear(x, w)

    @rows_linear.register_fake
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
            and w.shape[0] % 32 == 0 and w.shape[1] % 512 == 0 and w.is_contiguous()):
        y = torch.ops.q3tts.rows_linear(x.reshape(-1, x.shape[-1]), w)  # skinny kernels up to MAX_ROWS rows
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
# max_block_k columns: the fastest of `python -m bench.probe --sections kernels --gemv ...` (the frame's graphs under
# each launch; BENCHMARKS.md)
GEMV_EX_LAUNCH = {"block_n": 4, "max_block_k": 4096, "num_warps": 4}

if triton is not None:

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
    return (ENABLED and not invariant.ENABLED and x.is_cuda and x.dtype == torch.bfloat16
            and x.numel() == x.shape[-1]
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
