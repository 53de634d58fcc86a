"""Batch-invariant decoding on CUDA: a request's codes and audio do not depend on which requests share its steps.

Where a row's bits can depend on the batch in the default engine, and what this mode runs instead:
- GEMMs: cuBLAS (more than kernels.MAX_ROWS rows) picks its algorithm, and with it the order of the K reduction, by
  the number of rows; the skinny kernels differ between one row and several. Here: `matmul`, one Triton kernel of
  fixed tiles (BLOCK_M rows, BLOCK_N outputs, K in BLOCK_K steps) for every number of rows, so a row's dot products
  are summed in one order whatever the rows beside it (one row still pays for a tile of BLOCK_M).
- RMSNorm: Inductor compiles the norms apart for one row and for a dynamic number of rows, and may reduce a row in a
  different order in each. Here: `rms_norm`, one program per row.
- Attention of a decode step (one or two query tokens per row): cuBLAS's batched GEMMs pick a split by the batch, and
  the attended span (a power of two from the longest row) grows with the other rows. Here: `attention`, one program per
  (row, KV head, 256 positions), the chunks merged in position order; positions past a row's own are masked to exact
  no-ops, so the span does not matter either.
- The sum of a frame's 16 codec embeddings: `embed_sum`, each row summed in codebook order.
- The one-stream fast paths (kernels.gemv_ex, the code predictor's step compiled whole) compute the same values in
  another order: off in this mode. Sampling is per row already (counter-based noise); kernels.sample_top serves every
  batch size in this mode, and a row whose top-k fits keeps it in a batch that runs the full sampler for another row
  (engine.runner's _draw); each request's prefill runs alone (engine.runner); the vocoder decodes each request's
  pieces in calls of one row (engine.vocoder) and the offline decoder one request at a time (api.TTS.decode).

Process-wide (kernels and the models read it; this module imports none of q3tts): `set_enabled`
(Engine(batch_invariant=...)), default on where $Q3TTS_BATCH_INVARIANT=1.
Applies on CUDA to bf16/fp16 unquantized weights of the shapes the models have; elsewhere the engine runs as always.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: none of this module's kernels
    triton = None

ENABLED = os.environ.get("Q3TTS_BATCH_INVARIANT", "0") == "1"
# matmul's tile, fixed for every number of rows: of those `python -m bench.invariance --probe-gemm` timed, the best
# compromise between one row and 64 (BENCHMARKS.md)
BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 256
ATTN_CHUNK = 256  # attention: positions per program (4 blocks of 64)


def set_enabled(on: bool) -> None:
    """Turn batch-invariant decoding on or off for this process (before an engine is built: the compiled layers and
    captured graphs follow the setting at their build)."""
    global ENABLED
    ENABLED = bool(on)


def enabled() -> bool:
    return ENABLED


def active(x: torch.Tensor) -> bool:
    """Whether this mode's kernels serve a tensor: the mode on, Triton there, x on CUDA in bf16 / fp16."""
    return ENABLED and triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _mm(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # y [M, N] = x [M, K] @ w[N, K].T: tiles of BM rows, fp32 accumulation over K in BK steps, one order for all M
        rm = tl.program_id(1) * BM + tl.arange(0, BM)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptr + rn[:, None] * K + (k0 + rk)[None, :])
            acc += tl.dot(x, tl.trans(w))
        tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=rm[:, None] < M)

    @torch.library.custom_op("q3tts::bi_matmul", mutates_args=())
    def _matmul_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        M, K = x.shape
        N = w.shape[0]
        y = torch.empty((M, N), device=x.device, dtype=x.dtype)
        if M:
            _mm[(N // BLOCK_N, triton.cdiv(M, BLOCK_M))](x, w, y, M, N, K, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                                                         num_warps=4, num_stages=3)
        return y

    @_matmul_op.register_fake
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @triton.jit(do_not_specialize=["R"])
    def _rms(x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, R, D, eps, ADD: tl.constexpr, BD: tl.constexpr):
        # one row per program: y = w * bf16(x * rsqrt(mean(x^2) + eps)), statistics in fp32 (as models.layers.RMSNorm).
        # ADD (kernels.prefill.add_rms_norm): x is first the residual sum x + delta rounded to the dtype (as the eager
        # add stores it), stored at s_ptr; the norm of that stored sum is then this kernel's without ADD, bit for bit
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BD)
        x = tl.load(x_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)
        if ADD:
            sx = (x + tl.load(d_ptr + row * D + d, mask=d < D, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + row * D + d, sx, mask=d < D)
            x = sx.to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
        xn = (x * r).to(y_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * D + d, (w * xn).to(y_ptr.dtype.element_ty), mask=d < D)

    @torch.library.custom_op("q3tts::bi_rms_norm", mutates_args=())
    def _rms_op(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        R, D = x.shape
        y = torch.empty_like(x)
        if R:
            _rms[(R,)](x, x, w, y, y, R, D, eps, ADD=False, BD=triton.next_power_of_2(D), num_warps=4)
        return y

    @_rms_op.register_fake
    def _(x, w, eps):
        return torch.empty_like(x)

    @triton.jit
    def _attn_chunk(q_ptr, k_ptr, v_ptr, m_ptr, mo_ptr, lo_ptr, ao_ptr, n, scale, skb, skh, skl, svb, svh, svl,
                    smb, sms, NC, H: tl.constexpr, G: tl.constexpr, S: tl.constexpr, QP: tl.constexpr,
                    DH: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        # program (row b, KV head hk, chunk c): the G*S query rows of hk (rows r = g*S + s, padded to QP) over
        # positions [c*CHUNK, (c+1)*CHUNK) ∩ [0, n), online softmax in fp32 -> running max, sum and the unnormalized
        # output. Scores rounded to bf16 before and after the scale, probabilities to bf16, as models.layers._attend.
        b = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1)
        c = tl.program_id(2)
        r = tl.arange(0, QP)
        g, s = r // S, r % S
        rv = r < G * S
        d = tl.arange(0, DH)
        qrow = ((b * H + hk * G + g) * S + s) * DH
        q = tl.load(q_ptr + qrow[:, None] + d[None, :], mask=rv[:, None], other=0.0)
        m = tl.full((QP,), float("-inf"), tl.float32)
        lsum = tl.zeros((QP,), tl.float32)
        acc = tl.zeros((QP, DH), tl.float32)
        for p0 in range(0, CHUNK, BLOCK):
            pos = c * CHUNK + p0 + tl.arange(0, BLOCK)
            inside = pos < n
            kb = tl.load(k_ptr + b * skb + hk * skh + pos[:, None] * skl + d[None, :], mask=inside[:, None], other=0.0)
            vb = tl.load(v_ptr + b * svb + hk * svh + pos[:, None] * svl + d[None, :], mask=inside[:, None], other=0.0)
            ok = tl.load(m_ptr + b * smb + s[:, None] * sms + pos[None, :], mask=rv[:, None] & inside[None, :],
                         other=0) != 0
            sc = tl.dot(q, tl.trans(kb)).to(tl.bfloat16).to(tl.float32)
            sc = tl.where(ok, (sc * scale).to(tl.bfloat16).to(tl.float32), float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            # NOTE(invariant): a block with nothing to attend for a row leaves its state bit for bit as it was
            # (alpha 1, p 0), so a longer span (the batch's) gives what the row's own span gives
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
            p = tl.where(ok, tl.exp(sc - m_new[:, None]), 0.0)
            lsum = lsum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m = m_new
        part = (b * tl.num_programs(1) + hk) * NC + c
        tl.store(mo_ptr + part * QP + r, m)
        tl.store(lo_ptr + part * QP + r, lsum)
        tl.store(ao_ptr + (part * QP + r)[:, None] * DH + d[None, :], acc)

    @triton.jit
    def _attn_merge(mo_ptr, lo_ptr, ao_ptr, out_ptr, NC, H: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                    QP: tl.constexpr, DH: tl.constexpr):
        # program (row b, KV head hk): the chunks merged in position order (an all-masked chunk adds exact zeros)
        b = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1)
        r = tl.arange(0, QP)
        d = tl.arange(0, DH)
        base = (b * tl.num_programs(1) + hk) * NC
        mx = tl.full((QP,), float("-inf"), tl.float32)
        for c in range(0, NC):
            mx = tl.maximum(mx, tl.load(mo_ptr + (base + c) * QP + r))
        lsum = tl.zeros((QP,), tl.float32)
        acc = tl.zeros((QP, DH), tl.float32)
        for c in range(0, NC):
            mc = tl.load(mo_ptr + (base + c) * QP + r)
            wc = tl.where(mc == float("-inf"), 0.0, tl.exp(mc - mx))
            lsum += tl.load(lo_ptr + (base + c) * QP + r) * wc
            acc += tl.load(ao_ptr + ((base + c) * QP + r)[:, None] * DH + d[None, :]) * wc[:, None]
        g, s = r // S, r % S
        qrow = ((b * H + hk * G + g) * S + s) * DH
        out = acc / tl.where(lsum == 0.0, 1.0, lsum)[:, None]
        tl.store(out_ptr + qrow[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=(r < G * S)[:, None])

    @torch.library.custom_op("q3tts::bi_attention", mutates_args=())
    def _attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, H, S, Dh = q.shape
        Hkv, n = keys.shape[1], mask.shape[-1]
        G = H // Hkv
        QP = max(16, triton.next_power_of_2(G * S))
        NC = triton.cdiv(n, ATTN_CHUNK)
        out = torch.empty_like(q)
        m = torch.empty((B, Hkv, NC, QP), device=q.device, dtype=torch.float32)
        lsum = torch.empty_like(m)
        acc = torch.empty((B, Hkv, NC, QP, Dh), device=q.device, dtype=torch.float32)
        mk = mask.view(torch.uint8)
        _attn_chunk[(B, Hkv, NC)](q, keys, values, mk, m, lsum, acc, n, Dh ** -0.5, *keys.stride()[:3],
                                  *values.stride()[:3], mk.stride(0) if mk.shape[0] > 1 else 0, mk.stride(2), NC,
                                  H=H, G=G, S=S, QP=QP, DH=Dh, BLOCK=64, CHUNK=ATTN_CHUNK, num_warps=4)
        _attn_merge[(B, Hkv)](m, lsum, acc, out, NC, H=H, G=G, S=S, QP=QP, DH=Dh, num_warps=4)
        return out

    @_attention_op.register_fake
    def _(q, keys, values, mask):
        return torch.empty_like(q)

    @triton.jit
    def _embed_sum(codes_ptr, off_ptr, table_ptr, y_ptr, D, K: tl.constexpr, BD: tl.constexpr):
        # row b: sum over k in order of table[codes[b, k] + off[k]] in fp32, rounded once
        b = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        acc = tl.zeros((BD,), tl.float32)
        for k in range(K):
            idx = tl.load(codes_ptr + b * K + k) + tl.load(off_ptr + k)
            acc += tl.load(table_ptr + idx * D + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(y_ptr + b * D + d, acc.to(y_ptr.dtype.element_ty), mask=d < D)

    @torch.library.custom_op("q3tts::bi_embed_sum", mutates_args=())
    def _embed_sum_op(codes: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        R, K = codes.shape
        D = table.shape[1]
        y = torch.empty((R, D), device=table.device, dtype=table.dtype)
        if R:
            _embed_sum[(R, triton.cdiv(D, 512))](codes, offsets, table, y, D, K=K, BD=512, num_warps=4)
        return y

    @_embed_sum_op.register_fake
    def _(codes, offsets, table):
        return table.new_empty((codes.shape[0], table.shape[1]))


def matmul_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `matmul` serves x [..., K] @ w [N, K].T (the mode on, CUDA, matching dtypes, N % 32, K % 256)."""
    return (active(x) and isinstance(w, torch.Tensor) and w.dtype == x.dtype and w.is_contiguous() and w.dim() == 2
            and w.shape[0] % BLOCK_N == 0 and w.shape[1] % BLOCK_K == 0)


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K].T (+ bias, added after the rounding) -> [..., N]; each row's sums in one order whatever
    the number of rows. Only where matmul_applies."""
    y = torch.ops.q3tts.bi_matmul(x.reshape(-1, x.shape[-1]).contiguous(), w).view(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """models.layers.RMSNorm of x [..., D] one row per program. Only where active(x) and weight is x's dtype."""
    return torch.ops.q3tts.bi_rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)


def attention_applies(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether `attention` serves q [B, H, S, Dh] over keys [B, Hkv, n, Dh]: a decode step's few query tokens per
    row (G * S <= 16), Dh a power of two, the mask [B | 1, 1, S, n] bool."""
    B, H, S, Dh = q.shape
    return (active(q) and q.dtype == torch.bfloat16 and keys.dtype == q.dtype and (H // keys.shape[1]) * S <= 16
            and Dh & (Dh - 1) == 0 and keys.stride(-1) == 1 and mask.dtype == torch.bool and mask.shape[-2] == S)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, S, Dh] (normed, rotated) over keys / values [B, Hkv, n, Dh] (any strides, last dim contiguous) under
    mask [B | 1, 1, S, n] -> [B, H, S, Dh]. Only where attention_applies."""
    return torch.ops.q3tts.bi_attention(q.contiguous(), keys, values, mask.contiguous())


def embed_sum(codes: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """codes [..., K] -> [..., D]: the sum of table[codes[..., k] + offsets[k]] over k in order (fp32, one rounding).
    Only where active(table)."""
    K = codes.shape[-1]
    y = torch.ops.q3tts.bi_embed_sum(codes.reshape(-1, K).contiguous(), offsets, table)
    return y.view(*codes.shape[:-1], table.shape[1])
