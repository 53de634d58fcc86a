"""word_timestamps on /v1/audio/speech against live servers (tiny CustomVoice + tiny aligner checkpoints, CPU): the
X-Word-Timestamps header, the SSE event after the audio, equal to aligning the response's audio alone; a clear 400
without --aligner."""

from __future__ import annotations

import base64
import json
from functools import lru_cache

import numpy as np
import pytest
import torch

from tests.golden import fixtures as fx
from tests.test_align import aligner

from .live import GREEDY, serve

TEXT = "Hello there, good morning."
WORDS = ["Hello", "there", "good", "morning"]
BODY = {"model": "tiny", "input": TEXT, "voice": "vivian", "language": "English", "max_new_tokens": 12, **GREEDY}


@pytest.fixture(scope="module")
def words_server(tmp_path_factory):
    from q3tts import TTS
    from q3tts.server.app import create_app
    from q3tts.server.settings import ServerSettings
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cpu", dtype=torch.float32, max_seq_len=256,
                              aligner=aligner())
    s = serve(create_app(tts, ServerSettings(model="tiny-cv06", max_concurrent=4, max_seq_len=256,
                                             voice_dir=str(tmp_path_factory.mktemp("voices-words")))), "uvicorn-words")
    yield s
    s.stop()


@lru_cache(maxsize=None)
def _expected(text: str = TEXT, language: str = "English", speed: float = 1.0) -> list[dict]:
    """The offline API's words for the same request (a TTS of its own: the server's engine is its loop's), in ms."""
    from q3tts import TTS
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cpu", dtype=torch.float32, max_seq_len=256,
                              aligner=aligner())
    _, _, words = tts.generate_custom_voice(text, speaker="vivian", language=language, word_timestamps=True,
                                            max_new_tokens=12, **GREEDY)
    return [dict(word=w.word, start_ms=round(w.start_s * 1000 / speed), end_ms=round(w.end_s * 1000 / speed))
            for w in words[0]]


def test_header_carries_the_words(words_server):
    with words_server.http() as c:
        r = c.post("/v1/audio/speech", json=dict(BODY, response_format="pcm", word_timestamps=True))
    assert r.status_code == 200, r.text
    words = json.loads(r.headers["X-Word-Timestamps"])
    assert [w["word"] for w in words] == WORDS
    assert all(set(w) == {"word", "start_ms", "end_ms"} and w["start_ms"] <= w["end_ms"] for w in words)
    assert words == _expected()


def test_header_is_ascii_for_any_text(words_server):
    with words_server.http() as c:
        r = c.post("/v1/audio/speech", json=dict(BODY, input="你好世界", language="Chinese", response_format="wav",
                                                 word_timestamps=True))
    assert r.status_code == 200, r.text
    assert [w["word"] for w in json.loads(r.headers["X-Word-Timestamps"])] == ["你", "好", "世", "界"]


def test_sse_event_after_the_audio(words_server):
    with words_server.http() as c:
        r = c.post("/v1/audio/speech", json=dict(BODY, response_format="pcm", stream_format="sse",
                                                 word_timestamps=True))
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[-2:] == ["speech.audio.word_timestamps", "speech.audio.done"]
    assert set(types[:-2]) == {"speech.audio.delta"}
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-2])
    assert events[-2]["words"] == _expected()


def test_without_the_flag_nothing_changes(words_server):
    with words_server.http() as c:
        r = c.post("/v1/audio/speech", json=dict(BODY, response_format="pcm"))
    assert r.status_code == 200 and "X-Word-Timestamps" not in r.headers


def test_without_an_aligner_it_is_a_400_naming_the_flag(cv_server):
    with cv_server.http() as c:
        r = c.post("/v1/audio/speech", json=dict(BODY, response_format="pcm", word_timestamps=True))
    assert r.status_code == 400
    err = r.json()["error"]
    assert "--aligner" in err["message"] and err["param"] == "word_timestamps"


def test_an_unalignable_language_is_a_400_before_synthesis(words_server):
    with words_server.http() as c:
        r = c.post("/v1/audio/speech", json=dict(BODY, input="안녕하세요", voice="sohee", language="Korean",
                                                 response_format="pcm", word_timestamps=True))
    assert r.status_code == 400
    assert "Korean" in r.json()["error"]["message"]
    words_server.wait_idle()


def test_speed_scales_the_times(words_server):
    with words_server.http() as c:
        r = c.post("/v1/audio/speech", json=dict(BODY, response_format="pcm", speed=2.0, word_timestamps=True))
    assert r.status_code == 200
    assert json.loads(r.headers["X-Word-Timestamps"]) == _expected(speed=2.0)


def test_utterance_words_for_the_websocket_forms(words_server):
    """The function the WebSocket session calls per utterance, and its two wire forms."""
    import asyncio

    from q3tts.server.serving import livekit_alignment, words_ms
    serving = words_server.app.state.serving
    wav, sr = np.sin(np.arange(24000) / 7).astype(np.float32) * 0.3, 24000
    words = asyncio.run(serving.utterance_words(wav, sr, "Hello there", "English"))
    assert words == aligner().align(wav, sr, "Hello there", "English")
    assert livekit_alignment(words) == {"words": ["Hello", "there"],
                                        "word_start_times_seconds": [w.start_s for w in words],
                                        "word_end_times_seconds": [w.end_s for w in words]}
    assert [w.model_dump() for w in words_ms(words)] == [
        dict(word=w.word, start_ms=round(w.start_s * 1000), end_ms=round(w.end_s * 1000)) for w in words]
    assert asyncio.run(serving.utterance_words(wav, sr, "...", "English")) == []
