"""The Qwen3 forced aligner's "thinker": audio encoder + Qwen3 LM + a timestamp-class head (`thinker.*` keys).

One non-autoregressive pass: the prompt `<|audio_start|> <|audio_pad|> x N <|audio_end|> w1 <ts><ts> w2 <ts><ts> ...`
is embedded, the N audio_pad rows replaced by the audio encoder's output, run through the causal Qwen3 stack, and
the head (classify_num classes of timestamp_segment_time ms each) is read at the `<timestamp>` positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import invariant
from ..config import DecoderLayerConfig
from ..kernels.prefill import add_rms_norm, prefill_glue_applies, qk_norm_rope, silu_mul
from ..weights import check_prefixes, load_module, read_tensors, safetensors_files
from .audio_encoder import AudioEncoder, AudioEncoderConfig, Ragged, parse_audio_encoder_config, sinusoids
from .layers import DecoderLayer, RMSNorm, apply_rope, fuse_projections, rope_cos_sin, rope_inv_freq


@dataclass(slots=True)
class AlignerConfig:
    audio: AudioEncoderConfig
    text: DecoderLayerConfig
    classify_num: int  # timestamp classes
    audio_token_id: int  # <|audio_pad|>
    timestamp_token_id: int
    timestamp_segment_time: float  # ms per class
    support_languages: list[str]


def parse_aligner_config(d: dict) -> AlignerConfig:
    """config.json of a Qwen3-ForcedAligner checkpoint (model_type qwen3_asr with a classify head)."""
    th = d.get("thinker_config")
    if d.get("model_type") != "qwen3_asr" or not isinstance(th, dict) or "classify_num" not in th \
            or "timestamp_token_id" not in d:
        raise ValueError("not a Qwen3 forced-aligner checkpoint: config.json needs model_type 'qwen3_asr', "
                         "thinker_config.classify_num and timestamp_token_id (e.g. Qwen/Qwen3-ForcedAligner-0.6B)")
    t = th["text_config"]
    text = DecoderLayerConfig(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                              num_hidden_layers=t["num_hidden_layers"], num_attention_heads=t["num_attention_heads"],
                              num_key_value_heads=t["num_key_value_heads"],
                              head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
                              rms_norm_eps=t.get("rms_norm_eps", 1e-6), rope_theta=t.get("rope_theta", 5000000.0),
                              vocab_size=t["vocab_size"])
    if t.get("attention_bias") or t.get("hidden_act", "silu") != "silu":
        raise ValueError("aligner text model: attention_bias / a non-SiLU MLP are not supported")
    rope = t.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"aligner text model: rope_type {rope.get('rope_type')!r} is not supported "
                         "(accepted: default)")
    return AlignerConfig(audio=parse_audio_encoder_config(th.get("audio_config", {})), text=text,
                         classify_num=th["classify_num"], audio_token_id=th.get("audio_token_id", 151646),
                         timestamp_token_id=d["timestamp_token_id"],
                         timestamp_segment_time=float(d["timestamp_segment_time"]),
                         support_languages=list(d.get("support_languages") or []))


class TextModel(nn.Module):
    """`thinker.model.*`: token embedding, Qwen3 decoder layers, final norm."""

    def __init__(self, cfg: DecoderLayerConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def lm_layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: Ragged) -> torch.Tensor:
    """One Qwen3 decoder layer over every row's tokens packed: x [N, D], cos / sin [N, Dh] -> [N, D]. The projections
    run on the N real tokens (q|k|v and gate|up fused: fuse_projections); attention on the right-padded form
    [B, H, S, Dh], causal. NOTE(aligner): right padding makes is_causal exact for every real token (it sees only
    positions before it, all real); a padding query's output is dropped by unpad."""
    a, m = layer.self_attn, layer.mlp
    H, Hkv, Dh = a.num_heads, a.num_kv_heads, a.head_dim
    N = x.shape[0]
    q, k, v = F.linear(layer.input_layernorm(x), a.qkv_weight).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
    q = apply_rope(a.q_norm(q.view(N, H, Dh)), cos, sin)  # [N, H, Dh]
    k = apply_rope(a.k_norm(k.view(N, Hkv, Dh)), cos, sin)  # [N, Hkv, Dh]
    B, S = rows.shape
    qkv = rows.pad(torch.cat([q.reshape(N, H * Dh), k.reshape(N, Hkv * Dh), v], dim=-1))  # [B, S, (H+2Hkv) Dh]
    q, k, v = (t.reshape(B, S, -1, Dh).transpose(1, 2) for t in qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, H, S, Dh]
    x = x + F.linear(rows.unpad(out.transpose(1, 2).reshape(B, S, H * Dh)), a.o_proj.weight)
    gate, up = F.linear(layer.post_attention_layernorm(x), m.gate_up_weight).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, m.down_proj.weight)


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module on x: invariant.rms_norm (one fused launch, rounded as the module) where the prefill glue
    applies, else the module."""
    return invariant.rms_norm(x, norm.weight, norm.eps) if prefill_glue_applies(x) else norm(x)


def _add_norm(norm: nn.Module, x: torch.Tensor, delta: torch.Tensor, fuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the RMSNorm module after it -> (x + delta, norm(x + delta)): one kernel (add_rms_norm, the
    same bits as the add then _norm) where fuse and the prefill glue applies, else the two steps."""
    if fuse and prefill_glue_applies(x):
        return add_rms_norm(x, delta, norm.weight, norm.eps)
    x = x + delta
    return x, _norm(norm, x)


