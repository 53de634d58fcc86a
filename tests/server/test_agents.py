"""The voice-agent stacks' own clients against a live server, driven without a room or pipeline (their TTS classes
called directly in asyncio): LiveKit's Qwen3-TTS client (livekit-plugins-baseten) and Pipecat's OpenAITTSService.
They cannot send sampling fields, so the servers here serve a copy of the tiny checkpoint whose
generation_config.json is greedy (and stops at the fixtures' 33 tokens): their audio is then the official one."""

import asyncio
import base64
import io
import json
import time

import numpy as np
import pytest

from tests.golden import fixtures as fx

from .live import SPF, serve
from .test_voices import reference_wav

baseten = pytest.importorskip("livekit.plugins.baseten", reason="pip install -e '.[test]' (livekit-plugins-baseten)")
pipecat_tts = pytest.importorskip("pipecat.services.openai.tts", reason="pip install -e '.[test]' (pipecat-ai)")
import aiohttp  # noqa: E402
import openai  # noqa: E402
from livekit.agents import APIStatusError  # noqa: E402
from livekit.plugins.baseten import qwen3_tts  # noqa: E402

KEY = "sekret"


def start_greedy(variant: str, tmp_path_factory, **settings):
    """A live server as `q3tts serve --model DIR --generation-config greedy.json` builds it (load_model)."""
    from q3tts.server.app import create_app, load_model
    from q3tts.server.settings import ServerSettings

    root = tmp_path_factory.mktemp(f"agents-{variant}")
    greedy = root / "greedy.json"  # the fixtures' greedy settings (and their 33-token cap) over the checkpoint's
    greedy.write_text(json.dumps(fx.manifest(variant)["greedy"]))
    opts = {"max_concurrent": 4, "max_seq_len": 256, "voice_dir": str(root / "voices"), "api_key": KEY, **settings}
    s = ServerSettings(model=str(fx.checkpoint(variant)), device="cpu", dtype="float32", generation_config=str(greedy),
                       **opts)
    tts = load_model(s)
    return serve(create_app(tts, s), f"uvicorn-agents-{variant}")


@pytest.fixture(scope="module")
def cv(tmp_path_factory):
    s = start_greedy("cv06", tmp_path_factory)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    s = start_greedy("base06", tmp_path_factory, max_upload_bytes=400_000)
    yield s
    s.stop()


def ws_url(server):
    return server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"


def livekit_tts(server, session, **kw):
    return baseten.TTS(model="qwen3-tts", api_key=kw.pop("api_key", KEY), model_endpoint=ws_url(server),
                       http_session=session, **kw)


async def turn(tts, pieces) -> np.ndarray:
    """One agent turn: the text pushed in pieces, then the end of input; its audio as float32."""
    stream = tts.stream()
    for p in pieces:
        stream.push_text(p)
    stream.end_input()
    pcm = bytearray()
    async for ev in stream:
        assert ev.frame.sample_rate == 24000 and ev.frame.num_channels == 1
        pcm += bytes(ev.frame.data)
    await stream.aclose()
    return np.frombuffer(bytes(pcm), "<i2").astype(np.float32) / 32767


def pieces(text, k=4):
    return [text[i:i + k] for i in range(0, len(text), k)]


def official(variant, name):
    return fx.outputs(variant)[f"{name}.wav.0"].numpy()


async def wait_idle(server, timeout=10.0):
    t = time.time() + timeout
    while time.time() < t:
        s = server.stats
        if s.active_slots == 0 and s.queue_depth == 0:
            return time.time()
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle after {timeout} s: {server.stats}")


# --------------------------------------------------------------------------- LiveKit
def test_livekit_two_turns_on_one_warm_socket_equal_the_official_audio(cv, monkeypatch):
    """Two agent turns on one socket (the client keeps it warm between them and answers nothing but the server's
    session.done per flush), each the official audio of its whole text; the keepalive (an empty input.done) is
    answered while the socket is parked."""
    monkeypatch.setattr(qwen3_tts, "_KEEPALIVE_INTERVAL", 0.3)
    cases = [fx.get_case("cv06", n) for n in ("english_stream", "dialect_dylan_auto_stream")]

    async def main():
        async with aiohttp.ClientSession() as session:
            tts = livekit_tts(cv, session, voice="ryan", task_type="CustomVoice", language="English")
            backend = tts._qwen3
            sockets = []
            for i, case in enumerate(cases):
                kw = case["kw"]
                backend.update_options(voice=kw["speaker"], language=kw["language"])
                got = await turn(tts, pieces(kw["text"], 3 + i))
                ref = official("cv06", case["name"])
                assert got.shape == ref.shape
                assert np.abs(got - ref).max() <= 1e-4 + 0.5 / 32767
                sockets.append(backend._warm.ws)
                parked = backend._warm.last_activity
                await asyncio.sleep(1.0)  # keepalives go out; each is answered, so the socket stays warm
                assert backend._warm is not None and backend._warm.last_activity > parked
                assert not backend._warm.ws.closed
            assert sockets[0] is sockets[1]  # one warm socket for both turns
            await tts.aclose()

    asyncio.run(main())


