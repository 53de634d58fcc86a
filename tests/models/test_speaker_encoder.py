"""Speaker encoder + mel front end vs the official ones (fixtures: tests/golden/make_golden_voice.py).

Measured on the committed fixtures: filterbank and mel bit-identical (0.0), 24 kHz resampling
bit-identical, x-vector relative error ~1.5e-7."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from q3tts.config import SpeakerEncoderConfig
from q3tts.models.speaker_encoder import SpeakerEncoder, mel_filterbank, mel_spectrogram
from tests.golden.voice import CLIPS, MANIFEST, clip24, cloner, outputs

MEL_TOL = 1e-5
SPK_REL_TOL = 1e-4


def test_mel_filterbank_equals_librosa():
    ours, ref = mel_filterbank(24000, 1024, 128, 0.0, 12000.0), outputs()["mel_filterbank"].numpy()
    assert ours.shape == ref.shape == (128, 513) and ours.dtype == np.float32
    assert np.abs(ours - ref).max() <= 1e-9


@pytest.mark.parametrize("size", ["0b6", "1b7"])
def test_checkpoint_names_and_shapes_of_real_configs(size):
    """Module names = checkpoint keys (`speaker_encoder.` stripped), shapes as the official class builds them."""
    enc_dim = {"0b6": 1024, "1b7": 2048}[size]
    with torch.device("meta"):
        ours = {k: list(v.shape) for k, v in SpeakerEncoder(SpeakerEncoderConfig(enc_dim=enc_dim)).state_dict().items()}
    assert ours == MANIFEST["real_speaker_encoder_shapes"][size]


@pytest.mark.parametrize("clip", CLIPS)
def test_mel_features_match_official(clip):
    mel = mel_spectrogram(torch.from_numpy(clip24(clip))[None])[0]
    ref = outputs()[f"{clip}.mel"]
    assert mel.shape == ref.shape
    assert (mel - ref).abs().max().item() <= MEL_TOL


@pytest.mark.parametrize("clip", ["es16m", "es48s"])
def test_resampled_waveform_matches_librosa(clip):
    """librosa.resample (soxr_hq + length fix), 16 kHz up and 48 kHz down."""
    ref = outputs()[f"{clip}.wav24"].numpy()
    ours = clip24(clip)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-6


@pytest.mark.parametrize("clip", CLIPS)
def test_speaker_embedding_matches_official(clip):
    emb = cloner().speaker_embedding(clip24(clip))
    ref = outputs()[f"{clip}.spk"]
    assert emb.shape == ref.shape and emb.dtype == torch.float32
    assert ((emb - ref).norm() / ref.norm()).item() <= SPK_REL_TOL


def test_embedding_is_independent_of_batch_and_deterministic():
    enc = cloner().speaker_encoder
    w = clip24("es16m")
    a, b = enc.embed(w), enc.embed(w.copy())
    assert torch.equal(a, b)
    mels = mel_spectrogram(torch.from_numpy(w)[None]).transpose(1, 2)
    with torch.inference_mode():
        two = enc(torch.cat([mels, mels]))
    torch.testing.assert_close(two[1], a, atol=1e-6, rtol=1e-5)