def lm_layer_padded(layer: DecoderLayer, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    next_norm: nn.Module, fuse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """lm_layer on rows right-padded to one length: x [B, S, D] the residual stream and h = its input_layernorm,
    cos / sin [S, Dh] -> (x' [B, S, D], next_norm(x')): the layer's output and its norm for what reads it next (the
    next layer's input_layernorm or the final norm), so each residual add is fused with the norm that follows it
    (_add_norm; fuse False: separate kernels, the same bits). NOTE(aligner): as in lm_layer, right padding +
    is_causal keeps every real token's output that of its row alone."""
    a, m = layer.self_attn, layer.mlp
    H, Hkv, Dh = a.num_heads, a.num_kv_heads, a.head_dim
    B, S, _ = x.shape
    glue = prefill_glue_applies(x)  # CUDA bf16: norms, RoPE, SiLU * up fused (kernels.prefill), rounded as the modules
    qkv = F.linear(h, a.qkv_weight)  # [B, S, (H + 2 Hkv) Dh]
    v = qkv[..., (H + Hkv) * Dh:].view(B, S, Hkv, Dh).transpose(1, 2)  # [B, Hkv, S, Dh]
    if glue:
        q, k = qk_norm_rope(qkv, a.q_norm, a.k_norm, cos, sin, H, Hkv)
    else:
        q, k, _ = qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        q = apply_rope(a.q_norm(q.view(B, S, H, Dh)), cos, sin).transpose(1, 2)  # [B, H, S, Dh]
        k = apply_rope(a.k_norm(k.view(B, S, Hkv, Dh)), cos, sin).transpose(1, 2)  # [B, Hkv, S, Dh]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, H, S, Dh]
    x, h = _add_norm(layer.post_attention_layernorm, x, F.linear(out.transpose(1, 2).reshape(B, S, H * Dh),
                                                                 a.o_proj.weight), fuse)
    gate_up = F.linear(h, m.gate_up_weight)  # [B, S, 2I]
    if glue:
        act = silu_mul(gate_up)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up  # [B, S, I]
    return _add_norm(next_norm, x, F.linear(act, m.down_proj.weight), fuse)


class Thinker(nn.Module):
    """Names = checkpoint keys under `thinker.`."""

    def __init__(self, cfg: AlignerConfig):
        super().__init__()
        self.cfg = cfg
        self.audio_tower = AudioEncoder(cfg.audio)
        self.model = TextModel(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.classify_num, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.text.head_dim, cfg.text.rope_theta), persistent=False)
        self.layer_fn = lm_layer  # the owner may put a compiled lm_layer here (q3tts.align)
        self.fuse_add_norm = True  # lm_padded: each residual add fused with its norm (False: apart, the same bits)

    def init_buffers(self) -> None:
        """(Re)compute the non-persistent tables on the module's device (after a meta build): the sinusoids in the
        module's dtype, as the official casts them, the RoPE frequencies in fp32; fuse the projections."""
        enc = self.audio_tower
        dev, dtype = enc.conv_out.weight.device, enc.conv_out.weight.dtype
        enc.positional_embedding = sinusoids(enc.cfg.max_source_positions, enc.cfg.d_model).to(dev, dtype)
        self.inv_freq = rope_inv_freq(self.cfg.text.head_dim, self.cfg.text.rope_theta).to(dev)
        fuse_projections(self.model)
        enc.fuse_qkv()

    def forward(self, input_ids: torch.Tensor, rows: Ragged, audio: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """input_ids [N]: every row's prompt packed (rows.lengths tokens each), the audio_pad runs in order as long as
        audio [N_audio, D] (each row's audio tokens, packed); select [M] int64: the packed positions to classify
        -> logits [M, classify_num].

        NOTE(aligner): positions are 0..len-1 per row. The official pads on the left and counts positions from each
        row's first real token, and its multimodal RoPE carries one position on all 3 sections for this prompt:
        plain RoPE on the same positions.
        """
        x = self.model.embed_tokens(input_ids)  # [N, D]
        x = x.masked_scatter((input_ids == self.cfg.audio_token_id)[:, None], audio.to(x.dtype))
        cos, sin = rope_cos_sin(rows.positions[None], self.inv_freq, x.dtype)  # [1, N, Dh]
        for layer in self.model.layers:  # a one-pass prefill: no K/V cache
            x = self.layer_fn(layer, x, cos[0], sin[0], rows)
        return self.lm_head(self.model.norm(x.index_select(0, select)))


    def forward_padded(self, input_ids: torch.Tensor, mel: torch.Tensor, window_mask: torch.Tensor,
                       audio_at: torch.Tensor) -> torch.Tensor:
        """forward on fixed shapes (no host data, for CUDA-graph capture): input_ids [B, S] each row's prompt
        right-padded; mel / window_mask as AudioEncoder.forward_padded; audio_at [B, S] int64: for an audio_pad slot
        the index of its embedding in the encoder's output flattened to [B * A], anything for the others
        -> logits [B, S, classify_num] at every slot (a row's positions are 0..S-1, as forward's)."""
        return self.lm_padded(input_ids, self.audio_tower.forward_padded(mel, window_mask), audio_at)

    def lm_padded(self, input_ids: torch.Tensor, audio: torch.Tensor, audio_at: torch.Tensor) -> torch.Tensor:
        """forward_padded after the audio encoder: audio [B, A, D] its output (the prompts need not be known before
        it runs)."""
        B, S = input_ids.shape
        x = self.model.embed_tokens(input_ids)  # [B, S, D]
        audio = audio.reshape(-1, x.shape[-1]).index_select(0, audio_at.view(-1)).view(B, S, -1)
        x = torch.where((input_ids == self.cfg.audio_token_id)[..., None], audio.to(x.dtype), x)
        cos, sin = rope_cos_sin(torch.arange(S, device=x.device)[None], self.inv_freq, x.dtype)  # [1, S, Dh]
        norms = [layer.input_layernorm for layer in self.model.layers] + [self.model.norm]
        h = _norm(norms[0], x)
        for layer, next_norm in zip(self.model.layers, norms[1:]):
            x, h = lm_layer_padded(layer, x, h, cos[0], sin[0], next_norm, self.fuse_add_norm)
        return self.lm_head(h)


ALIGNER_FILES = ("config.json", "vocab.json", "merges.txt", "tokenizer_config.json")


def load_thinker(model_dir, cfg: AlignerConfig, device: torch.device, dtype: torch.dtype) -> Thinker:
    """`thinker.*` of model.safetensors into a Thinker on device in dtype (every key must match)."""
    files = safetensors_files(Path(model_dir) / "model")
    check_prefixes(files, ("thinker.",), f"{model_dir}/model.safetensors")
    with torch.device("meta"):  # weights are copied once, from the file to their place
        thinker = Thinker(cfg).to(dtype)
    thinker = thinker.to_empty(device=device)
    load_module(thinker, read_tensors(files, "thinker."), f"{model_dir}/model.safetensors (thinker.*)")
    thinker.init_buffers()
    return thinker.eval()
