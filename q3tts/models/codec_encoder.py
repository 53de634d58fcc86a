"""12 Hz codec encoder (Mimi-based): 24 kHz waveform -> codes [T, 16], as the official `speech_tokenizer.encode`.

Plain PyTorch port of the encode path of transformers' `MimiModel` (4.57), which is what qwen_tts's
`Qwen3TTSTokenizerV2Encoder` is. Module names equal the checkpoint keys under `encoder.` of
speech_tokenizer/model.safetensors:
  encoder.layers.*            SEANet: causal convs, residual blocks (block.1 / block.3), ELUs, strides 4,5,6,8
  encoder_transformer.layers.*  8 causal transformer layers (LayerNorm, RoPE, GELU MLP, layer scales) at 25 Hz
  downsample                  causal conv k4 s2 (replicate padding) -> 12.5 Hz
  quantizer.semantic_residual_vector_quantizer   1 codebook  (code 0)
  quantizer.acoustic_residual_vector_quantizer   31 codebooks; the first 15 are used (codes 1..15)
Upstream facts kept on purpose:
- the transformer attends causally over the whole clip: transformers' Mimi builds a plain causal mask, the
  config's `sliding_window` is not applied;
- a batch is right-padded with zeros and encoded together, then each row keeps ceil(len / 1920) frames;
  the last (partial) frame of a shorter row therefore sees the padding, exactly as upstream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import dataclass_kwargs
from .codec import LayerScale
from .layers import apply_rope, rope_cos_sin, rope_inv_freq


@dataclass(slots=True)
class CodecEncoderConfig:
    """`speech_tokenizer/config.json` -> encoder_config (a MimiConfig); only what the encode path reads."""

    sampling_rate: int = 24000
    frame_rate: float = 12.5
    audio_channels: int = 1
    num_filters: int = 64
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    num_residual_layers: int = 1
    compress: int = 2
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    use_causal_conv: bool = True
    use_conv_shortcut: bool = False
    pad_mode: str = "constant"
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    hidden_act: str = "gelu"
    codebook_size: int = 2048
    codebook_dim: int = 256
    vector_quantization_hidden_dimension: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1

    @property
    def encodec_frame_rate(self) -> int:
        return math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))

    @property
    def hop_length(self) -> int:
        """Waveform samples per output frame (1920 = 24 kHz / 12.5 Hz)."""
        return int(round(self.sampling_rate / self.frame_rate))


def parse_codec_encoder_config(d: dict[str, Any]) -> CodecEncoderConfig:
    """From the `encoder_config` dict of speech_tokenizer/config.json (MimiConfig field names)."""
    kw = dataclass_kwargs(CodecEncoderConfig, d)
    rate = d.get("frame_rate", d.get("_frame_rate"))
    if rate is None:  # MimiConfig: one frame per SEANet hop times the 2x downsample
        rate = kw.get("sampling_rate", 24000) / (math.prod(kw.get("upsampling_ratios", (8, 6, 5, 4))) * 2)
    kw["frame_rate"] = float(rate)
    cfg = CodecEncoderConfig(**kw)
    if not cfg.use_causal_conv:
        raise ValueError("speech_tokenizer encoder_config: only causal convolutions (use_causal_conv=true) "
                         "are supported")
    if cfg.hidden_act != "gelu":
        raise ValueError(f"speech_tokenizer encoder_config: hidden_act {cfg.hidden_act!r} is not supported (gelu)")
    return cfg


# --------------------------------------------------------------------------- SEANet encoder
class CausalConv1d(nn.Module):
    """MimiConv1d (causal): left pad kernel - stride, right pad up to a whole number of strides."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, dilation: int = 1, bias: bool = True,
                 pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.kernel = (k - 1) * dilation + 1  # effective kernel size
        self.padding_total = self.kernel - stride
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = x.shape[-1]
        n_frames = -(-(L - self.kernel + self.padding_total) // self.stride)  # ceil((L - stride) / stride)
        extra = n_frames * self.stride + self.kernel - self.padding_total - L
        x = F.pad(x, (self.padding_total, extra), mode=self.pad_mode)
        return self.conv(x)


class ResnetBlock(nn.Module):
    """ELU -> conv k3 (dim -> dim/compress) -> ELU -> conv k1 (-> dim), plus the identity."""

    def __init__(self, cfg: CodecEncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([
            nn.ELU(), CausalConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, pad_mode=cfg.pad_mode),
            nn.ELU(), CausalConv1d(hidden, dim, 1, pad_mode=cfg.pad_mode)])
        if cfg.use_conv_shortcut:
            self.shortcut = CausalConv1d(dim, dim, 1, pad_mode=cfg.pad_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = self.shortcut(x) if hasattr(self, "shortcut") else x
        for layer in self.block:
            x = layer(x)
        return residual + x


class SEANetEncoder(nn.Module):
    """[B, 1, N] -> [B, hidden, ceil(N / 960)] at 25 Hz."""

    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        pm = cfg.pad_mode
        layers: list[nn.Module] = [CausalConv1d(cfg.audio_channels, cfg.num_filters, cfg.kernel_size, pad_mode=pm)]
        scale = 1
        for ratio in reversed(cfg.upsampling_ratios):
            dim = scale * cfg.num_filters
            for j in range(cfg.num_residual_layers):
                layers.append(ResnetBlock(cfg, dim, cfg.dilation_growth_rate ** j))
            layers += [nn.ELU(), CausalConv1d(dim, dim * 2, ratio * 2, stride=ratio, pad_mode=pm)]
            scale *= 2
        layers += [nn.ELU(), CausalConv1d(scale * cfg.num_filters, cfg.hidden_size, cfg.last_kernel_size, pad_mode=pm)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# --------------------------------------------------------------------------- transformer
class Attention(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.H, self.KV, self.hd = H, KV, hd
        self.q_proj = nn.Linear(cfg.hidden_size, H * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, KV * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, KV * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * hd, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.hd).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.KV, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.KV != self.H:
            k = k.repeat_interleave(self.H // self.KV, dim=1)
            v = v.repeat_interleave(self.H // self.KV, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # full causal (see module doc)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.H * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, 1.0)  # loaded from the checkpoint
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, 1.0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self._inv_freq: torch.Tensor | None = None  # fp32 on the input's device, made once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # default RoPE (rotate-half layout), positions 0..T-1, computed in fp32 as transformers does
        if self._inv_freq is None or self._inv_freq.device != x.device:
            self._inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta).to(x.device)
        cos, sin = rope_cos_sin(torch.arange(x.shape[1], device=x.device)[None], self._inv_freq, x.dtype)  # [1, T, hd]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


# --------------------------------------------------------------------------- quantizer
class EuclideanCodebook(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig, epsilon: float = 1e-5):
        super().__init__()
        self.epsilon = epsilon
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(cfg.codebook_size))
        self.register_buffer("embed_sum", torch.zeros(cfg.codebook_size, cfg.codebook_dim))

    @property
    def embed(self) -> torch.Tensor:  # [codebook_size, codebook_dim]
        return self.embed_sum / self.cluster_usage.clamp(min=self.epsilon)[:, None]


class VectorQuantization(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.codebook = EuclideanCodebook(cfg)


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig, num_quantizers: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(cfg) for _ in range(num_quantizers))
        dim = cfg.vector_quantization_hidden_dimension
        if dim != cfg.hidden_size:
            self.input_proj = nn.Conv1d(cfg.hidden_size, dim, 1, bias=False)
            self.output_proj = nn.Conv1d(dim, cfg.hidden_size, 1, bias=False)  # decode only; kept for the keys

    def encode(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[B, hidden, T] -> codes [n, B, T] of the first n codebooks (residual quantization)."""
        if hasattr(self, "input_proj"):
            x = self.input_proj(x)
        residual = x.transpose(1, 2)  # [B, T, dim]
        B, T, D = residual.shape
        codes = []
        for layer in self.layers[:n]:
            embed = layer.codebook.embed
            # NOTE(upstream-ties): the same torch.cdist call (shapes included) as upstream, so ties break identically.
            idx = torch.cdist(residual.reshape(1, B * T, D).float(), embed[None].float(), p=2)[0].argmin(dim=-1)
            idx = idx.view(B, T)
            residual = residual - F.embedding(idx, embed)
            codes.append(idx)
        return torch.stack(codes)


class SplitResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig):
        super().__init__()
        self.num_semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualVectorQuantizer(cfg, cfg.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = ResidualVectorQuantizer(
            cfg, cfg.num_quantizers - cfg.num_semantic_quantizers)

    def encode(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """Semantic and acoustic RVQs both quantize x (not each other's residual) -> [n, B, T]."""
        codes = self.semantic_residual_vector_quantizer.encode(x, min(n, self.num_semantic))
        if n > self.num_semantic:
            codes = torch.cat([codes, self.acoustic_residual_vector_quantizer.encode(x, n - self.num_semantic)])
        return codes


# --------------------------------------------------------------------------- the encoder
class CodecEncoder(nn.Module):
    """24 kHz waveform -> 12.5 Hz codes of the first `num_codes` codebooks."""

    def __init__(self, cfg: CodecEncoderConfig, num_codes: int = 16):
        super().__init__()
        if not cfg.num_semantic_quantizers <= num_codes <= cfg.num_quantizers:
            raise ValueError(f"num_codes {num_codes} must be in [{cfg.num_semantic_quantizers}, {cfg.num_quantizers}]")
        self.cfg, self.num_codes = cfg, num_codes
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = Transformer(cfg)
        ratio = int(cfg.encodec_frame_rate / cfg.frame_rate)
        self.downsample = CausalConv1d(cfg.hidden_size, cfg.hidden_size, 2 * ratio, stride=2, bias=False,
                                       pad_mode="replicate") if ratio != 1 else None
        self.quantizer = SplitResidualVectorQuantizer(cfg)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        """[B, N] waveform -> codes [B, num_codes, ceil(N / hop)] (every frame, padding included)."""
        x = self.encoder(audio.unsqueeze(1))  # [B, hidden, T25]
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        if self.downsample is not None:
            x = self.downsample(x)  # [B, hidden, T]
        return self.quantizer.encode(x, self.num_codes).transpose(0, 1)

    @torch.inference_mode()
    def encode(self, wavs: list, hop: int | None = None) -> list[torch.Tensor]:
        """Upstream's `Qwen3TTSTokenizer.encode` on 24 kHz mono waveforms (one zero-padded batch) -> a list
        of codes [ceil(len / hop), num_codes] (int64, CPU); hop: the tokenizer's encode_downsample_rate."""
        p = next(self.parameters())
        rows = [torch.as_tensor(w).float().reshape(-1) for w in wavs]
        lens = [r.shape[0] for r in rows]
        codes = self(nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device=p.device, dtype=p.dtype))  # zeros
        hop = hop or self.cfg.hop_length
        return [c[:, :-(-n // hop)].transpose(0, 1).cpu() for c, n in zip(codes, lens)]
