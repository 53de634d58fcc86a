"""The Qwen3-ASR audio encoder (the forced aligner's `thinker.audio_tower.*`) and its Whisper log-mel front end.

    16 kHz audio -> log-mel [128, F] (hop 160: 100 frames a second)
    -> chunks of 2 * n_window frames, each through 3 stride-2 Conv2d + GELU -> conv_out: 13 tokens per 100 frames
    -> + sinusoidal positions (restarting in every chunk) -> encoder layers (pre-LayerNorm, bidirectional attention
    within windows of n_window_infer frames) -> ln_post -> proj1 -> GELU -> proj2: [N, output_dim] audio embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SAMPLE_RATE = 16000
N_FFT, HOP = 400, 160


@dataclass(slots=True)
class AudioEncoderConfig:
    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    max_source_positions: int = 1500
    n_window: int = 100  # a conv chunk is 2 * n_window mel frames
    n_window_infer: int = 400  # an attention window, in mel frames (a multiple of 2 * n_window)
    downsample_hidden_size: int = 480
    output_dim: int = 3584
    activation_function: str = "gelu"


def parse_audio_encoder_config(d: dict) -> AudioEncoderConfig:
    """Defaults are qwen-asr's Qwen3ASRAudioEncoderConfig's; unknown keys are ignored."""
    cfg = AudioEncoderConfig(**{k: d[k] for k in AudioEncoderConfig.__slots__ if k in d})
    if cfg.activation_function != "gelu":
        raise ValueError(f"audio encoder activation {cfg.activation_function!r} is not supported (accepted: gelu)")
    if cfg.n_window != 50:  # the official token count (tokens_after_cnn) hard-codes 100-frame chunks
        raise ValueError(f"audio encoder n_window {cfg.n_window} is not supported (accepted: 50)")
    if cfg.n_window_infer % (2 * cfg.n_window):
        raise ValueError(f"n_window_infer ({cfg.n_window_infer}) must be a multiple of 2 * n_window "
                         f"({2 * cfg.n_window})")
    return cfg


def tokens_after_cnn(frames: int) -> int:
    """Audio tokens for `frames` mel frames: 13 per full 100-frame chunk, the tail through 3 stride-2 convs
    (the official `_get_feat_extract_output_lengths`, which hard-codes 100-frame chunks)."""
    tail = frames % 100
    feat = (tail - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13


def _conv_len(n: int) -> int:
    for _ in range(3):
        n = (n - 1) // 2 + 1
    return n


# --------------------------------------------------------------------------- log-mel (WhisperFeatureExtractor)
def mel_filters(num_mel_bins: int = 128, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters [1 + n_fft // 2, num_mel_bins] over 0..8 kHz, in float64
    (as transformers' mel_filter_bank, which the official feature extractor uses)."""
    def hz_to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        lin = 3.0 * f / 200.0
        return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * (27.0 / np.log(6.4)), lin)

    def mel_to_hz(m):
        m = np.asarray(m, dtype=np.float64)
        lin = 200.0 * m / 3.0
        return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), lin)

    fft_freqs = np.linspace(0, sample_rate // 2, 1 + n_fft // 2)
    mel_pts = np.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), num_mel_bins + 2)
    filter_freqs = mel_to_hz(mel_pts)
    diff = np.diff(filter_freqs)
    slopes = np.expand_dims(filter_freqs, 0) - np.expand_dims(fft_freqs, 1)
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    fb = np.maximum(np.zeros(1), np.minimum(down, up))
    enorm = 2.0 / (filter_freqs[2:num_mel_bins + 2] - filter_freqs[:num_mel_bins])
    return fb * np.expand_dims(enorm, 0)


