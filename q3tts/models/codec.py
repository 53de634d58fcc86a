"""Code2Wav: the 12 Hz speech-tokenizer decoder, codes [B, K=16, T] -> 24 kHz waveform [B, T*1920].

Pipeline (upstream `Qwen3TTSTokenizerV2Decoder`; module names equal the checkpoint keys minus `decoder.`):
  quantizer (RVQ dequant, per frame) -> pre_conv (causal k=3) -> pre_transformer (sliding-window
  attention, RoPE from position 0) -> upsample (2x [transposed conv k=s, ConvNeXt]) -> decoder
  (conv k=7, 4 SnakeBeta blocks [transposed conv k=2s cropped on the right, 3 residual units],
  SnakeBeta, conv k=7) -> clamp(-1, 1).

Three ways to run it:
- `forward`: one full-context decode (upstream `forward`).
- `chunked_decode` / `decode_batch`: upstream's offline approximation (300-frame chunks with 25 frames
  of left context, positions restarting at 0 per chunk), for parity with the official output.
- `decode_step` with a `Code2WavState`: exact streaming. Every layer is causal at frame granularity
  (see `CausalTransConv`), so feeding frames in any chunking gives exactly `forward(all codes)`, each
  call emits t*1920 final samples, and work per call depends on t only, never on the history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..config import Code2WavConfig
from .layers import MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

# ---------------------------------------------------------------------------------------------------
# Convolutions, time-major: activations are [B, N, C] (channels contiguous), so each convolution reads its input with
# no layout conversion (on CUDA the engine's kernel, kernels.causal_conv; elsewhere channels-last convolutions) and
# each elementwise pass reads contiguous channels. Each causal layer reads its past from `tails` (a list owned by
# Code2WavState, indexed by `state_idx`) when streaming, or zero-pads like upstream when `tails` is None (full
# decode). The SnakeBeta before a convolution is applied while its input is joined to that past (kernels.snake_join:
# one pass).


def _taps_middle_(weight: nn.Parameter) -> None:
    """Keep a conv weight's logical shape [A, B, k] (the checkpoint's) but store it as [A, k, B]: the time-major
    layers read it as a channels-last conv weight or a GEMM operand without a copy. Loading copies values into it
    (or into a tensor of its strides: weights.load_module), and Tensor.copy_ and Module.to keep strides."""
    weight.data = weight.data.permute(0, 2, 1).contiguous().permute(0, 2, 1)


class CausalConv(nn.Module):
    """Conv1d at stride 1, left-padded with (k-1)*dilation zeros (upstream CausalConvNet; its extra
    right padding is always 0 at stride 1). Streaming state: the last (k-1)*dilation input samples."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size, dilation=dilation, groups=groups)
        _taps_middle_(self.conv.weight)
        self.context = (kernel_size - 1) * dilation  # past input samples each output sample needs
        self.state_idx = -1  # slot in Code2WavState.tails; numbered by Code2Wav when context > 0

    def forward(self, x: Tensor, tails: list[Tensor] | None = None, act: SnakeBeta | None = None,
                x_bias: Tensor | None = None, add_bias: bool = True) -> Tensor:
        # x: [B, N, C_in] -> conv(act(x + x_bias)): [B, N, C_out]. x_bias [C_in]: the bias of the conv before, which
        # left it out (add_bias=False): added in this one's pass over its input, not in one of its own after cuDNN
        if self.context == 0:  # pointwise: a GEMM
            if act is not None or x_bias is not None:
                x = kernels.snake_join(x, None, 0, *_params(act), x_bias=x_bias)
            return F.linear(x, self.conv.weight[:, :, 0], self.conv.bias if add_bias else None)
        assert x_bias is None, "a bias of the input only rides in pointwise convs"
        B, N, C = x.shape
        d = self.conv.dilation[0]
        tail = x.new_zeros(B, self.context, C) if tails is None else tails[self.state_idx]
        w = self.conv.weight
        if kernels.causal_conv_applies(x, w, self.conv.groups):  # CUDA: the engine's kernel (no plan per shape)
            x = kernels.snake_join(x, tail, 0, *_params(act))  # [B, context + N, C]
            y = kernels.causal_conv(x, w, self.conv.bias if add_bias else None, d, self.conv.groups)
        else:  # cuDNN's dilated path: zero rows on the right to whole phases of d samples (see _valid); only outputs
            # >= N read them
            x = kernels.snake_join(x, tail, -(self.context + N) % d, *_params(act))  # [B, context + N + pad, C]
            y = self._valid(x, add_bias)[:, :N]
        if tails is not None:
            tails[self.state_idx] = x[:, N: N + self.context]
        return y

    def _valid(self, x: Tensor, add_bias: bool = True) -> Tensor:
        """The unpadded convolution, x: [B, L, C_in] -> [B, L - context, C_out] (cuDNN: L a multiple of the dilation d).
        A dilated one runs undilated over the d interleaved phases of its input (output sample m*d + r reads only
        inputs r, r + d, r + 2d, ...): in time-major memory the phases are a free [B, L/d, d, C] view, a 2-D image
        convolved along its first axis. Same sums, far faster than cuDNN's own dilated channels-last kernel; at
        dilation 1 a [B, C, 1, L] image is the faster one (bench/probe_vocoder.py --conv-options; BENCHMARKS.md).
        The CPU's path, and CUDA's where kernels.causal_conv does not apply (forward chooses)."""
        B, L, C = x.shape
        w, d = self.conv.weight, self.conv.dilation[0]  # w: [C_out, C_in / groups, k], stored [C_out, k, C_in]
        bias = self.conv.bias if add_bias else None  # (cuDNN adds it in a broadcast pass of its own)
        if d == 1:
            y = F.conv2d(x.transpose(1, 2)[:, :, None], w[:, :, None], bias, groups=self.conv.groups)
            return y[:, :, 0].transpose(1, 2)  # [B, C_out, 1, L'] channels-last -> [B, L', C_out], no copy
        y = F.conv2d(x.view(B, L // d, d, C).permute(0, 3, 1, 2), w[..., None], bias, groups=self.conv.groups)
        return y.permute(0, 2, 3, 1).reshape(B, -1, y.shape[1])  # [B, C_out, L/d - k + 1, d] -> [B, L - context, C_out]


class CausalTransConv(nn.Module):
    """ConvTranspose1d(kernel k, stride s) with k - s samples cropped on the right (upstream
    CausalTransConvNet), k = s (the upsamplers) or 2s (the vocoder blocks).

    Why it streams exactly: output sample n receives input frames m with m*s <= n < m*s + k, i.e.
    frames floor(n/s) - (k-1)//s .. floor(n/s), never a later frame. So input frame m finishes output
    samples [m*s, (m+1)*s) by itself with the past (k-1)//s frames: 1 frame for the vocoder blocks,
    none for the upsamplers. Streaming carries that last input frame; a full decode puts a zero frame
    there instead (it adds exactly nothing).

    It runs as one GEMM per call: output block n (s samples x C_out) = x[n] @ W[taps :s] + x[n-1] @ W[taps s:],
    i.e. the pairs (x[n], x[n-1]) [2*C_in] times the weight viewed as [C_in, 2, s*C_out] (rows channel, then
    block: the taps-middle storage). Same sums as the convolution, which cuDNN ran in bf16 with a slow generic
    kernel (bench/probe.py).
    """

    def __init__(self, c_in: int, c_out: int, kernel_size: int, stride: int):
        super().__init__()
        assert kernel_size in (stride, 2 * stride), "k must be s or 2s"
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel_size, stride=stride)
        _taps_middle_(self.conv.weight)
        self.stride = stride
        self.context = (kernel_size - 1) // stride  # past input frames each output sample needs (0 or 1)
        self.state_idx = -1

    def forward(self, x: Tensor, tails: list[Tensor] | None = None, act: SnakeBeta | None = None) -> Tensor:
        # x: [B, N, C_in] -> convtranspose(act(x)) cropped: [B, N*s, C_out]
        B, N, C = x.shape
        w, s = self.conv.weight, self.stride  # w: [C_in, C_out, k], stored [C_in, k, C_out]
        if self.context == 0:
            x = x if act is None else act(x)
        else:  # [B, N, C_in, 2]: act(x[n]) beside act(x[n - 1]), channel by channel
            tail = x.new_zeros(B, 1, C) if tails is None else tails[self.state_idx]
            x = kernels.snake_join(x, tail, 0, *_params(act), pairs=True)
            if tails is not None:
                tails[self.state_idx] = x[:, N - 1:, :, 0]
        w = w.permute(0, 2, 1).reshape(-1, s * w.shape[1])  # [C_in * k/s, s * C_out], a view
        y = F.linear(x.reshape(B, N, -1), w.T, self.conv.bias.repeat(s))
        return y.view(B, N * s, -1)  # [B, N, s * C_out] -> [B, N * s, C_out]


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / (e^beta + 1e-9), per channel; alpha/beta are stored as logs."""

    def __init__(self, dim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, N, C] (pointwise, so no streaming state) -> contiguous [B, N, C]
        return kernels.snake_join(x, None, 0, self.alpha, self.beta)


def _params(act: SnakeBeta | None) -> tuple[Tensor | None, Tensor | None]:
    """(alpha, beta) of the SnakeBeta a convolution applies to its input in kernels.snake_join, or none."""
    return (None, None) if act is None else (act.alpha, act.beta)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, tails: list[Tensor] | None = None) -> Tensor:
        # x: [B, N, C] -> [B, N, C]
        h = self.pwconv2(self.act(self.pwconv1(self.norm(self.dwconv(x, tails)))))
        return x + self.gamma * h


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: Tensor, tails: list[Tensor] | None = None) -> Tensor:
        h = self.conv1(x, tails, self.act1, add_bias=False)
        return x + self.conv2(h, tails, self.act2, x_bias=self.conv1.conv.bias)


class DecoderBlock(nn.Module):
    """SnakeBeta, upsampling transposed conv (k = 2*rate), residual units with dilations 1, 3, 9."""

    def __init__(self, cfg: Code2WavConfig, i: int):
        super().__init__()
        c_in, c_out, rate = cfg.decoder_dim // 2**i, cfg.decoder_dim // 2 ** (i + 1), cfg.upsample_rates[i]
        self.block = nn.ModuleList([SnakeBeta(c_in), CausalTransConv(c_in, c_out, 2 * rate, rate),
                                    *(ResidualUnit(c_out, d) for d in (1, 3, 9))])

    def forward(self, x: Tensor, tails: list[Tensor] | None = None) -> Tensor:
        x = self.block[1](x, tails, self.block[0])
        for m in self.block[2:]:
            x = m(x, tails)
        return x  # [B, N * rate, c_out]


# ---------------------------------------------------------------------------------------------------
# Residual vector quantizer (decode only; input_proj exists for the checkpoint, used by the encoder).


class EuclideanCodebook(nn.Module):
    def __init__(self, dim: int, codebook_size: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(codebook_size))
        self.embedding_sum = nn.Parameter(torch.zeros(codebook_size, dim))
        self._table: tuple[tuple, Tensor] | None = None  # (what it was made from, the table)

    def table(self) -> Tensor:
        """The codebook [codebook_size, dim] = embedding_sum / usage, made once per weights: a decode then reads it
        (the same values) rather than making it again (a CUDA graph's replay would: 2 launches per codebook). Not
        kept when made inside a CUDA graph's capture: that tensor lives in the graph's pool, valid only in replays."""
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in (self.embedding_sum, self.cluster_usage))
        if self._table is not None and self._table[0] == key:
            return self._table[1]
        table = self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]
        if not (table.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._table = (key, table)
        return table

    def decode(self, codes: Tensor) -> Tensor:
        # codes: [B, T] -> [B, T, dim]
        return F.embedding(codes, self.table())


class VectorQuantization(nn.Module):
    def __init__(self, dim: int, codebook_size: int):
        super().__init__()
        self._codebook = EuclideanCodebook(dim, codebook_size)  # project_out is Identity here


class ResidualVQ(nn.Module):
    def __init__(self, num_quantizers: int, dim: int, codebook_size: int):
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(dim, codebook_size) for _ in range(num_quantizers))


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, num_quantizers: int, dim: int, io_dim: int, codebook_size: int):
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = ResidualVQ(num_quantizers, dim, codebook_size)

    def decode(self, codes: Tensor) -> Tensor:
        # codes: [B, K', T] -> [B, T, io_dim]; summed in codebook order like upstream
        q = self.vq.layers[0]._codebook.decode(codes[:, 0])  # [B, T, dim]
        for i in range(1, codes.shape[1]):
            q = q + self.vq.layers[i]._codebook.decode(codes[:, i])
        return F.linear(q, self.output_proj.weight[:, :, 0])  # the 1x1 conv


class SplitResidualVectorQuantizer(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) have separate output projections."""

    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = ResidualVectorQuantizer(1, dim, cfg.codebook_dim, cfg.codebook_size)
        self.rvq_rest = ResidualVectorQuantizer(cfg.num_quantizers - 1, dim, cfg.codebook_dim, cfg.codebook_size)

    def decode(self, codes: Tensor) -> Tensor:
        # codes: [B, K, T] -> [B, T, codebook_dim]
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])


