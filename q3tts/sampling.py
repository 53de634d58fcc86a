"""Batched sampling that never syncs with the host (safe inside a CUDA graph).

Per-request parameters arrive as [B] tensors, so one call serves a batch of requests that each chose
their own temperature / top-k / top-p / penalty / seed. Semantics follow Hugging Face's logits
processors as the official package uses them (C3 in DESIGN.md):
  talker: repetition penalty over the request's own code-0 history -> EOS banned for the first
  `min_new_tokens` frames -> codes [vocab-1024, vocab) suppressed except EOS -> temperature -> top-k -> top-p.
Randomness is a counter-based hash of (seed, frame, codebook, token): a request's sample depends on
nothing else (not on the batch it shares, not on graph replay order), so streamed == offline and
batched == alone hold under sampling too, and greedy rows (do_sample False) take the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from . import kernels
from .config import GenerationDefaults

_MASK31 = (1 << 31) - 1


@dataclass(slots=True)
class SamplingParams(GenerationDefaults):
    """One request's generation parameters: generation_config.json's fields, overridable, plus a seed."""

    seed: int = 0

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _hash31(x: torch.Tensor) -> torch.Tensor:
    """An integer mixer on int64 tensors holding 31-bit values (no overflow: products < 2^58)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK31
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK31
    return (x >> 16) ^ x


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, stream: int, vocab: int) -> torch.Tensor:
    """seed, step: [B] int64 -> [B, vocab] float32 uniforms in (0, 1), a pure function of its inputs."""
    return frame_noise(seed, step, vocab, stream, 1)[0]


def frame_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int, first_stream: int,
                num_streams: int) -> torch.Tensor:
    """All the uniforms one frame needs at once: [num_streams, B, vocab] for streams first_stream.. (stream 0:
    code 0; 1..15: the code predictor's codebooks). One batched hash instead of one per sample keeps the
    frame short. Nothing here copies from the host (CUDA-graph capture forbids it). Stream-major, so each
    stream's [B, vocab] is contiguous: the compiled samplers compile each stride layout apart."""
    if seed.is_cuda and kernels.ENABLED and not torch.compiler.is_compiling():
        return kernels.frame_noise_cuda(seed, step, vocab, first_stream, num_streams)
    s = torch.arange(first_stream, first_stream + num_streams, device=seed.device, dtype=torch.int64)
    key = _hash31(_hash31(_hash31(seed & _MASK31) ^ (step & _MASK31))[None, :] ^ s[:, None])  # [n, B]
    idx = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    h = _hash31(_hash31(key[:, :, None] ^ idx) ^ 0x2545F49)
    return (h.float() + 0.5) * (1.0 / (1 << 31))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF semantics on every token present in the history: negative scores * p, positive scores / p.
    logits: [B, V] float; seen: [B, V] bool; penalty: [B]."""
    p = penalty[:, None].to(logits.dtype)
    penalized = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalized, logits)


def talker_logits_rules(logits, seen, penalty, num_generated, eos_id: int, suppress_from: int,
                        min_new_tokens: int = 2):
    """The talker's processors before warping. num_generated: [B] codes already sampled for the row."""
    logits = apply_repetition_penalty(logits.float(), seen, penalty)
    V = logits.shape[-1]
    idx = torch.arange(V, device=logits.device)
    suppress = (idx >= suppress_from) & (idx != eos_id)  # [V]
    ban_eos = (num_generated < min_new_tokens)[:, None] & (idx == eos_id)[None, :]
    return logits.masked_fill(suppress[None, :] | ban_eos, float("-inf"))


