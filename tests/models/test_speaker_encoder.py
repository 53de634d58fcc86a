"""Speaker encoder + mel front end vs the official ones (fixtures: tests/golden/make_golden_voice.py).

The fixtures were made on one CPU; on another, torch.stft's FFT (MKL / pocketfft, other SIMD widths)
rounds differently, so the log-mel is compared against an error bound derived per element
(`log_mel_bound`), not a fixed number."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from q3tts.config import SpeakerEncoderConfig
from q3tts.models.speaker_encoder import SpeakerEncoder, mel_filterbank, mel_spectrogram
from tests.golden.voice import CLIPS, MANIFEST, clip24, cloner, outputs

U = 2.0 ** -24  # float32 unit roundoff
RESAMPLE_TOL = 1e-6  # our 24 kHz resampling vs librosa's, per sample (test_resampled_waveform_matches_librosa)
SPK_REL_TOL = 1e-4


def test_mel_filterbank_equals_librosa():
    ours, ref = mel_filterbank(24000, 1024, 128, 0.0, 12000.0), outputs()["mel_filterbank"].numpy()
    assert ours.shape == ref.shape == (128, 513) and ours.dtype == np.float32
    # librosa builds the filterbank in float64 and casts to float32, as we do: the same float64 values round to
    # the same float32 ones, except where a few float64 ulps of difference (other libm) straddle a float32
    # rounding boundary: one float32 ulp of weights < 0.01, i.e. < 2^-30 ~ 9.3e-10
    assert np.abs(ours - ref).max() <= 1e-9


@pytest.mark.parametrize("size", ["0b6", "1b7"])
def test_checkpoint_names_and_shapes_of_real_configs(size):
    """Module names = checkpoint keys (`speaker_encoder.` stripped), shapes as the official class builds them."""
    enc_dim = {"0b6": 1024, "1b7": 2048}[size]
    with torch.device("meta"):
        ours = {k: list(v.shape) for k, v in SpeakerEncoder(SpeakerEncoderConfig(enc_dim=enc_dim)).state_dict().items()}
    assert ours == MANIFEST["real_speaker_encoder_shapes"][size]


def log_mel_bound(wav: torch.Tensor, mel: torch.Tensor, ref: torch.Tensor, n_fft: int = 1024, hop: int = 256,
                  floor: float = 1e-5) -> torch.Tensor:
    """|ours - official| allowed per log-mel element [n_mels, frames] when both run in float32 on any CPUs.

    m = M @ |X|, X = FFT(window * frame). Two float32 evaluations differ, each from the exact value, by:
    - the FFT: ||dX||_2 <= log2(n) eta / (1 - log2(n) eta) ||X||_2 (Higham, Accuracy and Stability of
      Numerical Algorithms, Thm 24.2, radix-2 Cooley-Tukey; eta = u + gamma_4 (sqrt 2 + u) with twiddles
      exact to u), and ||X||_2 = sqrt(n) ||window * frame||_2 (Parseval). The error of one bin is only
      bounded by the norm of the whole frame's error: quiet bins next to loud ones get large relative error.
      The inputs also differ by up to RESAMPLE_TOL per sample: ||dX||_2 <= sqrt(n) ||window||_2 RESAMPLE_TOL.
    - |X_k| = sqrt(re^2 + im^2 + 1e-9): at most |dX_k| plus 2u relative.
    - the mel matmul over nonnegative terms: relative error <= gamma_nnz (nnz = nonzero weights in the row;
      adding exact zeros rounds nothing), and by Cauchy-Schwarz sum_k M_jk |dX_k| <= ||M_j||_2 ||dX||_2.
    - log: d log m = dm / m (mean value theorem: over [min, max] of the two, clamped to the floor, so the
      floor region is covered: where one side is clamped the bound uses the floor), plus one ulp of |log m|
      <= 11.6 (2^-20) for the rounded log itself.
    Each term is doubled (ours and the official each differ from the exact value)."""
    n = n_fft
    M = torch.from_numpy(mel_filterbank(24000, n, mel.shape[0], 0.0, 12000.0).copy()).double()  # [n_mels, n/2+1]
    pad = (n - hop) // 2  # upstream's reflect padding
    y = torch.nn.functional.pad(wav.double()[None, None], (pad, pad), mode="reflect")[0, 0]
    window = torch.hann_window(n, dtype=torch.float64)
    frames = y.unfold(0, n, hop)[: mel.shape[1]] * window  # [frames, n]
    g = math.log2(n)
    eta = U + 4 * U / (1 - 4 * U) * (math.sqrt(2) + U)
    dX = (g * eta / (1 - g * eta)) * math.sqrt(n) * frames.norm(dim=1) \
        + math.sqrt(n) * window.norm() * RESAMPLE_TOL  # [frames]: bound on ||dX||_2, one side
    nnz = (M > 0).sum(1).double()
    rel = nnz * U / (1 - nnz * U) + 2 * U  # [n_mels]: matmul + magnitude, relative to m
    m_low = torch.minimum(mel, ref).double().exp().clamp(min=floor)  # the smaller energy, >= the floor
    return 2 * (rel[:, None] + M.norm(dim=1)[:, None] * dX[None, :] / m_low + 2.0 ** -20)


@pytest.mark.parametrize("clip", CLIPS)
def test_mel_features_match_official(clip):
    wav = torch.from_numpy(clip24(clip))
    mel = mel_spectrogram(wav[None])[0]
    ref = outputs()[f"{clip}.mel"]
    assert mel.shape == ref.shape
    bound = log_mel_bound(wav, mel, ref)
    excess = ((mel - ref).abs().double() - bound).max().item()
    assert excess <= 0, f"log-mel differs from the official by more than the rounding bound (by {excess:.2e})"
    # the bound is no blanket: the input shifted by one sample (an off-by-one padding) breaks it
    shifted = mel_spectrogram(torch.cat([wav[1:], wav[-1:]])[None])[0]
    assert ((shifted - ref).abs().double() > log_mel_bound(wav, shifted, ref)).any()


@pytest.mark.parametrize("clip", ["es16m", "es48s"])
def test_resampled_waveform_matches_librosa(clip):
    """librosa.resample (soxr_hq + length fix), 16 kHz up and 48 kHz down."""
    ref = outputs()[f"{clip}.wav24"].numpy()
    ours = clip24(clip)
    assert ours.shape == ref.shape
    # soxr's polyphase filter (float32, SIMD): each output is a dot product of ~n = 1e3 taps with |taps| summing
    # to ~1.1 and |x| <= 1: rounding <= n u sum|h||x| ~ 6.6e-5 worst case; SIMD lanes reorder the sum but
    # libsoxr's same code path runs on every CPU, and a random-walk bound sqrt(n) u ~ 2e-6 covers reordering
    # at the 1e-6 level the other tests assume (RESAMPLE_TOL)
    assert np.abs(ours - ref).max() <= 1e-6


@pytest.mark.parametrize("clip", CLIPS)
def test_speaker_embedding_matches_official(clip):
    emb = cloner().speaker_embedding(clip24(clip))
    ref = outputs()[f"{clip}.spk"]
    assert emb.shape == ref.shape and emb.dtype == torch.float32
    # the mel bound above (up to ~1e-2 in quiet bins, ~1e-3 in loud ones) goes through ECAPA's convolutions
    # and attentive statistics pooling, which averages over ~120 frames and 128 mels: the embedding's relative
    # error is the mel error weighted by energy, ~1e-4 at most (measured ~1.5e-7 where the mels agree to 0)
    assert ((emb - ref).norm() / ref.norm()).item() <= SPK_REL_TOL


def test_embedding_is_independent_of_batch_and_deterministic():
    enc = cloner().speaker_encoder
    w = clip24("es16m")
    a, b = enc.embed(w), enc.embed(w.copy())
    assert torch.equal(a, b)
    mels = mel_spectrogram(torch.from_numpy(w)[None]).transpose(1, 2)
    with torch.inference_mode():
        two = enc(torch.cat([mels, mels]))
    # the same input in a batch of 2: MKL/oneDNN may pick another convolution kernel (summation order) for
    # B=2; each of ~15 layers adds ~sqrt(n) u relative (n = C_in k <= 3 * 1536), ~4e-6 over the net: rtol 1e-5
    torch.testing.assert_close(two[1], a, atol=1e-6, rtol=1e-5)