# ---------------------------------------------------------------------------------------------------
# Sliding-window transformer.


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class Attention(nn.Module):
    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim  # from the config, not hidden_size // heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past_k: Tensor | None = None, past_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        # x: [B, t, D]; mask: [B|1, 1, t, P + t] bool (True = attend); past_k/v: [B, H_kv, P, Dh] rotated
        B, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, t, -1, self.head_dim).transpose(1, 2), cos, sin)  # [B, H, t, Dh]
        k = apply_rope(self.k_proj(x).view(B, t, -1, self.head_dim).transpose(1, 2), cos, sin)  # [B, H_kv, t, Dh]
        v = self.v_proj(x).view(B, t, -1, self.head_dim).transpose(1, 2)
        if past_k is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)  # [B, H_kv, P + t, Dh]
        rep = self.num_heads // self.num_kv_heads
        kr, vr = (k, v) if rep == 1 else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        o = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, t, -1)), k, v


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x, cos, sin, mask, past_k=None, past_v=None) -> tuple[Tensor, Tensor, Tensor]:
        h, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        x = x + self.self_attn_layer_scale(h)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x))), k, v


class Transformer(nn.Module):
    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self._inv_freq: Tensor | None = None  # fp32 on the input's device, made once (CUDA-graph capture cannot copy)

    def forward(self, x: Tensor, q_pos: Tensor, k_pos: Tensor, past_k: Tensor | None = None,
                past_v: Tensor | None = None, layer=None) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """x: [B, t, latent]; q_pos: [B|1, t] absolute positions of x; k_pos: [B|1, P + t] positions of
        past then new keys (< 0 = empty slot); past_k/v: [L, B, H_kv, P, Dh] or None (P = 0); layer: a function
        (TransformerLayer, its forward's arguments) in place of each layer's own forward (a compiled one), or None.
        Returns y [B, t, latent] and per layer all keys/values [B, H_kv, P + t, Dh] (rotated)."""
        # HF sliding-window causal mask: query i sees keys j with i - window < j <= i
        qp, kp = q_pos[:, None, :, None], k_pos[:, None, None, :]
        mask = (kp <= qp) & (kp > qp - self.cfg.sliding_window) & (kp >= 0)  # [B|1, 1, t, P + t]
        if self._inv_freq is None or self._inv_freq.device != x.device:
            self._inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta).to(x.device)
        cos, sin = rope_cos_sin(q_pos, self._inv_freq, x.dtype)  # [B|1, t, Dh]
        h, keys, values = self.input_proj(x), [], []
        for i, m in enumerate(self.layers):
            pk, pv = (None if past is None else past[i] for past in (past_k, past_v))
            h, k, v = m(h, cos, sin, mask, pk, pv) if layer is None else layer(m, h, cos, sin, mask, pk, pv)
            keys.append(k)
            values.append(v)
        return self.output_proj(self.norm(h)), keys, values


