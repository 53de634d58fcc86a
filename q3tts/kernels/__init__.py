"""The engine's Triton kernels for decoding: skinny GEMMs (y = x @ w.T for a handful of rows: a decode step, rows =
batch <= 16); for one stream, a decoder layer pass in a few launches (gemv_ex: GEMVs that carry the RMSNorms, the
SiLU gate and the residual adds; decode_attention: one token's attention from q|k|v to the output); the sampling
noise of a frame in one launch (frame_noise_cuda) and top-k sampling in two (sample_top).

Why: one decode frame runs 103 decoder layers at one row each, and cuBLAS picks poor kernels for such shapes
(BENCHMARKS.md: the skinny GEMMs against cuBLAS). The kernels stream the weight once with fp32 accumulation; the result
can differ from cuBLAS's in the last bf16 bit (different summation order), as cuBLAS's own kernels differ
between batch sizes.

`linear` dispatches: these kernels on CUDA in bf16/fp16 for <= MAX_ROWS rows and divisible sizes;
F.linear everywhere else (CPU, fp32, prefill, big batches). On CUDA the row count is read inside one op
(rows_linear), so a compiled caller is one graph on both sides of MAX_ROWS. Q3TTS_SKINNY_GEMM=0 turns every kernel
here off.

The kernels live by consumer: gemm (linears, one-row layer GEMVs), attention (decode attention), sampling (noise,
top-k), vocoder (SnakeBeta joins, causal convolutions), prefill (the forced aligner's padded pass: Q/K norm + RoPE,
SiLU * up, residual add + norm); common holds what they share.
"""

from .attention import ATTN_FUSED_MAX_SPAN, decode_attention, decode_attention_applies
from .common import ENABLED, MAX_ROWS, pdl, triton
from .gemm import GEMV_EX_LAUNCH, gemv_ex, gemv_ex_applies, linear, quant_linear
from .prefill import add_layer_norm, add_rms_norm, prefill_glue_applies, qk_norm_rope, silu_mul
from .sampling import (
                       TOP_KERNEL_MAX_ROWS,
                       TOP_RANK_COLS,
                       TOP_RANK_ROWS,
                       frame_noise_cuda,
                       sample_top,
                       sample_top_applies,
)
from .vocoder import causal_conv, causal_conv_applies, snake_beta, snake_join

__all__ = ["ATTN_FUSED_MAX_SPAN", "ENABLED", "GEMV_EX_LAUNCH", "MAX_ROWS", "TOP_KERNEL_MAX_ROWS", "TOP_RANK_COLS",
           "TOP_RANK_ROWS", "add_layer_norm", "add_rms_norm", "causal_conv", "causal_conv_applies",
           "decode_attention", "decode_attention_applies", "frame_noise_cuda", "gemv_ex", "gemv_ex_applies", "linear",
           "pdl", "prefill_glue_applies", "qk_norm_rope", "quant_linear", "sample_top", "sample_top_applies",
           "silu_mul", "snake_beta", "snake_join", "triton"]
