"""`q3tts warmup` and `q3tts serve --load-artifact`: their flags and their refusals (the artifact itself:
tests/engine/test_artifact.py)."""

import pytest

from q3tts.cli import main
from q3tts.server.settings import parse_args


def test_load_artifact_flag_and_environment(tmp_path):
    f = tmp_path / "engine.q3c"
    f.write_bytes(b"x")
    assert parse_args([], environ={}).compile_artifact is None
    assert parse_args(["--load-artifact", str(f)], environ={}).compile_artifact == str(f)
    assert parse_args([], environ={"Q3TTS_COMPILE_ARTIFACT": str(f)}).compile_artifact == str(f)


def test_a_missing_artifact_is_refused_before_the_model_loads(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--load-artifact", str(tmp_path / "nope.q3c")], environ={})
    assert e.value.code == 2
    assert "nope.q3c: no such file (write one with `q3tts warmup --save FILE`)" in capsys.readouterr().err


def test_warmup_refuses_save_and_load_together(capsys):
    assert main(["warmup", "--save", "a.q3c", "--load", "b.q3c"]) == 2
    assert "--save and --load exclude each other" in capsys.readouterr().err


def test_warmup_help_names_its_flags(capsys):
    assert main(["warmup", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--save FILE" in out and "--load FILE" in out and "serve" in out