def test_livekit_closing_mid_utterance_frees_the_slot(cv):
    """Barge-in: LiveKit closes the stream (and its socket) while audio flows; the slot is free at once."""
    async def main():
        async with aiohttp.ClientSession() as session:
            tts = livekit_tts(cv, session, voice="ryan", task_type="CustomVoice", max_new_tokens=200)
            stream = tts.stream()
            stream.push_text("A long answer that keeps the engine busy for a good while, and then some more words.")
            stream.flush()
            async for _ in stream:  # the first audio
                break
            assert cv.stats.active_slots == 1
            await stream.aclose()
            await tts.aclose()
            await wait_idle(cv, timeout=5)

    asyncio.run(main())


def test_livekit_voice_add_and_list_then_speak_in_the_voice(base):
    """register_voice / list_voices (voice.add / voice.list over the socket), then a turn in that voice."""

    async def main(tmp):
        wav = tmp / "me.wav"
        wav.write_bytes(reference_wav())
        voice = await qwen3_tts.register_voice(model_endpoint=ws_url(base), name="lk-me", ref_audio_path=str(wav),
                                               api_key=KEY)
        assert voice["name"] == "lk-me" and voice["id"].startswith("voice_")
        listed = await qwen3_tts.list_voices(model_endpoint=ws_url(base), api_key=KEY)
        assert listed["voices"] == [] and "lk-me" in [v["name"] for v in listed["uploaded_voices"]]
        with pytest.raises(RuntimeError, match="already exists"):
            await qwen3_tts.register_voice(model_endpoint=ws_url(base), name="lk-me", ref_audio_path=str(wav),
                                           api_key=KEY)
        async with aiohttp.ClientSession() as session:
            tts = livekit_tts(base, session, voice="lk-me", x_vector_only_mode=True, max_new_tokens=6)
            got = await turn(tts, ["Hello ", "there."])
            await tts.aclose()
        assert 0 < len(got) <= 5 * SPF

    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        asyncio.run(main(Path(d)))


def test_livekit_with_a_wrong_key_is_refused_at_the_handshake(cv):
    async def main():
        async with aiohttp.ClientSession() as session:
            tts = livekit_tts(cv, session, voice="ryan", task_type="CustomVoice", api_key="wrong")
            stream = tts.stream()
            stream.push_text("Hi.")
            stream.end_input()
            with pytest.raises(APIStatusError) as e:
                async for _ in stream:
                    pass
            assert e.value.status_code == 403
            await tts.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------------- Pipecat
def pipecat_service(server, api_key=KEY, voice="alloy"):
    from pipecat.frames.frames import StartFrame

    svc = pipecat_tts.OpenAITTSService(api_key=api_key, base_url=server.base_url + "/v1", sample_rate=24000,
                                       settings=pipecat_tts.OpenAITTSService.Settings(voice=voice))
    return svc, StartFrame(audio_out_sample_rate=24000)


def test_pipecat_alloy_equals_the_same_request_over_http(cv):
    """Pipecat's OpenAITTSService (voice "alloy", model "gpt-4o-mini-tts") gets the same audio as the request
    over plain HTTP with the voice alloy stands for on a CustomVoice model (vivian)."""
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame

    text = "Hello from Pipecat."

    async def main():
        svc, _ = pipecat_service(cv)
        svc._sample_rate = 24000  # what start() sets from the pipeline's StartFrame
        pcm = bytearray()
        async for frame in svc.run_tts(text, "ctx-1"):
            assert not isinstance(frame, ErrorFrame), frame
            if isinstance(frame, TTSAudioRawFrame):
                pcm += frame.audio
        return bytes(pcm)

    got = asyncio.run(main())
    want = cv.client(api_key=KEY).audio.speech.create(model="q3tts", voice="vivian", input=text,
                                                       response_format="pcm").content
    assert len(got) > 0 and got == want


