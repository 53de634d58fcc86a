"""Everything that runs on the device: static caches, prefill, and the whole-frame decode step.

Slots are rows of the persistent batch. Each slot keeps its own state in preallocated tensors
(position, frame index, last talker hidden, last code 0, code-0 history, sampling parameters, seed,
trailing text), so a frame for any subset of slots is one call with fixed shapes: ready to be
captured as a CUDA graph per batch bucket.

One frame (`decode_frame`) for B slots:
  1. code predictor: fresh 2-token prefill [h, codec_embedding(code0)] -> code 1, then 14 steps -> codes 2..15
  2. talker input = embed_codes(frame) + trailing_text[frame] (tts_pad once the text is used up)
  3. talker step at the slot's position -> hidden h' -> codec_head -> rules -> sample next code 0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.layers import AttnContext, rope_cos_sin, rope_inv_freq
from ..models.talker import Talker
from ..sampling import SamplingParams, sample, talker_logits_rules, uniform_noise


@dataclass(slots=True)
class FrameOutput:
    codes: torch.Tensor  # [B, K] int64: the frame just completed (code 0 from the previous step)
    next_code0: torch.Tensor  # [B] int64: sampled for the next frame (EOS ends the request)


class ModelRunner:
    def __init__(self, talker: Talker, tts_pad_embed: torch.Tensor, max_slots: int, max_len: int):
        cfg = talker.cfg
        cp = cfg.code_predictor
        p = next(talker.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.talker, self.cfg = talker, cfg
        self.max_slots, self.max_len, self.K = max_slots, max_len, cfg.num_code_groups
        dev, dt = self.device, self.dtype
        # KV caches: [layers, k/v, slots, kv heads, positions, head_dim]
        self.kv = torch.zeros(cfg.num_hidden_layers, 2, max_slots, cfg.num_key_value_heads, max_len, cfg.head_dim,
                              device=dev, dtype=dt)
        self.cp_kv = torch.zeros(cp.num_hidden_layers, 2, max_slots, cp.num_key_value_heads, self.K, cp.head_dim,
                                 device=dev, dtype=dt)
        self.tts_pad_embed = tts_pad_embed.to(dev, dt)  # [D]
        # per-slot state
        S, V, D = max_slots, cfg.vocab_size, cfg.hidden_size
        self.position = torch.zeros(S, dtype=torch.long, device=dev)  # next cache position
        self.position_cpu = [0] * S  # host mirror: sizes the attended cache prefix without a device sync
        self.num_generated = torch.zeros(S, dtype=torch.long, device=dev)  # code-0 tokens sampled so far
        self.last_hidden = torch.zeros(S, D, device=dev, dtype=dt)
        self.last_code0 = torch.zeros(S, dtype=torch.long, device=dev)
        self.seen = torch.zeros(S, V, dtype=torch.bool, device=dev)  # code-0 history for the penalty
        self.trailing = torch.zeros(S, max_len, D, device=dev, dtype=dt)
        self.trailing_len = torch.zeros(S, dtype=torch.long, device=dev)
        self.seed = torch.zeros(S, dtype=torch.long, device=dev)
        self.params = {n: torch.zeros(S, dtype=torch.float32, device=dev) for n in (
            "temperature", "top_p", "repetition_penalty", "subtalker_temperature", "subtalker_top_p")}
        self.params.update({n: torch.zeros(S, dtype=torch.long, device=dev) for n in ("top_k", "subtalker_top_k")})
        self.params.update({n: torch.zeros(S, dtype=torch.bool, device=dev) for n in ("do_sample", "subtalker_dosample")})
        self.key_pos = torch.arange(max_len, device=dev)
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta).to(dev)
        self.cp_inv_freq = rope_inv_freq(cp.head_dim, cp.rope_theta).to(dev)
        self.cp_pos = torch.arange(self.K, device=dev)

    # ------------------------------------------------------------------ admission
    @torch.inference_mode()
    def prefill(self, slot: int, prefill: torch.Tensor, trailing: torch.Tensor, params: SamplingParams) -> int:
        """prefill: [L, D] prompt embeddings, trailing: [S, D]. Fills the slot and samples code 0 of frame 0."""
        L = prefill.shape[0]
        if L >= self.max_len or trailing.shape[0] > self.max_len:
            raise ValueError(f"prompt too long: {L} positions (+{trailing.shape[0]} streamed text tokens) for the "
                             f"engine's max_seq_len {self.max_len}; shorten the text")
        s = slot
        for name, t in self.params.items():
            t[s] = getattr(params, name)
        self.seed[s] = params.seed
        self.trailing[s, : trailing.shape[0]] = trailing.to(self.dtype)
        self.trailing_len[s] = trailing.shape[0]
        self.seen[s] = False
        self.num_generated[s] = 0
        pos = torch.arange(L, device=self.device)[None]  # C1: positions 0..L-1 for every request
        n = self.kv_span(L)
        ctx = AttnContext(slots=torch.tensor([s], device=self.device), write_pos=pos,
                          mask=(self.key_pos[None, :n] <= pos[0][:, None])[None, None])
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.dtype)
        h = self.talker(prefill[None].to(self.dtype), cos, sin, self.kv, ctx)[:, -1]  # [1, D]
        self.position[s] = L
        self.position_cpu[s] = L
        code0 = self._sample_code0(torch.tensor([s], device=self.device), h)
        self.last_hidden[s] = h[0]
        return int(code0[0])

    def kv_span(self, length: int) -> int:
        """Cache positions to attend over for sequences up to `length`: rounded up so shapes repeat."""
        return min(self.max_len, -(-length // 64) * 64)

    # ------------------------------------------------------------------ the frame
    def _sample_code0(self, slots: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h: [B, D] final talker hidden -> code 0 [B]; updates history and counters."""
        t, p = self.cfg, self.params
        logits = self.talker.codec_head(h).float()
        logits = talker_logits_rules(logits, self.seen[slots], p["repetition_penalty"][slots],
                                     self.num_generated[slots], t.codec_eos_token_id, t.vocab_size - 1024)
        noise = uniform_noise(self.seed[slots], self.num_generated[slots], 0, logits.shape[-1])
        code0 = sample(logits, p["do_sample"][slots], p["temperature"][slots], p["top_k"][slots],
                       p["top_p"][slots], noise)
        self.seen[slots, code0] = True
        self.num_generated[slots] += 1
        self.last_code0[slots] = code0
        return code0

    def _code_predictor(self, slots: torch.Tensor, h: torch.Tensor, code0: torch.Tensor) -> torch.Tensor:
        """C2: h [B, D] talker hidden, code0 [B] -> codes 1..K-1 [B, K-1]."""
        cp, p = self.talker.code_predictor, self.params
        B = h.shape[0]
        rows = torch.arange(B, device=self.device)
        frame = self.num_generated[slots] - 1  # this frame's index: noise differs per frame and codebook
        x = torch.stack([h, self.talker.model.codec_embedding(code0)], dim=1)  # [B, 2, D]
        out = []
        for i in range(self.K - 1):
            pos = (self.cp_pos[:2] if i == 0 else self.cp_pos[i + 1: i + 2])[None].expand(B, -1)  # 0,1; then i+1
            ctx = AttnContext(slots=rows, write_pos=pos, mask=(self.cp_pos[None, None, None, :] <= pos[:, None, :, None]))
            cos, sin = rope_cos_sin(pos, self.cp_inv_freq, self.dtype)
            hid = cp(x, cos, sin, self.cp_kv, ctx)[:, -1]  # [B, D_cp]
            logits = cp.lm_head[i](hid).float()
            noise = uniform_noise(self.seed[slots], frame, i + 1, logits.shape[-1])
            code = sample(logits, p["subtalker_dosample"][slots], p["subtalker_temperature"][slots],
                          p["subtalker_top_k"][slots], p["subtalker_top_p"][slots], noise)
            out.append(code)
            if i + 1 < self.K - 1:
                x = cp.model.codec_embedding[i](code)[:, None]  # [B, 1, D]
        return torch.stack(out, dim=1)

    @torch.inference_mode()
    def decode_frame(self, slot_list: list[int]) -> FrameOutput:
        """One whole frame for the given slots."""
        slots = torch.tensor(slot_list, device=self.device)
        n = self.kv_span(max(self.position_cpu[s] for s in slot_list) + 1)
        h, code0 = self.last_hidden[slots], self.last_code0[slots]
        frame_idx = self.num_generated[slots] - 1  # frames completed before this one
        codes = torch.cat([code0[:, None], self._code_predictor(slots, h, code0)], dim=1)  # [B, K]
        x = self.talker.embed_codes(codes)
        use_text = frame_idx < self.trailing_len[slots]
        text = self.trailing[slots, frame_idx.clamp(max=self.max_len - 1)]
        x = x + torch.where(use_text[:, None], text, self.tts_pad_embed[None])
        pos = self.position[slots][:, None]  # [B, 1]
        ctx = AttnContext(slots=slots, write_pos=pos, mask=(self.key_pos[None, None, None, :n] <= pos[:, None, :, None]))
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.dtype)
        h = self.talker(x[:, None], cos, sin, self.kv, ctx)[:, -1]
        self.position[slots] += 1
        for s in slot_list:
            self.position_cpu[s] += 1
        self.last_hidden[slots] = h
        return FrameOutput(codes=codes, next_code0=self._sample_code0(slots, h))
