"""What a hostile or careless HTTP client tries (issue 32): a decompression bomb as a reference clip, cloning
floods, the API key in the logs, text that is not Unicode, JSON nested past any parser, options the model
cannot use; and non-streamed WAV / FLAC that other tools read back to the right length."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import threading
import time
import tracemalloc
import wave

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.test_audio import flac_bomb

from .live import GREEDY, SPF, SR
from .test_voices import REF_TEXT, reference_wav


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return flac_bomb()  # 8 channels, an hour of a constant signal, a few hundred KB


def _measured(fn):
    """fn() -> (its result, seconds, peak bytes Python allocated meanwhile, in every thread: the server's too)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = fn()
        return out, time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --------------------------------------------------------------------------- 1. bounded audio and cloning
def test_flac_bomb_upload_and_inline_reference_refused(base_server, bomb):
    assert len(bomb) < base_server.app.state.settings.max_upload_bytes
    with base_server.http() as h:
        r, seconds, peak = _measured(lambda: h.post(
            "/v1/audio/voices", files={"audio_sample": ("bomb.flac", bomb, "audio/flac")},
            data={"name": "bomb", "x_vector_only_mode": "true"}))
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_reference", r.text
        assert "8 channels" in r.json()["error"]["message"]
        # the bytes through the HTTP stack included; decoding them (~0.9 GB of float32) would blow both bounds
        assert peak < 50e6 and seconds < 5, (peak, seconds)
        data_url = "data:audio/flac;base64," + base64.b64encode(bomb).decode()
        r, seconds, peak = _measured(lambda: h.post("/v1/audio/speech", json={
            "input": "Hi.", "ref_audio": data_url, "x_vector_only_mode": True, "response_format": "pcm"}))
        assert r.status_code == 400 and "8 channels" in r.json()["error"]["message"], r.text
        assert peak < 50e6 and seconds < 5, (peak, seconds)
        assert h.get("/v1/audio/voices").json()["data"] == [] or all(
            v["name"] != "bomb" for v in h.get("/v1/audio/voices").json()["data"])


def test_clone_queue_answers_503_when_full():
    """A pool of one clone thread and one waiting place: the third clone at once is a 503 with Retry-After; a
    place frees when its job is done, not when its caller leaves."""
    from q3tts.server.protocol import ApiError
    from q3tts.server.voices import CloneQueue

    gate = threading.Event()
    q = CloneQueue(workers=1, max_waiting=1)

    async def main():
        first = asyncio.ensure_future(q.run(gate.wait))
        second = asyncio.ensure_future(q.run(lambda: "second"))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as e:
            await q.run(lambda: "third")
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
        assert e.value.info.code == "clone_queue_full"
        first.cancel()  # its caller leaves; its job still holds the thread, so its place stays taken
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError):
            await q.run(lambda: "third")
        gate.set()
        assert await second == "second"
        assert q.pending == 0 and await q.run(lambda: 3) == 3

    asyncio.run(main())


# --------------------------------------------------------------------------- 2. no key in the logs
class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_api_key_never_in_the_request_logs(cv_server):
    from websockets.sync.client import connect
    key = "sekret-key-123"
    settings = cv_server.app.state.settings
    loggers = [logging.getLogger(n) for n in ("uvicorn.access", "uvicorn.error")]
    levels = [lg.level for lg in loggers]
    cap = _Capture()
    settings.api_key = key
    try:
        for lg in loggers:
            lg.setLevel(logging.INFO)
            lg.addHandler(cap)
        ws_url = cv_server.base_url.replace("http", "ws") + "/v1/audio/speech/stream"
        with connect(f"{ws_url}?api_key={key}&x=1"):
            pass
        with pytest.raises(Exception):  # a wrong key: refused, and logged without it
            with connect(f"{ws_url}?api_key=wrong-{key}"):
                pass
        httpx.get(cv_server.base_url + f"/v1/models?api_key={key}&token={key}", headers={
            "Authorization": f"Bearer {key}"})
        time.sleep(0.2)  # the server thread logs after answering
    finally:
        settings.api_key = None
        for lg, level in zip(loggers, levels):
            lg.removeHandler(cap)
            lg.setLevel(level)
    logged = "\n".join(cap.lines)
    assert "/v1/audio/speech/stream?api_key=***&x=1" in logged, logged  # the lines were there...
    assert "/v1/models?api_key=***&token=***" in logged, logged
    assert key not in logged, logged  # ...without the key


# --------------------------------------------------------------------------- 3. text and JSON
SURROGATE = "Hello \\ud800 there"  # a JSON escape of a lone surrogate: valid JSON, not Unicode text


