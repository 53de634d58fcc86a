"""The voice-cloning golden fixtures (tests/golden/make_golden_voice.py): clips, manifest, official outputs."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from q3tts.audio import load_audio, resample
from tests.golden import fixtures as fx

GOLDEN = Path(__file__).resolve().parent / "fixtures_voice"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
CLIPS = sorted(MANIFEST["clips"])


@lru_cache(maxsize=None)
def outputs() -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / "outputs.safetensors"))


def clip(name: str) -> str:
    """Path of a reference clip."""
    return str(GOLDEN / "clips" / MANIFEST["clips"][name]["file"])


@lru_cache(maxsize=None)
def clip24(name: str) -> np.ndarray:
    """A clip decoded and resampled to 24 kHz (what the encoders see)."""
    wav, sr = load_audio(clip(name))
    return resample(wav, sr)


def cloner():
    """The base06 TTS's own (cached) VoiceCloner: same checkpoint and config, CPU, float32."""
    return fx.tts("base06").voice_cloner()
