"""The Qwen3 forced aligner's "thinker": audio encoder + Qwen3 LM + a timestamp-class head (`thinker.*` keys).

One non-autoregressive pass: the prompt `<|audio_start|> <|audio_pad|> x N <|audio_end|> w1 <ts><ts> w2 <ts><ts> ...`
is embedded, the N audio_pad rows replaced by the audio encoder's output, run through the causal Qwen3 stack, and
the head (classify_num classes of timestamp_segment_time ms each) is read at the `<timestamp>` positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import DecoderLayerConfig
from ..weights import check_prefixes, load_module, read_tensors, safetensors_files
from .audio_encoder import AudioEncoder, AudioEncoderConfig, parse_audio_encoder_config, sinusoids
from .layers import AttnContext, DecoderLayer, RMSNorm, rope_cos_sin, rope_inv_freq


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


class Thinker(nn.Module):
    """Names = checkpoint keys under `thinker.`."""

    def __init__(self, cfg: AlignerConfig):
        super().__init__()
        self.cfg = cfg
        self.audio_tower = AudioEncoder(cfg.audio)
        self.model = TextModel(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.classify_num, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.text.head_dim, cfg.text.rope_theta), persistent=False)

    def init_buffers(self) -> None:
        """(Re)compute the non-persistent tables on the module's device (after a meta build): the sinusoids in the
        module's dtype, as the official casts them, the RoPE frequencies in fp32."""
        enc = self.audio_tower
        dev, dtype = enc.conv_out.weight.device, enc.conv_out.weight.dtype
        enc.positional_embedding = sinusoids(enc.cfg.max_source_positions, enc.cfg.d_model).to(dev, dtype)
        self.inv_freq = rope_inv_freq(self.cfg.text.head_dim, self.cfg.text.rope_theta).to(dev)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor, audio: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [B, S] (right-padded; row b has lengths[b] tokens, the audio_pad run of row b as long as
        audio[b] [N_b, D]) -> logits [B, S, classify_num].

        NOTE(aligner): positions are 0..len-1 per row. The official pads on the left and counts positions from each
        row's first real token, and its multimodal RoPE carries one position on all 3 sections for this prompt:
        plain RoPE on the same positions.
        """
        B, S = input_ids.shape
        x = self.model.embed_tokens(input_ids)  # [B, S, D]
        is_audio = input_ids == self.cfg.audio_token_id
        x = x.masked_scatter(is_audio[..., None], torch.cat(audio).to(x.dtype))
        pos = torch.arange(S, device=x.device)
        cos, sin = rope_cos_sin(pos[None].expand(B, S), self.inv_freq, x.dtype)
        valid = pos[None, :] < lengths[:, None]  # [B, S]
        mask = (pos[None, :, None] >= pos[None, None, :]) & valid[:, None, :]  # causal over the row's own tokens
        ctx = AttnContext(write_pos=pos[None].expand(B, S), mask=mask[:, None])
        t = self.cfg.text
        for layer in self.model.layers:  # a one-pass prefill: the K/V "cache" is this call's scratch
            k = x.new_empty(B, t.num_key_value_heads, S, t.head_dim)
            x = layer(x, cos, sin, k, torch.empty_like(k), ctx)
        return self.lm_head(self.model.norm(x))


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
