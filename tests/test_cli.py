"""The command line end to end on tiny checkpoints (CPU)."""

import json
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
    from tests.inputs.test_voice import MANIFEST, clip
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


# --------------------------------------------------------------------------- streaming output, input, voices
import io  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def samples(path) -> np.ndarray:
    with wave.open(str(path)) as f:
        return np.frombuffer(f.readframes(f.getnframes()), "<i2")


def say_args(out, *extra, frames=8):
    return ["say", "--model", str(fx.checkpoint("cv06")), "-o", str(out), "--speaker", "ryan", "--greedy",
            "--max-new-tokens", str(frames + 1), *extra]


def test_text_from_stdin_and_file_equals_the_argument(tmp_path, monkeypatch):
    text = "Text from somewhere else."
    assert main(say_args(tmp_path / "arg.wav", text)) == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO(text + "\n"))
    assert main(say_args(tmp_path / "dash.wav", "-")) == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))  # not a terminal and no text argument: read it
    assert main(say_args(tmp_path / "piped.wav")) == 0
    (tmp_path / "t.txt").write_text(text + "\n", encoding="utf-8")
    assert main(say_args(tmp_path / "file.wav", "--text-file", str(tmp_path / "t.txt"))) == 0
    ref = samples(tmp_path / "arg.wav")
    assert len(ref) == 8 * 1920  # greedy: the same text gives the same audio, whichever way it came in
    for name in ("dash", "piped", "file"):
        assert np.array_equal(samples(tmp_path / f"{name}.wav"), ref), name


def test_text_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("   \n"))
    assert main(say_args(tmp_path / "x.wav", "-")) == 2
    assert "the text is empty" in capsys.readouterr().err
    assert main(say_args(tmp_path / "x.wav", "both", "--text-file", "f.txt")) == 2
    assert "not both" in capsys.readouterr().err


class FakeSoundDevice:
    """sounddevice's OutputStream as the Player uses it, recording what it is given."""

    played: list = []

    class OutputStream:
        def __init__(self, samplerate, channels, dtype):
            assert (samplerate, channels, dtype) == (24000, 1, "float32")

        def start(self):
            pass

        def write(self, block):
            assert block.shape[1] == 1 and block.dtype == np.float32
            FakeSoundDevice.played.append(block[:, 0].copy())

        def stop(self):
            pass

        def close(self):
            pass


