"""Sampling: a frame's noise in one launch (frame_noise_cuda) and top-k sampling in two (sample_top), for
q3tts.sampling."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear everywhere
    triton = None

from .. import invariant
from .common import ENABLED, pdl, unspecialized

# ---------------------------------------------------------------------------------------------- sampling noise
if triton is not None:

    @triton.jit
    def _hash31(x):  # q3tts.sampling._hash31 on int64 values < 2**31
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0x7FFFFFFF
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0x7FFFFFFF
        return (x >> 16) ^ x

    # a wave prefilled in one batch draws its code 0's noise eagerly on the seed and step of rows [lo, lo + N)
    # (runner._sample_code0): one variant for every row offset and N, compiled by the warm-up (seed and step are read
    # one value a program)
    @triton.jit(**unspecialized("seed_ptr", "step_ptr", "B", "first_stream"))
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
# cumsum, argmax), 15 steps per frame: each token's rank among
# its row (how many go before it: larger, or equal at a lower index, a stable descending sort's order) counted over
# the row by programs of TOP_RANK_ROWS tokens, the top TOPK_CAP written to their rank's slot; then one program per
# row warps and draws from those.
TOP_RANK_ROWS = 16  # tokens per ranking program: 128 programs for 2048 logits, each 16 x 2048 comparisons
TOP_RANK_COLS = 512
# V^2 comparisons per row: cheaper than torch.topk and the warps' ~7 kernels for a decode step's few rows, dearer for
# many (BENCHMARKS.md)
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
