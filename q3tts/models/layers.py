"""Qwen3 decoder building blocks shared by the talker and the code predictor.

Pure modules: the engine owns the KV caches and hands each layer a view of them. Every attention call
writes its new keys/values at `write_pos` (per row) and attends over the whole static cache under a
boolean mask, so shapes never depend on how far a request has got (CUDA-graph friendly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import invariant
from ..config import DecoderLayerConfig
from ..kernels import decode_attention, decode_attention_applies, gemv_ex, gemv_ex_applies, linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as upstream; the weight multiplies in the input dtype
        if invariant.active(x) and self.weight.dtype == x.dtype:  # one program per row (see q3tts.invariant)
            return invariant.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # same expression as HF's default RoPE init, so fp32 values match bit for bit
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [B, S] int -> cos, sin: [B, S, head_dim] (halves duplicated, rotate_half convention).

    The talker's config asks for interleaved multimodal RoPE (mrope_section, 3 position streams). For
    text and codec tokens the three streams carry the same position, which makes it plain RoPE;
    tests/models/test_layers.py proves that equivalence against a transcription of upstream's function.
    """
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [B, S, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, Dh]; cos/sin: [B, S, Dh]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderLayerConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv_weight: torch.Tensor | None = None  # [q|k|v] fused by fuse_projections() for one GEMM

    def forward(self, x, cos, sin, k_cache, v_cache, ctx: "AttnContext", norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None):
        """x: [B, S, D] (norm given: x is normed by it in the projection's kernel and residual is added to the output,
        one row only, see DecoderLayer); k_cache/v_cache: [B, Hkv, Lmax, Dh] views of this batch's cache rows, written
        in place at ctx.write_pos; attention reads their first n = ctx.mask.shape[-1] positions (no copy). Paged
        (ctx.block_table set): k_cache/v_cache are the block pools [num_blocks, Hkv, bs, Dh]; a row's position p
        lives in block block_table[row, p // bs] at offset p % bs, and its first n positions are gathered."""
        B, S, _ = x.shape
        H, Hkv, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        n = ctx.mask.shape[-1]
        if norm is not None:
            qkv = gemv_ex(x, self.qkv_weight, norm=norm)
        elif self.qkv_weight is not None:
            qkv = linear(x, self.qkv_weight)
        if ctx.fused_attention and self.qkv_weight is not None and decode_attention_applies(x, k_cache, n):
            # one token per row on a GPU, a short span: one kernel from q|k|v to the attention output
            args = (qkv, self.q_norm.weight, self.k_norm.weight, cos, sin, k_cache, v_cache, ctx.write_pos, ctx.mask,
                    H, self.q_norm.eps)
            if ctx.write_kv_in_attention:
                out = decode_attention(*args, write=True)
            else:
                out, kv_new = decode_attention(*args)  # kv_new [B, 1, 2, Hkv, Dh]
                _write_kv(k_cache, v_cache, ctx.write_pos, kv_new[:, :, 0], kv_new[:, :, 1])
            return self._project_out(out, residual)
        if self.qkv_weight is not None:
            q, k, v = qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = apply_rope(self.q_norm(q.view(B, S, H, Dh)).transpose(1, 2), cos, sin)  # [B, H, S, Dh]
        k = apply_rope(self.k_norm(k.view(B, S, Hkv, Dh)).transpose(1, 2), cos, sin)  # [B, Hkv, S, Dh]
        if ctx.block_table is None:
            _write_kv(k_cache, v_cache, ctx.write_pos, k.transpose(1, 2), v.view(B, S, Hkv, Dh))
            keys, values = k_cache[:, :, :n], v_cache[:, :, :n]  # [B, Hkv, n, Dh] views
        else:
            keys, values = _paged_write_read(k_cache, v_cache, ctx, k.transpose(1, 2), v.view(B, S, Hkv, Dh), n)
        if invariant.attention_applies(q, keys, ctx.mask):  # a decode step, batch-invariant mode
            out = invariant.attention(q, keys, values, ctx.mask)  # [B, H, S, Dh]
            return self._project_out(out.transpose(1, 2).reshape(B, S, H * Dh), residual)
        # GQA without repeating K/V: the G query heads of a KV head become extra query rows
        G = H // Hkv
        qg = q.reshape(B, Hkv, G * S, Dh)
        mask = ctx.mask.expand(B, 1, S, n).repeat(1, 1, G, 1) if G > 1 else ctx.mask  # [B, 1, G*S, n]
        if B * H * S * n <= ATTN_SCORES_CHUNK:
            out = _attend(qg, keys, values, mask, Dh)
        else:  # a long prefill: one KV head at a time bounds the scores (same GEMMs per head: same values)
            out = torch.cat([_attend(qg[:, h:h + 1], keys[:, h:h + 1], values[:, h:h + 1], mask, Dh)
                             for h in range(Hkv)], dim=1)
        return self._project_out(out.view(B, H, S, Dh).transpose(1, 2).reshape(B, S, H * Dh), residual)

    def _project_out(self, out, residual):
        """o_proj of out [B, S, H * Dh]; residual given (one row, see DecoderLayer): added in the GEMV's kernel."""
        w = self.o_proj.weight
        return gemv_ex(out, w, residual=residual) if residual is not None else linear(out, w)


def _write_kv(k_cache, v_cache, write_pos, k, v) -> None:
    """k, v [B, S, Hkv, Dh] into the caches [B, Hkv, L, Dh] at write_pos [B, S].
    NOTE(in-place-kv): an index_put, not a scatter_: torch.compile updates the cache in place only for the former (for
    a scatter_ into an input it wrote a whole new cache and copied it back: 4 passes over [B, Hkv, Lmax, Dh] per
    layer, most of a large batch's talker step)."""
    rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1] with write_pos [B, S]: indexes [B, S, Hkv, Dh]
    k_cache[rows, :, write_pos] = k.to(k_cache.dtype)
    v_cache[rows, :, write_pos] = v.to(v_cache.dtype)


