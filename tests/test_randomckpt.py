"""q3tts.randomckpt at the real dimensions: every model it can write has the names and shapes our modules load (checked
on the meta device: no gigabytes written)."""

import json

import pytest
import torch

from q3tts.config import parse_model_config, parse_speech_tokenizer_config
from q3tts.models.codec import Code2Wav
from q3tts.models.speaker_encoder import SpeakerEncoder
from q3tts.models.talker import Talker
from q3tts.randomckpt import MODELS, REFERENCE, read_shapes


def shapes_of(module: torch.nn.Module, prefix: str) -> dict[str, list[int]]:
    return {prefix + k: list(v.shape) for k, v in module.state_dict().items()}


@pytest.mark.parametrize("model", MODELS)
def test_shape_files_match_the_modules_we_load(model):
    """The talker (and a Base model's speaker encoder: x-vectors for cloning) built from the model's real config has
    exactly the tensors of its state_dict_shapes.tsv, so make_checkpoint writes what load_checkpoint reads."""
    cfg = parse_model_config(json.loads((REFERENCE / f"{model}.config.json").read_text()))
    with torch.device("meta"):
        want = shapes_of(Talker(cfg.talker), "talker.")
        if cfg.tts_model_type == "base":
            want.update(shapes_of(SpeakerEncoder(cfg.speaker_encoder), "speaker_encoder."))
    got = {k: v for k, (v, _) in read_shapes(REFERENCE / f"{model}.state_dict_shapes.tsv").items()}
    assert sorted(set(got) ^ set(want)) == []
    assert {k: v for k, v in got.items() if want[k] != v} == {}
    assert (cfg.tts_model_type == "base") == any(k.startswith("speaker_encoder.") for k in got)


def test_speech_tokenizer_shape_file_matches_the_decoder():
    """The 12 Hz tokenizer's decoder (Code2Wav) tensors are in the shared shape file (the encoder's too: cloning)."""
    speech = parse_speech_tokenizer_config(json.loads((REFERENCE / "speech_tokenizer.config.json").read_text()))
    with torch.device("meta"):
        want = shapes_of(Code2Wav(speech.decoder), "decoder.")
    got = {k: v for k, (v, _) in read_shapes(REFERENCE / "Qwen3-TTS-Tokenizer-12Hz.state_dict_shapes.tsv").items()}
    assert {k: (v, got.get(k)) for k, v in want.items() if got.get(k) != v} == {}
    assert any(k.startswith("encoder.") for k in got)
