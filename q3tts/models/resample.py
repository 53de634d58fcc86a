"""Resampling on the device, the same filter as the CPU's soxr ("soxr_hq", as q3tts.audio.resample).

For a rational ratio p/q (24 kHz -> 16 kHz: 2/3) soxr is a linear filter that repeats every q input and p output
samples: output p * Q + r reads inputs q * Q + j with a weight K_r[j]. Those weights are read off soxr itself (its
response to q impulses), so the device runs soxr's own filter: one FFT correlation of the rows with the p phases'
weights, in float64 (a few hundred taps; float64 FFTs keep the sums at soxr's float32 precision, and no TF32 flag
applies to them), read every q-th sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np
import torch
import torch.nn.functional as F

from ..audio import resample, resampled_length
from ..hostcopy import ints_to_device

MAX_PERIOD = 8  # q: input samples per filter period (24k -> 16k: 3; 44.1k -> 16k: 441, left to the CPU)


@dataclass(slots=True)
class Polyphase:
    orig_sr: int
    target_sr: int
    p: int  # output samples per period
    q: int  # input samples per period
    left: int  # K_r[j] for j in [-left, taps - left)
    weight: np.ndarray  # [p, taps] float64: output p * Q + r = sum_i weight[r, i] * x[q * Q + i - left]

    @classmethod
    def of(cls, orig_sr: int, target_sr: int) -> "Polyphase | None":
        """soxr's filter for orig_sr -> target_sr read off its impulse responses; None when the period is long
        (q > MAX_PERIOD) or the filter does not reproduce soxr (checked here on noise, at every length residue)."""
        g = gcd(orig_sr, target_sr)
        p, q = target_sr // g, orig_sr // g
        if q > MAX_PERIOD or orig_sr == target_sr:
            return None
        Q0 = 4096  # far from both ends: the filter's support is a few hundred samples
        n = 2 * Q0 * q
        k = {}
        for s in range(q):  # an impulse at input q * Q0 + s gives K_r[q * (Q0 - Q) + s] at output p * Q + r
            x = np.zeros(n, np.float32)
            x[q * Q0 + s] = 1.0
            y = resample(x, orig_sr, target_sr)
            for r in range(p):
                v = y[r::p]
                k[(r, s)] = (q * (Q0 - np.arange(v.shape[0])) + s, v.astype(np.float64))
        js = np.concatenate([j[np.abs(v) > 0] for j, v in k.values()])
        left, right = -int(js.min()), int(js.max())
        if left + right + 1 > Q0:
            return None
        weight = np.zeros((p, left + right + 1))
        for (r, _), (j, v) in k.items():
            keep = (j >= -left) & (j <= right)
            weight[r, j[keep] + left] = v[keep]
        f = cls(orig_sr, target_sr, p, q, left, weight)
        rng = np.random.default_rng(0)
        for m in range(3 * q, 5 * q):  # every residue of the length: soxr's output length and its ends
            x = rng.standard_normal(m * 37).astype(np.float32)
            want = resample(x, orig_sr, target_sr)
            got = f(torch.from_numpy(x)[None], [x.shape[0]])[0].numpy()
            if got.shape != want.shape or np.abs(got - want).max() > 1e-5:
                return None
        return f

    def out_len(self, n: int) -> int:
        """Samples q3tts.audio.resample returns for n (librosa's length, ceil)."""
        return resampled_length(n, self.orig_sr, self.target_sr)

    def __call__(self, rows: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """rows [B, L] float32 (row b's first lengths[b] samples, zeros after) -> [B, max out_len] float32, zeros past
        each row's out_len. NOTE(resample): as soxr, a row's samples before 0 and past its end count as zeros; its
        own output stops at round(n * p / q) samples and resample() pads the rest of the ceil length with zeros."""
        n_out = max(self.out_len(n) for n in lengths)
        return self.padded(rows, n_out, ints_to_device(self.ends(lengths), rows.device),
                           self.spectrum(rows.shape[1], n_out, rows.device))

    def ends(self, lengths: list[int]) -> list[int]:
        """Where each row's own output stops: round(n * p / q) (resample() zero-pads the ceil length past it)."""
        return [round(n * self.p / self.q) for n in lengths]

    def fft_len(self, L: int, n_out: int) -> int:
        """The correlation's FFT length for rows of L samples and n_out outputs: no wrap-around (t + i < n for every
        read)."""
        span = max(L + self.left, self.q * (-(-n_out // self.p) - 1) + self.weight.shape[1])  # the samples read
        return 1 << (span + self.weight.shape[1]).bit_length()

    def spectrum(self, L: int, n_out: int, device: torch.device) -> torch.Tensor:
        """The weights' conjugate spectrum [p, n // 2 + 1] complex128 that padded() multiplies rows of L samples by
        (n = fft_len): made once per shape by a caller that runs many (a graph's static input)."""
        return torch.fft.rfft(torch.from_numpy(self.weight).to(device), self.fft_len(L, n_out)).conj()

    def padded(self, rows: torch.Tensor, n_out: int, ends: torch.Tensor, spectrum: torch.Tensor) -> torch.Tensor:
        """__call__ with shapes that depend on rows' and n_out only (a CUDA graph's): ends [B] int64 on rows' device
        (ends(lengths)), n_out >= every row's out_len, spectrum(L, n_out) -> [B, n_out]."""
        B, L = rows.shape
        periods = -(-n_out // self.p)
        # z_r[t] = sum_i weight[r, i] * x[t + i - left], read at t = q * Q: a correlation, through one FFT of the rows
        n = self.fft_len(L, n_out)
        x = F.pad(rows.double(), (self.left, 0))
        z = torch.fft.irfft(torch.fft.rfft(x, n)[:, None] * spectrum, n)  # [B, p, n]
        y = z[..., :self.q * periods:self.q]  # [B, p, periods]
        y = y.transpose(1, 2).reshape(B, -1)[:, :n_out].float()
        return y * (torch.arange(n_out, device=rows.device)[None, :] < ends[:, None])