# ---------------------------------------------------------------------------------------------------
# The decoder and its streaming state.


@dataclass(slots=True)
class Code2WavState:
    """What a stream carries between `decode_step` calls; row b is one request (slot).

    Code2Wav never mutates a state in place: decode_step returns a new one, so an
    old state stays a valid snapshot (e.g. to retry a chunk). Only its owner writes into it (assign_rows_).
    """

    tails: list[Tensor]  # per stateful conv i: [B, context_i, C_in_i] its last inputs (zeros at start)
    keys: Tensor  # [L, B, H_kv, W-1, Dh] rotated keys of each row's last W-1 frames per layer, oldest first
    values: Tensor  # [L, B, H_kv, W-1, Dh]
    pos: Tensor  # [B] int64 frames decoded so far per row = RoPE position of its next frame
    frames_processed: int = 0  # frames run through the pre_transformer by decode_step, summed (diagnostics)

    @property
    def batch_size(self) -> int:
        return self.pos.shape[0]

    def select_rows(self, idx: Tensor) -> Code2WavState:
        """The state of rows idx ([n] int64) only."""
        return Code2WavState([t[idx] for t in self.tails], self.keys[:, idx], self.values[:, idx],
                             self.pos[idx], self.frames_processed)

    def assign_rows_(self, idx: Tensor, src: Code2WavState) -> None:
        """In place: rows idx ([n] int64) := the rows of src (e.g. a request warmed on its own). The one
        mutation of a state, for a pool whose tensors must keep their addresses (CUDA graphs read them)."""
        for dst, s in zip(self.tails, src.tails):
            dst.index_copy_(0, idx, s)
        self.keys.index_copy_(1, idx, src.keys)
        self.values.index_copy_(1, idx, src.values)
        self.pos.index_copy_(0, idx, src.pos)