def log_mel(wavs: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """wavs [B, L] float32 (rows zero-padded to one length L) -> log-mel [B, num_mel_bins, L // 160].

    As the official feature extractor: |STFT|^2 (Hann 400, hop 160, centred, reflect) without its last frame,
    log10 clamped at 1e-10, floored 8 below the row's maximum over all L // 160 frames (padding included), (x+4)/4.
    """
    window = torch.hann_window(N_FFT, device=wavs.device)
    stft = torch.stft(wavs, N_FFT, HOP, window=window, return_complex=True)
    mags = stft[..., :-1].abs() ** 2  # [B, 201, L // 160]
    log_spec = torch.clamp(filters.T @ mags, min=1e-10).log10()
    top = log_spec.amax(dim=(1, 2), keepdim=True)
    return (torch.maximum(log_spec, top - 8.0) + 4.0) / 4.0


def valid_frames(num_samples: int, padded_len: int) -> int:
    """Mel frames of a row of num_samples samples in a batch padded to padded_len (the official attention mask:
    every 160th sample, trimmed to padded_len // 160 columns)."""
    return min(-(-num_samples // HOP), padded_len // HOP)


# --------------------------------------------------------------------------- the encoder
class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.encoder_attention_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [W, T, D] (windows), mask [W, 1, T, T] bool: bidirectional within a window's valid tokens."""
        W, T, D = x.shape
        H = self.num_heads
        q, k, v = (p(x).view(W, T, H, D // H).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [W, H, T, Dh]
        return self.out_proj(out.transpose(1, 2).reshape(W, T, D))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn = AudioAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x, mask):
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels]: sin | cos halves (the official SinusoidsPositionEmbedding)."""
    inc = np.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2).float())
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class AudioEncoder(nn.Module):
    """Names = checkpoint keys under `thinker.audio_tower.`."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        c = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv_out = nn.Linear(c * _conv_len(cfg.num_mel_bins), cfg.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.register_buffer("positional_embedding", sinusoids(cfg.max_source_positions, cfg.d_model), persistent=False)

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        """feats: per utterance a log-mel [num_mel_bins, F_i] -> per utterance audio embeddings [tokens_after_cnn(F_i),
        output_dim]. Every conv chunk of every utterance runs in one batch, every attention window in another."""
        cfg = self.cfg
        chunk = 2 * cfg.n_window
        # NOTE(aligner): as the official, an utterance's chunks are zero-padded to its longest chunk (chunk frames,
        # or its own length when it is shorter than one chunk), never to another utterance's: past the first conv
        # the padding is not zero (GELU of the bias), so it reaches the tail chunk's last tokens. Chunks of the same
        # padded length run as one batch.
        groups: dict[int, list[tuple[int, torch.Tensor]]] = {}  # padded length -> [(chunk index, [frames, mel])]
        lens = []
        for f in feats:
            pad_to = min(chunk, f.shape[1])
            for s in range(0, f.shape[1], chunk):
                groups.setdefault(pad_to, []).append((len(lens), f[:, s:s + chunk].T))
                lens.append(min(chunk, f.shape[1] - s))
        out: list[torch.Tensor | None] = [None] * len(lens)
        for pad_to, members in groups.items():
            x = nn.utils.rnn.pad_sequence([p for _, p in members], batch_first=True)  # [C, <= pad_to, mel]
            x = F.pad(x, (0, 0, 0, pad_to - x.shape[1])).transpose(1, 2)[:, None]  # [C, 1, mel, pad_to]
            x = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(x))))))  # [C, c, mel', t]
            C, c, m, t = x.shape
            x = self.conv_out(x.permute(0, 3, 1, 2).reshape(C, t, c * m))  # [C, t, D]
            x = x + self.positional_embedding[:t].to(x.dtype)  # positions restart in every chunk
            for j, (i, _) in enumerate(members):
                out[i] = x[j, :_conv_len(lens[i])]
        tokens = torch.cat(out)  # [N, D] all utterances' tokens, in order
        # attention windows: n_window_infer frames = window tokens of t per chunk, cut per utterance
        window = _conv_len(chunk) * (cfg.n_window_infer // chunk)
        counts = [tokens_after_cnn(f.shape[1]) for f in feats]
        spans = [min(window, n - s) for n in counts for s in range(0, n, window)]
        win = nn.utils.rnn.pad_sequence(list(tokens.split(spans)), batch_first=True)  # [W, T, D]
        valid = torch.arange(win.shape[1], device=win.device)[None, :] < torch.tensor(spans, device=win.device)[:, None]
        mask = (valid[:, None, :, None] & valid[:, None, None, :]) | torch.eye(win.shape[1], dtype=torch.bool,
                                                                               device=win.device)
        for layer in self.layers:
            win = layer(win, mask)
        h = torch.cat([win[i, :n] for i, n in enumerate(spans)])  # [N, D]
        h = self.proj2(F.gelu(self.proj1(self.ln_post(h))))
        return list(h.split(counts))

