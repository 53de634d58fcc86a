"""bench/load/icl_voice.py against a live tiny Base server: the synthetic reference is a 5 s 24 kHz clip, the
server's upload route stores it as an ICL voice with its transcript, and bench/load/load.py's requests name that
voice and are answered in full (a voice the server did not hold would be a 400)."""

import json
import wave

import pytest

pytest.importorskip("aiohttp")

from bench.load import icl_voice, load
from tests.server.live import start_server


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    live = start_server("base06", tmp_path_factory.mktemp("voices-icl"))
    yield live
    live.stop()


def test_reference_is_five_seconds_of_24khz_mono(tmp_path):
    path = str(tmp_path / "ref.wav")
    assert icl_voice.reference_wav(path) == 5 * 24000
    with wave.open(path) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 24000, 5 * 24000)


def test_stored_icl_voice_serves_the_load(base, tmp_path):
    assert icl_voice.main(["--url", base.base_url, "--name", "icl", "--wav", str(tmp_path / "ref.wav")]) == 0
    (stored,) = base.http().get("/v1/audio/voices").json()["data"]
    assert (stored["name"], stored["mode"], stored["ref_text"]) == ("icl", "icl", icl_voice.REF_TEXT)
    # the name is taken now: the server's 409 is an error, not a second voice
    with pytest.raises(ValueError, match="already exists"):
        icl_voice.store_icl_voice(base.base_url, "icl", str(tmp_path / "again.wav"))

    out = tmp_path / "load.json"
    assert load.main(["--url", base.base_url, "--voice", "icl", "--concurrency", "2", "--requests", "1",
                      "--max-new-tokens", "5", "--text", "A short line.", "--no-warmup", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"]["tts_model_type"] == "base" and result["body"]["voice"] == "icl"
    (level,) = result["levels"]
    assert level["requests"] == 2 and level["errors"] == 0, level["error_samples"]
    assert level["audio_s"] > 0