def test_play_sends_every_chunk_to_the_device(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sounddevice", None)  # not installed -> a clear message
    assert main(say_args(tmp_path / "p.wav", "Played.", "--play")) == 2
    assert "pip install 'q3tts[play]'" in capsys.readouterr().err
    FakeSoundDevice.played = []
    monkeypatch.setitem(sys.modules, "sounddevice", FakeSoundDevice)
    assert main(say_args(tmp_path / "p.wav", "Played.", "--play")) == 0
    played = np.concatenate(FakeSoundDevice.played)
    from q3tts.audio import to_s16
    # the device got the float chunks the file was written from (the file holds them rounded to 16 bits)
    assert len(FakeSoundDevice.played) > 1 and np.array_equal(to_s16(played), samples(tmp_path / "p.wav"))


def _cli(args, **kw):
    return subprocess.Popen([sys.executable, "-m", "q3tts.cli", *args], cwd=ROOT, stdin=subprocess.DEVNULL, **kw)


def test_progress_line():
    from q3tts.cli_media import Progress
    p = Progress(label="say", total_s=3.2, stream=io.StringIO(), width=8)
    # 1 s of 3.2 s made in 0.5 s: 2x real time, 2.2 s of audio left -> 1.1 s of wall time at that rate
    assert p.line(1.0, 0.5) == "say  [##......]  31%    1.00 s audio   2.00x real time  <= 1.1 s left"
    assert Progress(stream=io.StringIO()).line(0.0, 2.0) == "  0.00 s audio    2.0 s"
    quiet = Progress(total_s=1.0, stream=io.StringIO())  # StringIO is no terminal: nothing is drawn
    quiet.update(0.5, force=True)
    quiet.stage("loading")
    quiet.close()
    assert quiet.stream.getvalue() == "" and quiet.first_s is not None


def _read_all(master: int) -> bytes:
    out = b""
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        out += data
    os.close(master)
    return out


def test_progress_on_a_terminal(tmp_path):
    import pty
    master, slave = pty.openpty()
    p = _cli(say_args(tmp_path / "t.wav", "Progress on a terminal.", frames=20), stdout=subprocess.DEVNULL,
             stderr=slave)
    os.close(slave)
    try:
        out = _read_all(master)
        assert p.wait(timeout=240) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = out.decode()
    lines = [seg for seg in text.replace("\n", "\r").split("\r") if "s audio" in seg]
    assert lines, text
    last = lines[-1]  # the final redraw: the whole length, as a bar at 100% (20 frames = 1.6 s)
    assert "[########################] 100%" in last and "1.60 s audio" in last and "x real time" in last, last
    assert "\x1b[K" in text and "wrote " in text



def test_no_progress_when_stderr_is_not_a_terminal(tmp_path, capsys):
    assert main(say_args(tmp_path / "p.wav", "No progress into a pipe.", frames=20)) == 0
    err = capsys.readouterr().err  # pytest's capture is no terminal, as a pipe or a file is not
    assert "\r" not in err and "\x1b" not in err and "s audio" not in err
    assert err.startswith("wrote ") and "1.60 s of audio" in err, err


def _data_frames(path) -> int:
    try:
        with wave.open(str(path)) as f:
            return f.getnframes()
    except (wave.Error, EOFError, FileNotFoundError):
        return 0


def _interrupt(args, out, sig):
    """Run the CLI with args, send sig once the WAV at out holds 3 frames (chunks of 1 and 2 frames written:
    chunks double from 1 frame); -> (the process, its stderr bytes). The CLI starts with SIGINT's default action, as
    from a terminal: a test run started in the background (a non-interactive shell's `cmd &`) ignores SIGINT, and a
    child would inherit that and never see the Ctrl-C this test sends."""
    p = _cli(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 240
        while _data_frames(out) < 3 * 1920:
            assert p.poll() is None and time.time() < deadline, "no audio written"
            time.sleep(0.05)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_interrupted_say_keeps_a_valid_wav(tmp_path, sig):
    out = tmp_path / "long.wav"
    # 2000 frames: minutes on CPU, so the run is stopped long before it ends
    p, err = _interrupt(say_args(out, "A long text that is interrupted.", frames=2000), out, sig)
    n = _data_frames(out)
    size = os.path.getsize(out)
    # a valid file: the header's sizes cover whole frames that are all in the file
    assert n >= 3 * 1920 and n % 1920 == 0 and 44 + 2 * n <= size
    assert n < 2000 * 1920
    if sig == signal.SIGINT:
        assert p.returncode == 130 and f"interrupted: kept {n / 24000:.2f} s of audio" in err.decode()
        assert size == 44 + 2 * n  # closed cleanly: nothing after the counted data
    else:
        assert p.returncode == -signal.SIGKILL


def test_voices_in_a_local_directory(tmp_path, capsys):
    from tests.server.test_voices import REF_TEXT, reference_wav
    clip = tmp_path / "ref.wav"
    clip.write_bytes(reference_wav())
    ckpt = str(fx.checkpoint("base06"))
    vdir = str(tmp_path / "voices")
    local = ["--voice-dir", vdir, "--model", ckpt]
    assert main(["voices", "add", "carol", "--ref-audio", str(clip), "--ref-text", REF_TEXT, *local]) == 0
    vid = capsys.readouterr().out.strip()
    assert vid.startswith("voice_")
    assert main(["voices", "list", "--json", *local]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(v["id"], v["name"], v["mode"]) for v in listed] == [(vid, "carol", "icl")]
    out = tmp_path / "c.wav"
    assert main(["say", "By name.", "--model", ckpt, "--voice", "carol", "--voice-dir", vdir, "-o", str(out),
                 "--greedy", "--max-new-tokens", "6"]) == 0 and frames_in(out) == 5
    assert main(["voices", "add", "carol", "--ref-audio", str(clip), "--x-vector-only", *local]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["voices", "delete", "carol", *local]) == 0
    assert main(["voices", "list", *local]) == 0
    assert "(no voices)" in capsys.readouterr().err
    assert main(["voices", "delete", "carol", *local]) == 2
    assert "no voice 'carol'" in capsys.readouterr().err


# --------------------------------------------------------------------------- a newcomer's first commands
def test_readme_commands_run_offline(tmp_path):
    """The README's first command, as written there, on a fresh directory with the hub unreachable: a tiny
    checkpoint, then speech from it (the tiny model stops by itself)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("q3tts make-checkpoint --tiny"))
    cmd = re.sub(r"\bq3tts ", f"{sys.executable} -m q3tts.cli ", line)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = next(tmp_path.glob("*.wav"))
    assert 2 <= frames_in(out) < 255, frames_in(out)  # EOS, not the length cap


@pytest.mark.parametrize("model_type", ["custom_voice", "base", "voice_design"])
def test_tiny_checkpoints_of_every_type_stop_by_themselves(tmp_path, model_type):
    import torch

    from q3tts import TTS, VoiceClonePromptItem
    assert main(["make-checkpoint", "--tiny", "--model-type", model_type, str(tmp_path / "m")]) == 0
    tts = TTS.from_pretrained(tmp_path / "m", device="cpu", dtype=torch.float32)
    assert tts.tts_model_type == model_type
    texts = ["Hello.", "The quick brown fox jumps over the lazy dog.", "你好，世界。"]
    for greedy in (True, False):
        kw = {"do_sample": False, "subtalker_dosample": False} if greedy else {"seed": 0}
        if model_type == "custom_voice":
            prepared = tts.prepare_custom_voice(texts, "vivian", **kw)
        elif model_type == "voice_design":
            prepared = tts.prepare_voice_design(texts, "A calm voice.", **kw)
        else:
            item = VoiceClonePromptItem(ref_code=None, ref_spk_embedding=torch.randn(tts.cfg.talker.hidden_size,
                                        generator=torch.Generator().manual_seed(0)), x_vector_only_mode=True,
                                        icl_mode=False)
            prepared = tts.prepare_voice_clone(texts, voice_clone_prompt=[item], **kw)
        frames = [c.shape[0] for c in tts.generate_codes(prepared)]
        assert all(2 <= f < 255 for f in frames), (greedy, frames)  # generation_config caps at 256 - 1


def test_one_line_errors(tmp_path, capsys, monkeypatch):
    """Every load failure, a missing extra, a device that is not there and a command on the wrong model type:
    one line on stderr, exit status 2, no traceback."""
    import sys

    import torch
    cv = str(fx.checkpoint("cv06"))
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cases = [
        (["say", "Hi", "--model", str(tmp_path / "missing")], "not a model directory"),
        (["serve", "--model", str(tmp_path / "missing"), "--no-warmup"], "not a model directory"),
        (["serve", "--model", str(tmp_path / "empty")], "incomplete checkpoint, missing: config.json"),
        (["serve", "--model", "nobody/no-such-model"], "could not find model 'nobody/no-such-model'"),
        (["design", "Hi", "--instruct", "Calm.", "--model", cv], "q3tts design needs a VoiceDesign model"),
        (["say", "Hi", "--model", cv, "--voice", "me.safetensors"], "--voice takes a cloned voice, which needs a Base"),
        (["say", "Hi", "--model", cv, "--instruct", "Happily."], "instruct is not supported: this is a CustomVoice"),
        (["make-checkpoint", str(tmp_path / "x")], "make-checkpoint writes --tiny checkpoints"),
    ]
    if not torch.cuda.is_available():
        cases += [(["say", "Hi", "--model", cv, "--device", "cuda"], "--device cuda: this PyTorch has no CUDA GPU"),
                  (["serve", "--model", cv, "--device", "cuda"], "--device cuda: this PyTorch has no CUDA GPU")]
    for argv, words in cases:
        assert main([*argv[:2], "-o", str(tmp_path / "o.wav"), *argv[2:]] if argv[0] in ("say", "design")
                    else argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("q3tts: error: ") and words in err[0], (argv, err)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if the [serve] extra were not installed
    assert main(["serve", "--model", cv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["q3tts: error: q3tts serve needs the server's packages: pip install 'q3tts[serve]' "
                   "(missing: fastapi)"], err


def test_serve_on_a_taken_port_exits_3(capfd):
    """The port already bound: uvicorn logs the bind error and `q3tts serve` exits with uvicorn's status for a start
    that failed (3), not 0."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--model", str(fx.checkpoint("cv06")), "--port", str(port), "--device", "cpu",
                  "--no-warmup", "--max-seq-len", "256"])
    assert exited.value.code == 3 and "address already in use" in capfd.readouterr().err


