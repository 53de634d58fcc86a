"""The command line end to end on tiny checkpoints (CPU)."""

import wave

import pytest

from q3tts.cli import main
from tests.golden import fixtures as fx


def frames_in(path):
    with wave.open(str(path)) as f:
        assert f.getframerate() == 24000 and f.getnchannels() == 1 and f.getsampwidth() == 2
        return f.getnframes() / 1920


def test_say_writes_the_requested_frames(tmp_path):
    out = tmp_path / "hello.wav"
    rc = main(["say", "Hello from the command line.", "--model", str(fx.checkpoint("cv06")), "-o", str(out),
               "--speaker", "ryan", "--language", "english", "--seed", "1", "--max-new-tokens", "11"])
    assert rc == 0 and frames_in(out) == 10


def test_design_and_errors(tmp_path, capsys):
    out = tmp_path / "d.wav"
    assert main(["design", "Designed.", "--instruct", "A robot", "--model", str(fx.checkpoint("vd17")), "-o", str(out),
                 "--greedy", "--max-new-tokens", "6"]) == 0 and frames_in(out) == 5
    assert main(["say", "x", "--model", str(fx.checkpoint("cv06")), "--speaker", "nobody", "-o", str(out)]) == 2
    assert "Unsupported speaker 'nobody'" in capsys.readouterr().err
    assert main(["say", "x", "--model", str(tmp_path / "missing"), "-o", str(out)]) == 2


def test_clone_then_say_with_the_voice(tmp_path):
    from tests.test_voice import MANIFEST, clip
    case = next(c for c in MANIFEST["e2e"] if c["mode"] == "icl")
    voice = tmp_path / "v.safetensors"
    ckpt = str(fx.checkpoint("base06"))
    assert main(["clone", "--model", ckpt, "--ref-audio", clip(case["clip"]), "--ref-text",
                 case["kw"]["ref_text"], "--save", str(voice)]) == 0
    out = tmp_path / "c.wav"
    assert main(["say", "Cloned voice.", "--model", ckpt, "--voice", str(voice), "-o", str(out), "--greedy",
                 "--max-new-tokens", "8"]) == 0
    assert frames_in(out) == 7
    with pytest.raises(SystemExit):
        main(["clone", "--model", ckpt])  # --ref-audio and --save are required