def test_pipecat_interruption_frees_the_slot(cv):
    """An interruption drops the HTTP stream (the run_tts generator is closed mid-audio): the slot is free within a
    frame or two."""
    from pipecat.frames.frames import TTSAudioRawFrame

    async def main():
        svc, _ = pipecat_service(cv)
        svc._sample_rate = 24000
        gen = svc.run_tts("A long story, " * 20, "ctx-2")
        async for frame in gen:
            if isinstance(frame, TTSAudioRawFrame):
                break
        assert cv.stats.active_slots == 1
        t0 = time.time()
        await gen.aclose()
        done = await wait_idle(cv, timeout=5)
        return done - t0

    assert asyncio.run(main()) < 1.0


def test_pipecat_with_a_wrong_key_gets_401(cv):
    async def main():
        svc, _ = pipecat_service(cv, api_key="wrong")
        svc._sample_rate = 24000
        try:
            frames = [f async for f in svc.run_tts("Hi.", "ctx-3")]
        except openai.AuthenticationError as e:
            return e.status_code
        return frames

    got = asyncio.run(main())
    assert got == 401 or any("401" in str(getattr(f, "error", "")) for f in got), got


# --------------------------------------------------------------------------- OpenAI's voices API
def test_openai_voice_consent_create_speak_delete(base):
    client = base.client(api_key=KEY)
    consent = client.audio.voice_consents.create(name="me", language="en-US",
                                                 recording=("consent.wav", io.BytesIO(reference_wav()), "audio/wav"))
    assert consent.object == "audio.voice_consent" and consent.id.startswith("cons_")
    assert client.audio.voice_consents.retrieve(consent.id).name == "me"
    voice = client.audio.voices.create(name="oa-me", consent=consent.id, type="audio_sample",
                                       audio_sample=("me.wav", io.BytesIO(reference_wav()), "audio/wav"))
    assert voice.object == "audio.voice" and voice.type == "audio_sample" and voice.name == "oa-me"
    pcm = client.audio.speech.create(model="any-name", voice={"id": voice.id}, input="Hi.", response_format="pcm",
                                     extra_body={"x_vector_only_mode": True, "max_new_tokens": 4}).content
    assert 0 < len(pcm) <= 3 * SPF * 2
    deleted = client.audio.voices.delete(voice.id)
    assert deleted.object == "audio.voice.deleted" and deleted.deleted and deleted.id == voice.id
    with base.http() as h:
        r = h.post("/v1/audio/voices", headers={"Authorization": f"Bearer {KEY}"},
                   json={"name": "p", "type": "prompt", "prompt": "A calm voice"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_voice_type"
    client.audio.voice_consents.delete(consent.id)
    assert consent.id not in [c.id for c in client.audio.voice_consents.list()]


def test_voice_add_over_the_socket_with_base64(base):
    """voice.add's own fields (audio_data as base64, audio_format, consent) through a plain WebSocket client."""
    from websockets.sync.client import connect

    with connect(ws_url(base), additional_headers={"Authorization": f"Api-Key {KEY}"}) as ws:
        ws.send(json.dumps({"type": "voice.add", "name": "b64", "consent": "ok", "audio_format": "wav",
                            "audio_data": base64.b64encode(reference_wav()).decode()}))
        reply = json.loads(ws.recv(timeout=60))
        assert reply["type"] == "voice.add" and reply["success"] and reply["voice"]["name"] == "b64"
        ws.send(json.dumps({"type": "voice.add", "name": "bad", "audio_data": "!!!"}))
        err = json.loads(ws.recv(timeout=30))
        assert err["type"] == "error" and err["code"] == "invalid_base64"


def test_livekit_openai_plugin_over_sse_equals_plain_http(cv):
    """LiveKit's openai.TTS(base_url=...) (gpt-4o-mini-tts: SSE with speech.audio.delta events) gets the audio of
    the plain HTTP request."""
    lk_openai = pytest.importorskip("livekit.plugins.openai")
    text = "Hello from LiveKit over SSE."

    async def main():
        tts = lk_openai.TTS(base_url=cv.base_url + "/v1", api_key=KEY, model="gpt-4o-mini-tts", voice="alloy",
                            response_format="pcm")
        pcm = bytearray()
        async with tts.synthesize(text) as stream:
            async for ev in stream:
                pcm += bytes(ev.frame.data)
        await tts.aclose()
        return bytes(pcm)

    got = asyncio.run(main())
    want = cv.client(api_key=KEY).audio.speech.create(model="q3tts", voice="vivian", input=text,
                                                       response_format="pcm").content
    # LiveKit's emitter pads the last frame of its own framing with silence
    assert len(want) > 0 and got[:len(want)] == want and not any(got[len(want):])
    assert len(got) - len(want) < 24000 * 2 * 0.2
