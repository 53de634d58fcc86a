"""Generation defaults laid over a checkpoint's (`--generation-config`, `TTS.from_pretrained(generation_config=)`):
unknown fields and bad values are refused by name before the model loads; laid over, they are the defaults of
every call that does not send its own, so a greedy file gives the official greedy output with no sampling
arguments."""

import json

import numpy as np
import pytest
import torch

from q3tts.config import GenerationDefaults, generation_overrides, parse_generation_defaults
from tests.golden import fixtures as fx

CKPT = {"do_sample": True, "temperature": 0.9, "top_k": 50, "max_new_tokens": 8192, "transformers_version": "4.57"}


def test_overrides_laid_over_the_checkpoint(tmp_path):
    g = parse_generation_defaults(CKPT, {"do_sample": False, "temperature": 1, "top_k": 7})
    assert (g.do_sample, g.temperature, g.top_k, g.max_new_tokens) == (False, 1, 7, 8192)
    f = tmp_path / "gen.json"
    f.write_text(json.dumps({"subtalker_dosample": False, "top_p": 0.5}))
    g = parse_generation_defaults(CKPT, str(f))
    assert (g.subtalker_dosample, g.top_p, g.do_sample) == (False, 0.5, True)
    assert parse_generation_defaults(CKPT) == parse_generation_defaults(CKPT, {}) == GenerationDefaults(
        do_sample=True, temperature=0.9, top_k=50, max_new_tokens=8192)


@pytest.mark.parametrize("overrides,words", [
    ({"temprature": 0.5}, ["'temprature'", "accepted: do_sample, temperature"]),
    ({"do_sample": "no"}, ["do_sample", "boolean", "'no'"]),
    ({"top_k": 5.5}, ["top_k", "integer"]),
    ({"top_k": True}, ["top_k", "integer"]),
    ({"temperature": "hot"}, ["temperature", "number"]),
    ({"temperature": 0}, ["overrides", "temperature must be > 0, got 0"]),
    ({"top_p": 1.5}, ["top_p must be in (0, 1], got 1.5"]),
    ({"subtalker_top_k": -1}, ["subtalker_top_k must be >= 0"]),
    ({"max_new_tokens": 0}, ["max_new_tokens must be >= 1, got 0"]),
])
def test_bad_overrides_are_refused_by_name(overrides, words):
    with pytest.raises(ValueError) as e:
        parse_generation_defaults(CKPT, overrides)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_files_are_refused(tmp_path):
    for content, words in [("{nope", ["not valid JSON"]), ("[1, 2]", ["JSON object", "list"]),
                           ('{"seed": 3}', ["'seed'", "accepted"])]:
        f = tmp_path / "gen.json"
        f.write_text(content)
        with pytest.raises(ValueError) as e:
            generation_overrides(f)
        assert str(f) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ValueError, match="cannot read it"):
        generation_overrides(tmp_path / "missing.json")


def test_serve_flag_refuses_a_bad_file_before_loading(tmp_path, capsys):
    from q3tts.server.settings import parse_args
    f = tmp_path / "gen.json"
    f.write_text('{"temperature": -1}')
    with pytest.raises(SystemExit):
        parse_args(["--generation-config", str(f)], environ={})
    assert "temperature must be > 0" in capsys.readouterr().err
    f.write_text('{"do_sample": false, "top_k": 3}')
    settings = parse_args(["--model", str(fx.checkpoint("cv06")), "--device", "cpu", "--generation-config", str(f)],
                          environ={})
    from q3tts.server.app import load_model
    d = load_model(settings).ckpt.defaults  # what every request without sampling fields starts from
    assert (d.do_sample, d.top_k, d.subtalker_dosample) == (False, 3, True)


def test_greedy_defaults_give_the_official_output_with_no_sampling_arguments(tmp_path):
    """TTS.from_pretrained(generation_config=the fixtures' greedy settings), then a call with only the text,
    speaker and language: the official greedy audio (tests/test_parity.py's bound)."""
    from q3tts import TTS
    f = tmp_path / "greedy.json"
    f.write_text(json.dumps(fx.manifest("cv06")["greedy"]))
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cpu", dtype=torch.float32, max_batch_size=1,
                              generation_config=str(f))
    case = fx.get_case("cv06", "auto_nsm")
    wavs, _ = tts.generate_custom_voice(**case["kw"])
    ref = fx.outputs("cv06")["auto_nsm.wav.0"].numpy()
    assert wavs[0].shape == ref.shape and np.abs(wavs[0] - ref).max() <= 1e-4
    # a call's own arguments still win over the laid-over defaults
    assert tts.prepare_custom_voice("Hi.", "vivian", do_sample=True)[0].params.do_sample is True
    with pytest.raises(ValueError, match="top_p"):
        TTS.from_pretrained(fx.checkpoint("cv06"), device="cpu", generation_config={"top_p": 0})