def test_say_splits_a_text_of_several_sentences(tmp_path, capsys):
    """--text-file of three sentences: three segments (each max-new-tokens - 1 frames) with --pause-ms between
    them by default; --split none: one request."""
    story = tmp_path / "chapter.txt"
    story.write_text("The first sentence of the chapter. The second one follows it!\n\nA new paragraph starts here.",
                     encoding="utf-8")
    out = tmp_path / "chapter.wav"
    args = ["say", "--text-file", str(story), "--model", str(fx.checkpoint("cv06")), "-o", str(out), "--greedy",
            "--max-new-tokens", "6"]
    assert main([*args, "--pause-ms", "80"]) == 0 and frames_in(out) == 3 * 5 + 2  # 80 ms = one frame
    assert main([*args, "--split", "clause"]) == 0 and frames_in(out) == 3 * 5
    assert main([*args, "--split", "none"]) == 0 and frames_in(out) == 5
    assert main([*args, "--split", "sentence", "--pause-ms", "-5"]) == 2
    assert "pause_ms must be an integer" in capsys.readouterr().err


def test_interrupted_split_say_keeps_a_valid_wav(tmp_path):
    out = tmp_path / "long.wav"
    p, err = _interrupt(say_args(out, "A long text. Of several sentences, all of them. Interrupted early!",
                                 frames=2000), out, signal.SIGINT)
    n = _data_frames(out)
    assert n >= 3 * 1920 and n % 1920 == 0 and os.path.getsize(out) == 44 + 2 * n and n < 2000 * 1920
    assert p.returncode == 130 and f"interrupted: kept {n / 24000:.2f} s of audio" in err.decode()