# Attention scores above this many elements (fp32 softmax: ~8 bytes each while live) are computed one KV head at
# a time: a prefill of 4 x 2048 tokens over 4096 positions would otherwise hold 4 GB of scores at once.
ATTN_SCORES_CHUNK = 1 << 26


def _paged_write_read(k_pool, v_pool, ctx: "AttnContext", k, v, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged cache: write k/v [B, S, Hkv, Dh] at ctx.write_pos through the block table, then gather each row's
    first n positions -> keys, values [B, Hkv, n, Dh] (copies holding the very values a contiguous cache holds)."""
    bs = k_pool.shape[2]
    table = ctx.block_table  # [B, n // bs] int64 block ids (0: the scratch block)
    blk, off = table.gather(1, ctx.write_pos // bs), ctx.write_pos % bs  # [B, S]
    k_pool[blk, :, off] = k.to(k_pool.dtype)  # advanced indices first: [B, S, Hkv, Dh]
    v_pool[blk, :, off] = v.to(v_pool.dtype)
    B, nb = table.shape
    Hkv, Dh = k_pool.shape[1], k_pool.shape[3]
    keys = k_pool[table].transpose(1, 2).reshape(B, Hkv, nb * bs, Dh)  # [B, nb, Hkv, bs, Dh] -> [B, Hkv, n, Dh]
    values = v_pool[table].transpose(1, 2).reshape(B, Hkv, nb * bs, Dh)
    return keys[:, :, :n], values[:, :, :n]


def _attend(qg, keys, values, mask, Dh: int) -> torch.Tensor:
    """qg [B, h, G*S, Dh] over keys / values [B, h, n, Dh] under mask [B|1, 1, G*S, n] -> [B, h, G*S, Dh]."""
    scores = torch.matmul(qg, keys.transpose(2, 3)) * (Dh ** -0.5)  # [B, h, G*S, n]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(qg.dtype)  # as upstream's eager attention
    return torch.matmul(probs, values)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # [gate|up] fused by fuse_projections()

    def forward(self, x, norm: RMSNorm | None = None, residual: torch.Tensor | None = None):
        """norm given: x is normed by it in the gate/up kernel and residual is added to the output (one row only)."""
        if norm is not None:
            return gemv_ex(gemv_ex(x, self.gate_up_weight, norm=norm, glu=True), self.down_proj.weight,
                           residual=residual)
        if self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return linear(F.silu(gate) * up, self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderLayerConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, ctx):
        a, m = self.self_attn, self.mlp
        if a.qkv_weight is not None and m.gate_up_weight is not None and gemv_ex_applies(
                x, a.qkv_weight, a.o_proj.weight, m.gate_up_weight, m.down_proj.weight):
            # one token of one row on a GPU: the norms and residual adds ride in the projections' kernels
            x = a(x, cos, sin, k_cache, v_cache, ctx, norm=self.input_layernorm, residual=x)
            return m(x, norm=self.post_attention_layernorm, residual=x)
        x = x + a(self.input_layernorm(x), cos, sin, k_cache, v_cache, ctx)
        return x + m(self.post_attention_layernorm(x))


@dataclass(slots=True)
class AttnContext:
    """Where a forward call writes the engine's KV cache and what it may attend to."""

    write_pos: torch.Tensor  # [B, S] int64: cache positions of the new tokens (== their RoPE positions)
    mask: torch.Tensor  # [B, 1, S, n] bool over the first n cache positions: True where a query may attend
    block_table: torch.Tensor | None = None  # paged cache: [B, n // block_size] int64 block of each row's positions
    # one token per row over a short span through kernels.decode_attention. Only the code predictor's one-token steps
    # ask for it (16 positions; one more variant of the shared compiled layer for those of 2 rows and more): a span
    # test on every call split each of the talker's variants in two (more compilations at start-up)
    fused_attention: bool = False
    # with fused_attention: its kernel writes the new keys and values into the caches (no index_put kernels after
    # it). Only for caches that alias neither each other nor the other layers' (kernels.decode_attention says why):
    # the code predictor's, in its step compiled whole
    write_kv_in_attention: bool = False


def run_layers(layers: nn.ModuleList, norm: RMSNorm | None, x, cos, sin, kv, ctx: AttnContext):
    """kv: this batch's rows of the engine's cache, [num_layers, 2, B, Hkv, Lmax, Dh] (a view) or per layer a
    (k, v) pair of [B, Hkv, Lmax, Dh] views; or the paged pool [num_layers, 2, num_blocks, Hkv, block_size, Dh]
    with ctx.block_table. Returns the final-normed hidden (norm None: the last layer's output)."""
    for i, layer in enumerate(layers):
        x = layer(x, cos, sin, kv[i][0], kv[i][1], ctx)
    return x if norm is None else norm(x)


def fuse_projections(module: nn.Module) -> None:
    """Concatenate q/k/v and gate/up weights once after loading (on the final device and dtype): one GEMM
    instead of three / two. The per-name parameters stay (checkpoint names are unchanged) as views into the
    fused weight, so the weights are held once."""
    for m in module.modules():
        if isinstance(m, Attention):
            projs, name = (m.q_proj, m.k_proj, m.v_proj), "qkv_weight"
        elif isinstance(m, MLP):
            projs, name = (m.gate_proj, m.up_proj), "gate_up_weight"
        else:
            continue
        fused = torch.cat([p.weight.detach() for p in projs])
        for p, view in zip(projs, fused.split([p.weight.shape[0] for p in projs])):
            p.weight.data = view
        setattr(m, name, fused)
