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

from ..hostcopy import ints_to_device
from ..kernels.prefill import add_layer_norm, conv1_gelu, prefill_glue_applies

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


def _conv_len_once(n: int) -> int:
    """Positions after one 3-wide, stride-2, pad-1 conv of n."""
    return (n - 1) // 2 + 1


def _conv_len(n: int) -> int:
    for _ in range(3):
        n = _conv_len_once(n)
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


def log_mel(wavs: torch.Tensor, filters: torch.Tensor, num_frames: list[int] | torch.Tensor | None = None,
            center: bool = True) -> torch.Tensor:
    """wavs [B, L] float32 (rows zero-padded to one length L) -> log-mel [B, num_mel_bins, L // 160].

    As the official feature extractor: |STFT|^2 (Hann 400, hop 160, centred, reflect) without its last frame,
    log10 clamped at 1e-10, floored 8 below the row's maximum over all L // 160 frames (padding included), (x+4)/4.
    num_frames given: the floor is taken over each row's first num_frames[b] frames only (frames past them are
    returned but meaningless; a [B] int64 tensor on wavs' device, or a list). center False: the rows come already
    padded by 200 samples on each side (L + 400 samples; see reflect_rows).
    """
    window = torch.hann_window(N_FFT, device=wavs.device)
    stft = torch.stft(wavs, N_FFT, HOP, window=window, center=center, return_complex=True)
    mags = stft[..., :-1].abs() ** 2  # [B, 201, L // 160]
    log_spec = torch.clamp(filters.T @ mags, min=1e-10).log10()
    if num_frames is None:
        top = log_spec.amax(dim=(1, 2), keepdim=True)
    else:
        n = num_frames if isinstance(num_frames, torch.Tensor) else ints_to_device(num_frames, wavs.device)
        past = torch.arange(log_spec.shape[2], device=wavs.device)[None, :] >= n[:, None]  # [B, F]
        top = log_spec.masked_fill(past[:, None], float("-inf")).amax(dim=(1, 2), keepdim=True)
    return (torch.maximum(log_spec, top - 8.0) + 4.0) / 4.0


