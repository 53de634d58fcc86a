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


def test_websocket_session_sends_the_words_in_audio_done(words_server):
    """LiveKit's word_timestamps=True config (timestamp_type word, transport sync): each utterance's audio.done
    carries timestamp_info.word_alignment (its words, in seconds from the utterance's start)."""
    from websockets.sync.client import connect

    url = words_server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "vivian", "language": "English",
                            "timestamp_type": "word", "timestamp_transport_strategy": "sync", "max_new_tokens": 12,
                            **GREEDY}))
        for piece in ("Hello th", "ere, good ", "morning."):
            ws.send(json.dumps({"type": "input.text", "text": piece}))
        ws.send(json.dumps({"type": "input.done"}))
        samples = 0
        while not isinstance(msg := ws.recv(timeout=60), str) or json.loads(msg)["type"] != "audio.done":
            samples += len(msg) // 2 if isinstance(msg, bytes) else 0
        align = json.loads(msg)["timestamp_info"]["word_alignment"]
        assert align["words"] == WORDS
        starts, ends = align["word_start_times_seconds"], align["word_end_times_seconds"]
        # (a tiny random aligner's times are arbitrary: their form is checked, their values by the HTTP tests)
        assert samples > 0 and len(starts) == len(ends) == len(WORDS) and starts == sorted(starts)
        assert all(0 <= s <= e for s, e in zip(starts, ends))
        assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
        ws.send(json.dumps({"type": "session.config", "voice": "vivian", "timestamp_type": "char"}))
        err = json.loads(ws.recv(timeout=30))
        assert err["code"] == "invalid_config" and "'word'" in err["message"]


def test_websocket_word_timestamps_in_a_trailing_audio_chunk(words_server):
    """vLLM-Omni's form (word_timestamps true in session.config): the utterance's PCM in JSON audio.chunk messages
    (base64, timestamps null, places in ms), then one with empty audio whose timestamps are its words in ms from
    its start; with stream_audio false the PCM is one audio.chunk."""
    from websockets.sync.client import connect

    url = words_server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url) as ws:
        for flush, stream_audio in enumerate((True, False)):
            ws.send(json.dumps({"type": "session.config", "voice": "vivian", "language": "English",
                                "word_timestamps": True, "stream_audio": stream_audio, "max_new_tokens": 12,
                                **GREEDY}))
            for piece in ("Hello th", "ere, good ", "morning."):
                ws.send(json.dumps({"type": "input.text", "text": piece}))
            ws.send(json.dumps({"type": "input.done"}))
            assert json.loads(ws.recv(timeout=60))["type"] == "audio.start"
            chunks = []
            while (m := json.loads(ws.recv(timeout=60)))["type"] == "audio.chunk":
                chunks.append(m)
            assert m["type"] == "audio.done" and m["finish_reason"] in ("stop", "length")
            assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
            *audio, last = chunks
            assert len(audio) >= 1 if stream_audio else len(audio) == 1
            assert [c["chunk_id"] for c in chunks] == list(range(len(chunks)))
            assert all(c["utterance_index"] == flush and c["sentence_index"] == 0 and c["sample_rate"] == 24000
                       for c in chunks)
            assert all(c["timestamps"] is None and c["audio_b64"] for c in audio)
            pcm = b"".join(base64.b64decode(c["audio_b64"]) for c in audio)
            assert len(pcm) == m["frames"] * 1920 * 2 > 0
            assert [c["chunk_start_ms"] for c in audio[1:]] == [c["chunk_end_ms"] for c in audio[:-1]]
            total_ms = round(len(pcm) / 2 * 1000 / 24000)
            assert audio[-1]["chunk_end_ms"] == last["chunk_end_ms"] == total_ms and last["chunk_start_ms"] == 0
            assert last["audio_b64"] == "" and [w["word"] for w in last["timestamps"]] == WORDS
            # (a tiny random aligner's times are arbitrary: their form is checked, their values by the HTTP tests)
            starts = [w["start_ms"] for w in last["timestamps"]]
            assert starts == sorted(starts) and all(0 <= w["start_ms"] <= w["end_ms"] for w in last["timestamps"])


def test_websocket_audio_past_what_the_aligner_takes_is_not_kept(words_server):
    """An utterance longer than the aligner aligns at once (its max_seconds, here lowered to 0.5 s): its audio is
    sent, not kept whole for the aligner, and alignment_failed says why; the session goes on."""
    from websockets.sync.client import connect

    aligner = words_server.app.state.serving.aligner.aligner
    old, aligner.max_seconds = aligner.max_seconds, 0.5
    url = words_server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    try:
        with connect(url) as ws:
            ws.send(json.dumps({"type": "session.config", "voice": "vivian", "language": "English",
                                "timestamp_type": "word", "max_new_tokens": 12, **GREEDY}))
            ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            ws.send(json.dumps({"type": "input.done"}))
            msgs = []
            while not msgs or msgs[-1].get("type") != "session.done":
                msg = ws.recv(timeout=60)
                msgs.append({"type": "pcm", "size": len(msg)} if isinstance(msg, bytes) else json.loads(msg))
    finally:
        aligner.max_seconds = old
    errors = [m for m in msgs if m["type"] == "error"]
    assert [e["code"] for e in errors] == ["alignment_failed"], msgs
    assert "(0.5 s): send input.done more often" in errors[0]["message"]  # the session stopped keeping it
    done = next(m for m in msgs if m["type"] == "audio.done")
    assert "timestamp_info" not in done and sum(m["size"] for m in msgs if m["type"] == "pcm") == done["frames"] * 3840


def test_http_word_timestamps_hold_the_response_whole_so_their_text_is_bounded(words_server):
    """word_timestamps keep the whole response for the aligner: a text over --max-unstreamed-text-length is refused
    before any work, streamed or not."""
    limit = words_server.app.state.settings.max_unstreamed_text_length
    text = "Word " * (limit // 5 + 1)
    with words_server.http() as c:
        r = c.post("/v1/audio/speech", json=dict(BODY, input=text, response_format="pcm", stream=True,
                                                 word_timestamps=True))
    assert r.status_code == 400 and "word timestamps" in r.json()["error"]["message"], r.text
