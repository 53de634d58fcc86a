"""Speaker encoder (ECAPA-TDNN) and its mel front end: 24 kHz reference audio -> x-vector [D].

Module names equal the checkpoint keys under `speaker_encoder.` of model.safetensors (Base models):
  blocks.0                      TDNN (conv k5)                     128 mels -> C0
  blocks.1..3                   SE-Res2Net blocks: tdnn1, res2net_block.blocks.*, tdnn2, se_block.conv1/conv2
  mfa                           TDNN over the concatenated block outputs
  asp.tdnn / asp.conv           attentive statistics pooling
  fc                            conv k1 -> D (1024 for 0.6B, 2048 for 1.7B)
Every conv is `padding="same", padding_mode="reflect"`, as upstream. The mel front end is upstream's
`mel_spectrogram` (librosa slaney filterbank, computed here with numpy, bit-identical to librosa's).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import SpeakerEncoderConfig

# Upstream's extract_speaker_embedding front end.
SAMPLE_RATE = 24000
N_FFT = 1024
HOP = 256
WIN = 1024
N_MELS = 128
FMIN = 0.0
FMAX = 12000.0


# --------------------------------------------------------------------------- mel front end
# the Slaney mel scale (librosa htk=False): linear below 1 kHz, logarithmic above
_F_SP, _MIN_LOG_HZ = 200.0 / 3, 1000.0
_MIN_LOG_MEL, _LOGSTEP = _MIN_LOG_HZ / _F_SP, np.log(6.4) / 27.0


def _hz_to_mel(f: float) -> float:
    if f < _MIN_LOG_HZ:
        return f / _F_SP
    return _MIN_LOG_MEL + np.log(f / _MIN_LOG_HZ) / _LOGSTEP


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asanyarray(m, dtype=np.float64)
    freqs = _F_SP * m
    log_t = m >= _MIN_LOG_MEL
    freqs[log_t] = _MIN_LOG_HZ * np.exp(_LOGSTEP * (m[log_t] - _MIN_LOG_MEL))
    return freqs


@functools.lru_cache(maxsize=8)
def mel_filterbank(sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS, fmin: float = FMIN,
                   fmax: float = FMAX) -> np.ndarray:
    """librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax) with its defaults (htk=False, norm="slaney",
    float32), same operations in the same order -> [n_mels, n_fft // 2 + 1]."""
    weights = np.zeros((n_mels, 1 + n_fft // 2), dtype=np.float32)
    fftfreqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fftfreqs)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_f[2: n_mels + 2] - mel_f[:n_mels])
    weights *= enorm[:, np.newaxis]
    weights.flags.writeable = False  # cached: shared by every caller
    return weights


def mel_spectrogram(y: torch.Tensor, sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS,
                    hop: int = HOP, win: int = WIN, fmin: float = FMIN, fmax: float = FMAX) -> torch.Tensor:
    """Upstream's `mel_spectrogram`: reflect-pad (n_fft - hop) / 2 each side, |STFT| (Hann, no centering),
    slaney mel, log(clamp(x, 1e-5)).

    Args:
        y: [B, N] float waveform at `sr`.
    Returns:
        [B, n_mels, frames] log-mel, frames = (N + n_fft - hop - n_fft) // hop + 1.
    """
    mel_basis = torch.from_numpy(mel_filterbank(sr, n_fft, n_mels, fmin, fmax).copy()).to(y.device)
    window = torch.hann_window(win, device=y.device)
    pad = (n_fft - hop) // 2
    y = F.pad(y.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(y, n_fft, hop_length=hop, win_length=win, window=window, center=False, normalized=False,
                      onesided=True, return_complex=True)
    spec = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)  # [B, n_fft/2+1, frames]
    return torch.log(torch.clamp(torch.matmul(mel_basis, spec), min=1e-5))


# --------------------------------------------------------------------------- ECAPA-TDNN
def _conv(cin: int, cout: int, k: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, k, dilation=dilation, padding="same", padding_mode="reflect")


class TimeDelayNetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, dilation: int):
        super().__init__()
        self.conv = _conv(cin, cout, k, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Split channels into `scale` groups; group i > 0 is a TDNN of (group i + output of group i-1)."""

    def __init__(self, channels: int, scale: int, k: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(channels // scale, channels // scale, k, dilation)
                                    for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, part in enumerate(torch.chunk(x, self.scale, dim=1)):
            if i == 1:
                part = self.blocks[0](part)
            elif i > 1:
                part = self.blocks[i - 1](part + outs[-1])
            outs.append(part)
        return torch.cat(outs, dim=1)


class SqueezeExcitationBlock(nn.Module):
    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = _conv(channels, se_channels, 1)
        self.conv2 = _conv(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * s


class SqueezeExcitationRes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se_channels: int, k: int, dilation: int):
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(cin, cout, 1, 1)
        self.res2net_block = Res2NetBlock(cout, scale, k, dilation)
        self.tdnn2 = TimeDelayNetBlock(cout, cout, 1, 1)
        self.se_block = SqueezeExcitationBlock(cout, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


class AttentiveStatisticsPooling(nn.Module):
    """Channel-wise attention over time -> weighted mean and std, concatenated: [B, C, T] -> [B, 2C, 1]."""

    eps = 1e-12

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels, 1)

    def _stats(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (w * x).sum(2)
        std = torch.sqrt((w * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(self.eps))
        return mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, T = x.shape
        # NOTE(upstream-mask): upstream builds an all-ones length mask; uniform weights 1/T give the global statistics.
        ones = torch.ones(B, 1, T, dtype=x.dtype, device=x.device)
        mean, std = self._stats(x, ones / ones.sum(dim=2, keepdim=True))
        ctx = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, T), std.unsqueeze(2).expand(-1, -1, T)], dim=1)
        attn = F.softmax(self.conv(torch.tanh(self.tdnn(ctx))), dim=2)
        mean, std = self._stats(x, attn)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: log-mel [B, T, mel_dim] -> x-vector [B, enc_dim]."""

    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        if not len(ch) == len(ks) == len(dil):
            raise ValueError("speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations must have "
                             "the same length")
        self.cfg = cfg
        self.blocks = nn.ModuleList([TimeDelayNetBlock(cfg.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(SqueezeExcitationRes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale,
                                                             cfg.enc_se_channels, ks[i], dil[i]))
        self.mfa = TimeDelayNetBlock(ch[-1], ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatisticsPooling(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, cfg.enc_dim, 1)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = mels.transpose(1, 2)  # [B, mel_dim, T]
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))  # multi-layer feature aggregation
        return self.fc(self.asp(x)).squeeze(-1)  # [B, enc_dim]

    @torch.inference_mode()
    def embed(self, wav: np.ndarray | torch.Tensor) -> torch.Tensor:
        """One 24 kHz mono waveform [N] -> x-vector [enc_dim] (float32, on CPU), as upstream's
        `extract_speaker_embedding` (mel in fp32, then the encoder in its own dtype)."""
        p = next(self.parameters())
        y = torch.as_tensor(np.asarray(wav, dtype=np.float32) if not torch.is_tensor(wav) else wav).float()
        mels = mel_spectrogram(y.reshape(1, -1).to(p.device), sr=self.cfg.sample_rate).transpose(1, 2)
        return self(mels.to(p.dtype))[0].float().cpu()