@pytest.mark.parametrize("field", ["input", "instructions", "voice", "language", "model"])
def test_lone_surrogates_are_a_400_naming_the_field(cv_server, field):
    body = {"input": "Hi.", "voice": "vivian", "response_format": "pcm", "max_new_tokens": 4}
    body[field] = "@@"
    raw = json.dumps(body).replace('"@@"', f'"{SURROGATE}"')
    with cv_server.http() as h:
        r = h.post("/v1/audio/speech", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "lone surrogate U+D800 at character 6" in err["message"], err


def test_lone_surrogates_in_voice_uploads_and_references(base_server):
    wav64 = base64.b64encode(reference_wav()).decode()
    with base_server.http() as h:
        for body, field in ((f'{{"name": "{SURROGATE}", "audio_sample": "{wav64}"}}', "name"),
                            (f'{{"name": "s", "audio_sample": "{wav64}", "ref_text": "{SURROGATE}"}}', "ref_text")):
            r = h.post("/v1/audio/voices", content=body, headers={"content-type": "application/json"})
            # this route parses with pydantic's own JSON parser, which refuses the escape itself
            assert r.status_code == 400 and "hex escape" in r.json()["error"]["message"], r.text
        r = h.post("/v1/audio/speech", content=f'{{"input": "Hi.", "ref_audio": "{wav64}", "ref_text": "{SURROGATE}"}}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ref_text", r.text


@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/audio/voices"])
def test_deeply_nested_json_is_a_400(cv_server, path):
    with cv_server.http() as h:
        for raw in ("[" * 100_000 + "]" * 100_000, '{"input": ' + "[" * 50_000 + "]" * 50_000 + "}",
                    '{"input": "Hi.", "voice": ' + '{"id": ' * 20_000 + '"x"' + "}" * 20_000 + "}"):
            r = h.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code in (400, 422), (path, raw[:20], r.status_code, r.text[:200])
            assert "error" in r.json()
        assert h.get("/health").status_code == 200


# --------------------------------------------------------------------------- 4. options the model cannot use
def _post(server, **body):
    with server.http() as h:
        return h.post("/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm", "max_new_tokens": 4,
                                                 **GREEDY, **body})


def test_options_the_model_cannot_use_are_refused(cv_server, base_server, vd_server):
    wav64 = base64.b64encode(reference_wav()).decode()
    cases = [
        (cv_server, {"voice": "vivian", "instructions": "Cheerfully."}, "instructions", "CustomVoice model (size 0b6)"),
        (cv_server, {"voice": "vivian", "ref_audio": wav64}, "ref_audio", "needs a Base model"),
        (cv_server, {"voice": "vivian", "ref_text": REF_TEXT}, "ref_text", "needs a Base model"),
        (cv_server, {"voice": "vivian", "x_vector_only_mode": True}, "x_vector_only_mode", "needs a Base model"),
        (vd_server, {"instructions": "A calm voice.", "ref_audio": wav64}, "ref_audio", "VoiceDesign model"),
        (base_server, {"ref_audio": wav64, "x_vector_only_mode": True, "instructions": "Slowly."}, "instructions",
         "Base model"),
    ]
    for server, body, param, words in cases:
        r = _post(server, **body)
        assert r.status_code == 400, (body.keys(), r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "unsupported_for_model", err
        assert err["message"].startswith(f"{param} is not supported") and words in err["message"], err
    # what the model can use still works: empty instructions are no instruction
    assert _post(cv_server, voice="vivian", instructions="  ").status_code == 200


# --------------------------------------------------------------------------- 5. lengths in the files
@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_non_streamed_wav_and_flac_state_their_lengths(cv_server, fmt):
    with cv_server.http() as h:
        r = h.post("/v1/audio/speech", json={"input": "Hello there.", "voice": "vivian", "response_format": fmt,
                                             "max_new_tokens": 9, "stream": False, **GREEDY})
        assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
        pcm = h.post("/v1/audio/speech", json={"input": "Hello there.", "voice": "vivian", "response_format": "pcm",
                                               "max_new_tokens": 9, **GREEDY}).content
        streamed = h.post("/v1/audio/speech", json={"input": "Hello there.", "voice": "vivian",
                                                    "response_format": fmt, "max_new_tokens": 9, **GREEDY}).content
    n = len(pcm) // 2
    assert n > 0 and n % SPF == 0
    audio, sr = sf.read(io.BytesIO(r.content), dtype="int16")
    assert sr == SR and len(audio) == n
    # lossless, the same greedy audio (ffmpeg's float -> 16-bit conversion may round the other way: 1 LSB)
    np.testing.assert_allclose(audio, np.frombuffer(pcm, "<i2"), rtol=0, atol=0 if fmt == "wav" else 1)
    if fmt == "wav":
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getnframes() == n and w.getframerate() == SR
        assert streamed[4:8] == b"\xff\xff\xff\xff"  # streamed: "until the end of the stream", as before
    else:
        assert sf.info(io.BytesIO(streamed)).frames >= 1 << 62  # streamed FLAC: length unknown, as before