def reflect_rows(wavs: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """Waveforms of different lengths -> [B, max_len + 400] float32, each row reflect-padded by N_FFT // 2 at both
    of its own ends, then zeros; and each row's mel frame count (len // 160). log_mel(center=False, num_frames=) of
    it gives every row the frames and floor it has alone: a frame reads only its row's own padded samples."""
    pad = N_FFT // 2
    out = np.zeros((len(wavs), max(w.shape[0] for w in wavs) + 2 * pad), np.float32)
    for i, w in enumerate(wavs):
        out[i, :w.shape[0] + 2 * pad] = np.pad(w, pad, mode="reflect")
    return out, [w.shape[0] // HOP for w in wavs]


def reflect_rows_device(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """reflect_rows on the device: rows [B, L] (row b's first lengths[b] samples; lengths [B] int64 on rows' device)
    -> [B, L + 400], each row reflect-padded by N_FFT // 2 at both of its own ends, then zeros (one gather: the same
    values). Shapes that do not depend on the lengths (a CUDA graph's); a row of length 0 is all zeros."""
    pad, dev = N_FFT // 2, rows.device
    n = lengths[:, None]  # [B, 1]
    j = torch.arange(rows.shape[1] + 2 * pad, device=dev)[None, :] - pad  # [1, L + 400] sample index in the row
    src = j.abs()  # the start: sample -k is sample k (pad < every row's length, see ForcedAligner._item)
    src = torch.where(src >= n, 2 * (n - 1) - src, src).clamp(min=0)  # the end: sample n - 1 + k is n - 1 - k
    return rows.gather(1, src.expand(rows.shape[0], -1)) * (j < n + pad)  # [B, L']


def valid_frames(num_samples: int, padded_len: int) -> int:
    """Mel frames of a row of num_samples samples in a batch padded to padded_len (the official attention mask:
    every 160th sample, trimmed to padded_len // 160 columns)."""
    return min(-(-num_samples // HOP), padded_len // HOP)


# --------------------------------------------------------------------------- ragged rows
@dataclass(slots=True)
class Ragged:
    """Rows of different lengths packed end to end ([N, F], row after row) and their padded form [B, S, F]: the
    linears run on the N real rows only, attention on the padded form. Index tensors are built on the host once
    per pass (no device sync)."""

    lengths: list[int]
    to_padded: torch.Tensor  # [N] int64: each packed row's slot in the flattened [B * S]
    valid: torch.Tensor  # [B, S] bool: the real slots
    positions: torch.Tensor  # [N] int64: each packed row's index within its row

    @classmethod
    def of(cls, lengths: list[int], device: torch.device, pad_to: int | None = None) -> "Ragged":
        S = max(max(lengths), pad_to or 0)
        pos = np.concatenate([np.arange(n) for n in lengths])
        row = np.repeat(np.arange(len(lengths)), lengths)
        valid = np.arange(S)[None, :] < np.asarray(lengths)[:, None]
        t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        return cls(list(lengths), t(row * S + pos), t(valid), t(pos))

    @property
    def shape(self) -> tuple[int, int]:
        return self.valid.shape

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, F] -> [B, S, F], zeros in the padding."""
        B, S = self.shape
        return x.new_zeros(B * S, x.shape[1]).index_copy_(0, self.to_padded, x).view(B, S, x.shape[1])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """y [B, S, F] -> [N, F]: the real slots, packed."""
        return y.reshape(-1, y.shape[-1]).index_select(0, self.to_padded)


# --------------------------------------------------------------------------- the encoder
class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.encoder_attention_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn = AudioAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)


def encoder_layer(layer: AudioEncoderLayer, qkv_w: torch.Tensor, qkv_b: torch.Tensor, x: torch.Tensor,
                  win: Ragged) -> torch.Tensor:
    """x [N, D] (every window's tokens, packed) -> [N, D]: pre-LayerNorm, attention bidirectional within each window
    (the padded form [W, T] with a key mask), GELU MLP. qkv_w / qkv_b: q|k|v concatenated (one GEMM)."""
    a = layer.self_attn
    W, T = win.shape
    H, D = a.num_heads, x.shape[1]
    qkv = F.linear(layer.self_attn_layer_norm(x), qkv_w, qkv_b)  # [N, 3D]
    q, k, v = win.pad(qkv).view(W, T, 3, H, D // H).permute(2, 0, 3, 1, 4)  # each [W, H, T, Dh]
    # padding queries see their window's real keys (never an empty row); their outputs are dropped by unpad
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=win.valid[:, None, None, :])  # [W, H, T, Dh]
    x = x + a.out_proj(win.unpad(out.transpose(1, 2).reshape(W, T, D)))
    return x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))


def _layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm module on x: kernels.add_layer_norm without the add (one launch, rounded as F.layer_norm, whose
    bits the fused add + norm gives) where the prefill glue applies, else the module."""
    return add_layer_norm(x, None, norm.weight, norm.bias, norm.eps)[1] if prefill_glue_applies(x) else norm(x)


def _add_layer_norm(norm: nn.LayerNorm, x: torch.Tensor, delta: torch.Tensor,
                    fuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the LayerNorm module after it -> (x + delta, norm(x + delta)): one kernel where fuse and
    the prefill glue applies (the same bits as the add then _layer_norm), else the two steps."""
    if fuse and prefill_glue_applies(x):
        return add_layer_norm(x, delta, norm.weight, norm.bias, norm.eps)
    x = x + delta
    return x, _layer_norm(norm, x)


def encoder_layer_padded(layer: AudioEncoderLayer, qkv_w: torch.Tensor, qkv_b: torch.Tensor, x: torch.Tensor,
                         h: torch.Tensor, mask: torch.Tensor, next_norm: nn.LayerNorm,
                         fuse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """encoder_layer on windows already padded to one length: x [W, T, D] the residual stream and h = its
    self_attn_layer_norm -> (x' [W, T, D], next_norm(x')): the output and its norm for what reads it next (the next
    layer's self_attn_layer_norm or ln_post), each residual add fused with the norm after it (_add_layer_norm; fuse
    False: apart, the same bits); mask [W, T] bool, the keys a window's queries see (its real tokens; all T for a
    window with none, so no softmax row is empty). Every op is per token or per window: a padding token never
    changes a real one."""
    a = layer.self_attn
    W, T, D = x.shape
    H = a.num_heads
    q, k, v = F.linear(h, qkv_w, qkv_b).view(W, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])  # [W, H, T, Dh]
    x, h = _add_layer_norm(layer.final_layer_norm, x, a.out_proj(out.transpose(1, 2).reshape(W, T, D)), fuse)
    return _add_layer_norm(next_norm, x, layer.fc2(F.gelu(layer.fc1(h))), fuse)


def conv1_gemm_gelu(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """F.gelu(conv(x[:, None])) for the encoder's first conv (one input channel, 3x3, stride 2, padding 1): chunks
    [C, M, w] -> [C, c, m1, t1] in channels-last memory. A GEMM over the 3x3 patches, its bias in the GEMM's
    epilogue, its output channels-last as it comes, then F.gelu."""
    C, M, w = x.shape
    c = conv.out_channels
    m1, t1 = _conv_len_once(M), _conv_len_once(w)
    # the 3x3 patches as one strided view of the zero-padded input, gathered by one copy (F.unfold launches an
    # im2col per chunk); K padded 9 -> 16 with zeros (in patches and weights alike: the sums are unchanged) for
    # aligned GEMM rows
    xp = F.pad(x, (1, 1, 1, 1))  # [C, M + 2, w + 2]
    s0, s1, s2 = xp.stride()
    patches = xp.as_strided((C, m1, t1, 3, 3), (s0, 2 * s1, 2 * s2, s1, s2))  # [C, m1, t1, kh, kw]
    cols = xp.new_zeros(C, m1 * t1, 16)
    cols[..., :9].view(C, m1, t1, 3, 3).copy_(patches)
    h = F.linear(cols, F.pad(conv.weight.view(c, 9), (0, 7)), conv.bias)  # [C, m1 * t1, c]
    return F.gelu(h).view(C, m1, t1, c).permute(0, 3, 1, 2)  # [C, c, m1, t1], channels-last memory


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
        self.qkv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (q|k|v weight, bias): fuse_qkv()
        self.layer_fn = encoder_layer  # the owner may put a compiled encoder_layer here (q3tts.align)
        self.fuse_add_norm = True  # forward_padded: each residual add fused with its norm (False: apart, the same bits)

    def fuse_qkv(self) -> None:
        """Concatenate each layer's q/k/v weights and biases once after loading (one GEMM instead of three). The
        per-name parameters become views into the fused tensors, so the weights are held once."""
        self.qkv = []
        for layer in self.layers:
            ps = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
            w, b = torch.cat([p.weight.detach() for p in ps]), torch.cat([p.bias.detach() for p in ps])
            for p, wv, bv in zip(ps, w.split([p.out_features for p in ps]), b.split([p.out_features for p in ps])):
                p.weight.data, p.bias.data = wv, bv
            self.qkv.append((w, b))

    def _conv(self, x: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
        """Chunks [C, mel, w] of w frames -> tokens [C, t, D]: 3 stride-2 convs + GELU, conv_out, the sinusoidal
        positions (restarting in every chunk); channels_last: the convs as _convs_channels_last."""
        if channels_last:
            x = self._convs_channels_last(x)
        else:
            x = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(x[:, None]))))))  # [C, c, mel', t]
        C, c, m, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(C, t, c * m))  # [C, t, D]
        return x + self.positional_embedding[:t].to(x.dtype)

    def _convs_channels_last(self, x: torch.Tensor) -> torch.Tensor:
        """The 3 stride-2 convs + GELU of _conv on chunks [C, mel, w] -> [C, c, mel', t], each activation held
        channels-last (cuDNN's NHWC kernels read and write the large first activations as they lie: no layout
        transposes). The first conv (one input channel) and its GELU: one kernel where the prefill glue applies
        (kernels.prefill.conv1_gelu: the taps read from x, the activation written once), else conv1_gemm_gelu.
        The same sums as the convs, rounded by other kernels."""
        conv = self.conv2d1
        if prefill_glue_applies(x):
            h = conv1_gelu(x, conv.weight, conv.bias)
        else:
            h = conv1_gemm_gelu(conv, x)
        # h [C, c, m1, t1] in channels-last memory: cuDNN keeps the input's channels-last layout
        return F.gelu(self.conv2d3(F.gelu(self.conv2d2(h))))

    def _chunks(self, mel: torch.Tensor, frames: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Every utterance's conv chunks through the convs -> (tokens [sum of chunk token counts, D] in utterance and
        chunk order, each chunk's token count)."""
        cfg = self.cfg
        chunk = 2 * cfg.n_window
        # NOTE(aligner): as the official, an utterance's chunks are zero-padded to its longest chunk (chunk frames,
        # or its own length when it is shorter than one chunk), never to another utterance's: past the first conv
        # the padding is not zero (GELU of the bias), so it reaches the tail chunk's last tokens. Chunks of the same
        # padded length run as one batch: utterances of a chunk or more all at once (frames past each row's own
        # are zeroed), shorter ones grouped by length.
        B, M, F_ = mel.shape
        n_chunks = [-(-f // chunk) for f in frames]
        lens = [min(chunk, f - s) for f in frames for s in range(0, f, chunk)]
        pieces = []  # per group of chunks of one padded length w_g: [C_g, mel, w_g]
        starts = np.zeros(len(lens), np.int64)
        first = np.cumsum([0] + n_chunks[:-1])
        long_rows = [b for b, f in enumerate(frames) if f >= chunk]
        base = 0
        if long_rows:
            C = max(n_chunks[b] for b in long_rows)
            x = mel[long_rows]
            n = torch.as_tensor([frames[b] for b in long_rows], device=mel.device)
            keep = torch.arange(F_, device=mel.device)[None, :] < n[:, None]  # [R, F]
            x = F.pad(x * keep[:, None].to(x.dtype), (0, C * chunk - F_))  # F_ is the longest row's: C * chunk >= F_
            x = x.view(len(long_rows), M, C, chunk).permute(0, 2, 1, 3)  # [R, C, mel, chunk]
            sel = [r * C + j for r, b in enumerate(long_rows) for j in range(n_chunks[b])]
            pieces.append(x.reshape(-1, M, chunk).index_select(0, torch.as_tensor(sel, device=mel.device)))
            t = _conv_len(chunk)
            for b in long_rows:
                for j in range(n_chunks[b]):
                    starts[first[b] + j] = base
                    base += t
        short = {}
        for b, f in enumerate(frames):
            if f < chunk:
                short.setdefault(f, []).append(b)
        for f, rows in short.items():
            pieces.append(mel[rows, :, :f])
            t = _conv_len(f)
            for b in rows:
                starts[first[b]] = base
                base += t
        outs = []
        for x in pieces:
            outs.append(self._conv(x).flatten(0, 1))  # [C_g * t_g, D]
        counts = [_conv_len(n) for n in lens]
        take = np.concatenate([np.arange(n) + s for n, s in zip(counts, starts)])
        flat = outs[0] if len(outs) == 1 else torch.cat(outs)
        return flat.index_select(0, torch.from_numpy(take).to(mel.device)), counts

    def forward_padded(self, mel: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The encoder on fixed shapes (no host data, for CUDA-graph capture): mel [B, num_mel_bins, C * chunk], each
        row's frames past its own zeroed (its chunks zero-padded as the official pads them), C <= the chunks of an
        attention window or a multiple of them; mask [B * C * t // T, T] bool (window_mask) -> [B, C * t, output_dim]:
        row b's first tokens_after_cnn(frames[b]) tokens are its audio embeddings, the rest padding.
        NOTE(aligner): only for rows of at least one chunk of frames (a shorter utterance's single chunk is as long as
        it is, not chunk frames: forward handles those)."""
        B, M, L = mel.shape
        chunk = 2 * self.cfg.n_window
        C = L // chunk
        x = self._conv(mel.view(B, M, C, chunk).permute(0, 2, 1, 3).reshape(B * C, M, chunk),
                       channels_last=mel.is_cuda)  # [B * C, t, D]
        T = mask.shape[1]
        x = x.reshape(-1, T, x.shape[-1])  # [W, T, D]: a row's chunks in order, cut into its attention windows
        norms = [layer.self_attn_layer_norm for layer in self.layers] + [self.ln_post]
        h = _layer_norm(norms[0], x)
        for layer, (w, b), next_norm in zip(self.layers, self.qkv, norms[1:]):
            x, h = encoder_layer_padded(layer, w, b, x, h, mask, next_norm, self.fuse_add_norm)
        return self.proj2(F.gelu(self.proj1(h))).reshape(B, -1, self.cfg.output_dim)

    def window_tokens(self, num_chunks: int) -> int:
        """T of forward_padded's windows for rows padded to num_chunks chunks (C <= a window's chunks: C * t)."""
        per = self.cfg.n_window_infer // (2 * self.cfg.n_window)
        return _conv_len(2 * self.cfg.n_window) * min(per, num_chunks)

    def forward(self, mel: torch.Tensor, frames: list[int]) -> torch.Tensor:
        """mel [B, num_mel_bins, F] (row b's first frames[b] frames are its log-mel) -> audio embeddings
        [N, output_dim]: every utterance's tokens_after_cnn(frames[b]) tokens, packed in utterance order."""
        cfg = self.cfg
        tokens, _ = self._chunks(mel, frames)  # [N, D]
        # attention windows: n_window_infer frames = window tokens of t per chunk, cut per utterance
        window = self.window_tokens(cfg.n_window_infer // (2 * cfg.n_window))  # tokens of a whole attention window
        spans = [min(window, n - s) for n in map(tokens_after_cnn, frames) for s in range(0, n, window)]
        win = Ragged.of(spans, mel.device)
        for layer, (w, b) in zip(self.layers, self.qkv):
            tokens = self.layer_fn(layer, w, b, tokens, win)
        return self.proj2(F.gelu(self.proj1(self.ln_post(tokens))))