def sample(logits, do_sample, temperature, top_k, top_p, noise):
    """logits: [B, V] (already processed; computed on in float32); per-row do_sample [B] bool, temperature [B],
    top_k [B] int64 (0 = off), top_p [B]; noise: [B, V] uniforms. Returns tokens [B] int64."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    V = logits.shape[-1]
    x = logits / temperature[:, None]
    sorted_desc, _ = x.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    kth = sorted_desc.gather(-1, (k - 1)[:, None])  # [B, 1]
    x = x.masked_fill(x < kth, float("-inf"))  # HF TopK: ties at the k-th value survive
    # HF TopP: drop the lowest-probability tokens whose cumulative mass stays <= 1 - top_p (keep >= 1)
    sorted_asc, order = x.sort(dim=-1)
    cum = sorted_asc.softmax(-1).cumsum(-1)
    drop = cum <= (1 - top_p)[:, None]
    drop[:, -1] = False
    x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    probs = x.softmax(-1)
    sampled = (probs / -torch.log(noise)).argmax(-1)  # exponential race == multinomial draw
    return torch.where(do_sample, sampled, greedy)


TOPK_CAP = 64  # the capped sampler looks at the 64 best tokens only
RANK_MAX_ROWS = 4  # up to this many rows, top_values ranks by pairwise comparison instead of torch.topk


def top_values(x: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cap largest values of each row of x [B, V] and their indices, descending; equal values in index
    order (a stable sort's order, so the first is argmax's choice).

    On CUDA (sample_topk comes here only where kernels.sample_top does not serve: more than its rows, or the Triton
    kernels off), for a few rows, each token's rank (how many tokens go before it) is counted by comparing all pairs:
    V^2 comparisons in one fused reduction under torch.compile, cheaper than torch.topk's radix select for
    decode-sized batches (BENCHMARKS.md). Larger batches use
    torch.topk (ties among equal values may then come in another order)."""
    B, V = x.shape
    if not x.is_cuda:  # no ranking ([B, V, V]); cheaper than a full stable sort
        vals, idx = x.topk(cap, dim=-1)
        idx, by_index = idx.sort(dim=-1)  # the cap chosen, in index order, then stably by value: a stable sort's
        vals, order = vals.gather(-1, by_index).sort(dim=-1, descending=True, stable=True)  # order of them
        return vals, idx.gather(-1, order)
    if B > RANK_MAX_ROWS:
        return x.topk(cap, dim=-1)
    return _rank_top(x, cap)


def _rank_top(x: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, V = x.shape
    i = torch.arange(V, device=x.device)
    xi, xj = x[:, :, None], x[:, None, :]  # [B, V, 1], [B, 1, V]
    rank = ((xj > xi) | ((xj == xi) & (i[None, None, :] < i[None, :, None]))).sum(-1)  # [B, V] distinct per row
    slot = rank.clamp(max=cap)  # ranks >= cap all land in a spare column that is dropped
    idx = torch.zeros(B, cap + 1, dtype=torch.long, device=x.device).scatter_(1, slot, i.expand(B, V))[:, :cap]
    return x.gather(1, idx), idx


def sample_topk(logits, do_sample, temperature, top_k, top_p, noise, cap: int = TOPK_CAP, emb=None):
    """Same draw as `sample` when every row has 1 <= top_k <= cap (tokens outside the top-k have probability 0,
    and each token keeps its own noise), at the cost of one topk instead of two full-vocabulary sorts.
    Only difference: ties with the k-th value beyond the cap are dropped. The engine uses it only then. On CUDA:
    kernels.sample_top, the same draw in two launches. emb (an embedding table [*, D]) given: returns (tokens, their
    rows [B, D]), the next step's input looked up in the same launch."""
    if kernels.sample_top_applies(logits, cap):
        return kernels.sample_top(logits, do_sample, temperature, top_k, top_p, noise, cap, emb)
    vals, idx = top_values(logits.float(), cap)  # [B, cap], descending
    rank = torch.arange(cap, device=logits.device)
    x = (vals / temperature[:, None]).masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = x.softmax(-1)
    tail = probs.flip(-1).cumsum(-1).flip(-1)  # mass of this token and every less likely one (HF's ascending cumsum)
    drop = (tail <= (1 - top_p)[:, None]) & (rank[None, :] > 0)
    probs = x.masked_fill(drop, float("-inf")).softmax(-1)
    choice = (probs / -torch.log(noise.gather(-1, idx))).argmax(-1)
    sampled = idx.gather(-1, choice[:, None])[:, 0]
    tokens = torch.where(do_sample, sampled, idx[:, 0])
    return tokens if emb is None else (tokens, torch.nn.functional.embedding(tokens, emb))