class Code2Wav(nn.Module):
    """The 12 Hz speech-tokenizer decoder.

    Args:
        cfg: `decoder_config` of `speech_tokenizer/config.json`.
    """

    def __init__(self, cfg: Code2WavConfig):
        super().__init__()
        self.cfg = cfg
        self.total_upsample = cfg.total_upsample  # waveform samples per frame (1920)
        self.pre_transformer = Transformer(cfg)
        self.quantizer = SplitResidualVectorQuantizer(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(cfg.latent_dim, cfg.latent_dim, f, f), ConvNeXtBlock(cfg.latent_dim)])
            for f in cfg.upsampling_ratios)
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        self.decoder = nn.ModuleList([
            CausalConv(cfg.latent_dim, cfg.decoder_dim, 7),
            *(DecoderBlock(cfg, i) for i in range(len(cfg.upsample_rates))),
            SnakeBeta(out_dim),
            CausalConv(out_dim, 1, 7),
        ])
        # A plain list (not registered): the layers that carry a tail, numbered into Code2WavState.tails.
        self._stateful = [m for m in self.modules() if isinstance(m, (CausalConv, CausalTransConv)) and m.context > 0]
        for i, m in enumerate(self._stateful):
            m.state_idx = i

    def _check(self, codes: Tensor) -> None:
        if codes.dim() != 3 or codes.shape[1] != self.cfg.num_quantizers or codes.shape[2] < 1:
            raise ValueError(f"codes must be [B, {self.cfg.num_quantizers}, T >= 1], got {tuple(codes.shape)}")

    def _vocode(self, h: Tensor, tails: list[Tensor] | None) -> Tensor:
        # h: [B, t, latent] transformer output -> wav [B, t * 1920]
        for up, block in self.upsample:
            h = block(up(h, tails), tails)  # [B, t * prod(upsampling_ratios so far), latent]
        for m in self.decoder[:-2]:
            h = m(h, tails)
        h = self.decoder[-1](h, tails, self.decoder[-2])  # the last SnakeBeta and conv -> [B, t * 1920, 1]
        return h[..., 0].clamp(-1, 1)

    def forward(self, codes: Tensor) -> Tensor:
        """One full-context decode (upstream `forward`). codes: [B, K, T] int64 -> wav [B, T*1920]."""
        self._check(codes)
        pos = torch.arange(codes.shape[2], device=codes.device)[None]  # [1, T]
        h = self.pre_conv(self.quantizer.decode(codes))  # [B, T, latent]
        return self._vocode(self.pre_transformer(h, pos, pos)[0], None)

    @torch.no_grad()
    def chunked_decode(self, codes: Tensor, chunk_size: int = 300, left_context_size: int = 25) -> Tensor:
        """Upstream's approximation: chunks of chunk_size frames, each decoded from scratch (positions
        from 0) with up to left_context_size frames in front whose audio is dropped.
        codes: [B, K, T] -> wav [B, T*1920]. Equals forward() for T <= chunk_size."""
        wavs, start, T = [], 0, codes.shape[2]
        while start < T:
            end = min(start + chunk_size, T)
            # upstream's rule verbatim (it amounts to min(start, left_context_size))
            context = left_context_size if start - left_context_size > 0 else start
            wavs.append(self(codes[..., start - context:end])[:, context * self.total_upsample:])
            start = end
        return torch.cat(wavs, dim=-1)

    @torch.no_grad()
    def decode_batch(self, codes_list: list[Tensor]) -> list[Tensor]:
        """Upstream `Qwen3TTSTokenizerV2Model.decode`: pad with -1 into one batch, clamp to 0,
        chunked_decode, trim each item to (its frames with code 0 > -1) * 1920 samples.
        codes_list: [T_i, K] int64 each -> [T_i * 1920] each."""
        if not codes_list:
            raise ValueError("decode_batch needs at least one item")
        codes = nn.utils.rnn.pad_sequence(codes_list, batch_first=True, padding_value=-1)  # [B, T_max, K]
        lengths = ((codes[..., 0] > -1).sum(1) * self.total_upsample).tolist()
        wav = self.chunked_decode(codes.clamp(min=0).transpose(1, 2))  # [B, T_max * 1920]
        return [w[:n] for w, n in zip(wav, lengths)]

    # -- exact streaming ------------------------------------------------------------------------

    def init_state(self, batch_size: int, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> Code2WavState:
        """A fresh state: zero conv tails (= upstream's zero padding), empty KV cache, positions 0."""
        c = self.cfg
        tails = [torch.zeros(batch_size, m.context, m.conv.in_channels, device=device, dtype=dtype)
                 for m in self._stateful]
        kv_shape = (c.num_hidden_layers, batch_size, c.num_key_value_heads, c.sliding_window - 1, c.head_dim)
        return Code2WavState(tails, torch.zeros(kv_shape, device=device, dtype=dtype),
                             torch.zeros(kv_shape, device=device, dtype=dtype),
                             torch.zeros(batch_size, dtype=torch.int64, device=device))

    @torch.no_grad()
    def decode_step(self, codes: Tensor, state: Code2WavState, layer=None) -> tuple[Tensor, Code2WavState]:
        """Decode the next t frames of every row exactly as `forward` on each row's whole history would.

        Args:
            codes: [B, K, t] int64, t >= 1 (may change from call to call).
            state: from init_state / a previous call; not modified.
            layer: the pre-transformer's layers' forward (the engine's compiled TransformerLayer.forward), or None.
        Returns:
            wav [B, t*1920] (final: later frames never change it) and the new state.
        """
        self._check(codes)
        if codes.shape[0] != state.batch_size:
            raise ValueError(f"codes have {codes.shape[0]} rows, the state has {state.batch_size}")
        t, P = codes.shape[2], self.cfg.sliding_window - 1
        tails = list(state.tails)  # the convs replace their own entries; state.tails stays as it was
        h = self.pre_conv(self.quantizer.decode(codes), tails)  # [B, t, latent]
        # positions of the P cached keys then the t new frames; a negative one is an empty cache slot
        k_pos = state.pos[:, None] + torch.arange(-P, t, device=codes.device)  # [B, P + t]
        h, keys, values = self.pre_transformer(h, k_pos[:, P:], k_pos, state.keys, state.values, layer)
        wav = self._vocode(h, tails)
        new = Code2WavState(tails, torch.stack([k[:, :, t:] for k in keys]),  # keep the last P of P + t
                            torch.stack([v[:, :, t:] for v in values]), state.pos + t, state.frames_processed + t)
        return wav, new
