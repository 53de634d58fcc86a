"""Skinny GEMMs for decoding: y = x @ w.T for a handful of rows (a decode step: rows = batch <= 16).

Why: one decode frame runs 103 decoder layers at one row each, and cuBLAS picks poor kernels for such
shapes. Measured on an H200 in a CUDA graph, one row, bf16, weights read from HBM as in a frame
(bench/probe_gemv.py --cold): o_proj 2048->1024 12.8 us with cuBLAS vs 3.5 us here, down 3072->1024
7.4 vs 4.4, gate_up 1024->6144 6.1 vs 5.0, qkv 1024->4096 5.3 vs 4.0, lm_head 1024->2048 4.7 vs 3.0. The kernels stream the weight once with fp32 accumulation; the result can
differ from cuBLAS's in the last bf16 bit (different summation order), as cuBLAS's own kernels differ
between batch sizes.

`linear` dispatches: these kernels on CUDA in bf16/fp16 for <= MAX_ROWS rows and divisible sizes;
F.linear everywhere else (CPU, fp32, prefill, big batches). Q3TTS_SKINNY_GEMM=0 turns them off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear everywhere
    triton = None

MAX_ROWS = 16
_ENABLED = triton is not None and os.environ.get("Q3TTS_SKINNY_GEMM", "1") != "0"

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
    if (_ENABLED and bias is None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
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
