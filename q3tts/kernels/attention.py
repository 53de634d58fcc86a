"""Decode attention: one query token per row over a short span in one kernel (the code predictor's steps)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear everywhere
    triton = None

from .common import ENABLED, pdl

if triton is not None:
    from .common import _bf

# ---------------------------------------------------------------------------------------------- decode attention
# One query token per row over a short span (a code-predictor step: 16 positions): q/k
# norms, RoPE, scores, softmax and the weighted values in one kernel per (row, KV head), instead of Inductor's
# norm/RoPE kernels, two cuBLAS batched GEMMs and the softmax. It rounds where the eager module rounds (each bf16
# op's result, the scores before and after the scale, the probabilities), so it gives the eager layer's values up
# to fp32 summation order (which can move a result by one bf16 step).
ATTN_FUSED_MAX_SPAN = 64  # one block of positions per program (a long span looped in one program per KV head is
# slower than the batched GEMMs, which spread over many SMs)

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
