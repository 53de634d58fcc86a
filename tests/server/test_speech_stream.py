"""The WebSocket /v1/audio/speech/stream against a live server, with a real WebSocket client: text streamed in
pieces gives the official audio of the whole text; bad messages get an error and the session goes on; a
cancel ends the utterance; a disconnect frees its slot; the API key guards the socket."""

import base64
import json
import random
import socket
import time

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from tests.golden import fixtures as fx

from .live import GREEDY, SPF, pieces


def ws_url(server, query=""):
    return server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream" + query


def utterance(ws, timeout=60):
    """Messages of one utterance: (audio.start, PCM bytes, audio.done, other JSON messages seen on the way)."""
    start, pcm, other = None, bytearray(), []
    while True:
        msg = ws.recv(timeout=timeout)
        if isinstance(msg, bytes):
            assert start is not None, "audio before audio.start"
            pcm += msg
            continue
        m = json.loads(msg)
        if m["type"] == "audio.start":
            start = m
        elif m["type"] == "audio.done":
            return start, bytes(pcm), m, other
        else:
            other.append(m)


def speaks(ws, voice: str, text: str) -> None:
    """One short utterance (max_new_tokens 4, greedy) on an open session: its audio is done["frames"] frames of PCM."""
    ws.send(json.dumps({"type": "session.config", "voice": voice, **GREEDY, "max_new_tokens": 4}))
    ws.send(json.dumps({"type": "input.text", "text": text}))
    ws.send(json.dumps({"type": "input.done"}))
    _, pcm, done, _ = utterance(ws)
    assert len(pcm) == done["frames"] * SPF * 2 > 0


def test_text_over_the_socket_equals_the_official_whole_text(cv_server):
    """Two utterances on one session, the text split anywhere (mid-word), each the official audio of its
    whole text (non_streaming_mode=False) and a session.done per flush, then session.close -> session.done."""
    cases = [fx.get_case("cv06", n) for n in ("english_stream", "dialect_dylan_auto_stream")]
    with connect(ws_url(cv_server)) as ws:
        for i, case in enumerate(cases):
            kw = case["kw"]
            ws.send(json.dumps({"type": "session.config", "voice": kw["speaker"], "language": kw.get("language"),
                                **fx.manifest("cv06")["greedy"]}))
            for piece in pieces(kw["text"], random.Random(i)):
                ws.send(json.dumps({"type": "input.text", "text": piece}))
            ws.send(json.dumps({"type": "input.done"}))
            start, pcm, done, other = utterance(ws)
            assert start == {"type": "audio.start", "sample_rate": 24000, "format": "pcm_s16le"} and not other
            got = np.frombuffer(pcm, "<i2").astype(np.float32) / 32767
            ref = fx.outputs("cv06")[f"{case['name']}.wav.0"].numpy()
            assert got.shape == ref.shape and done["frames"] * SPF == len(got)
            # float32 audio within 1e-4 of the official (tests/engine/test_text_stream.py), then rounded to int16:
            # at most half an int16 step more
            assert np.abs(got - ref).max() <= 1e-4 + 0.5 / 32767
            assert done["finish_reason"] in ("stop", "length")
            assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}  # the flush is answered
        ws.send(json.dumps({"type": "session.close"}))
        assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
    cv_server.wait_idle()


def test_bad_messages_get_an_error_and_the_session_goes_on(cv_server):
    with connect(ws_url(cv_server)) as ws:
        for bad, code in [("not json", "invalid_json"), (json.dumps({"type": "nope"}), "unknown_type"),
                          (json.dumps({"type": "input.text"}), "invalid_message"), (b"\x00\x01", "invalid_message"),
                          (json.dumps({"type": "session.config", "voice": "nobody"}), "voice_not_found"),
                          (json.dumps({"type": "session.config", "temprature": 1}), "invalid_config")]:
            ws.send(bad)
            err = json.loads(ws.recv(timeout=30))
            assert err["type"] == "error" and err["code"] == code and err["message"], (bad, err)
        ws.send(json.dumps({"type": "session.config", "voice": "vivian", **GREEDY, "max_new_tokens": 5}))
        ws.send(json.dumps({"type": "input.text", "text": "Still "}))
        ws.send(json.dumps({"type": "input.text", "text": "usable."}))
        ws.send(json.dumps({"type": "input.done"}))
        _, pcm, done, _ = utterance(ws)
        assert len(pcm) == done["frames"] * SPF * 2 > 0
        assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
        ws.send(json.dumps({"type": "input.text", "text": "   "}))  # nothing to say: refused at input.done
        ws.send(json.dumps({"type": "input.done"}))
        _, pcm, done, other = utterance(ws)
        assert done["finish_reason"] == "error" and not pcm and any(o["code"] == "empty_input" for o in other)
    cv_server.wait_idle()


def test_cancel_mid_utterance_and_disconnect_free_the_slot(cv_server):
    with connect(ws_url(cv_server)) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "ryan", **GREEDY, "max_new_tokens": 200}))
        ws.send(json.dumps({"type": "input.text", "text": "A long sentence that keeps the engine busy for a while, "
                                                          "with more words after it, and more."}))
        assert json.loads(ws.recv(timeout=30))["type"] == "audio.start"
        assert isinstance(ws.recv(timeout=30), bytes)  # audio is flowing while the text is still open
        ws.send(json.dumps({"type": "response.cancel"}))
        while isinstance(msg := ws.recv(timeout=30), bytes):
            pass
        done = json.loads(msg)
        assert done["type"] == "audio.done" and done["finish_reason"] == "cancelled" and done["frames"] < 199
    cv_server.wait_idle()
    with connect(ws_url(cv_server)) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "ryan", **GREEDY, "max_new_tokens": 200}))
        ws.send(json.dumps({"type": "input.text", "text": "Going away before the end of this."}))
        assert json.loads(ws.recv(timeout=30))["type"] == "audio.start"
        assert isinstance(ws.recv(timeout=30), bytes) and cv_server.stats.active_slots == 1  # admitted, speaking
        ws.socket.shutdown(socket.SHUT_RDWR)  # no close handshake: the client is simply gone
    cv_server.wait_idle()  # its slot is free again


def test_api_key_guards_the_socket(cv_server):
    settings = cv_server.app.state.settings
    settings.api_key = "sekret"
    try:
        with pytest.raises(InvalidStatus):
            connect(ws_url(cv_server))
        with connect(ws_url(cv_server, "?api_key=sekret")) as ws:
            ws.send(json.dumps({"type": "session.close"}))
            assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
        with connect(ws_url(cv_server), additional_headers={"Authorization": "Bearer sekret"}) as ws:
            ws.send(json.dumps({"type": "session.close"}))
            assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
        with connect(ws_url(cv_server), additional_headers={"Authorization": "Api-Key sekret"}) as ws:  # LiveKit's
            ws.send(json.dumps({"type": "session.close"}))
            assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
        # the web page's way (a browser sets no header, and a query string lands in access logs): a subprotocol
        key = base64.urlsafe_b64encode(b"sekret").decode().rstrip("=")
        with connect(ws_url(cv_server), subprotocols=["q3tts", f"q3tts-key.{key}"]) as ws:
            assert ws.subprotocol == "q3tts"  # the key is not echoed back
            ws.send(json.dumps({"type": "session.close"}))
            assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
        wrong = base64.urlsafe_b64encode(b"nope").decode().rstrip("=")
        with pytest.raises(InvalidStatus):
            connect(ws_url(cv_server), subprotocols=["q3tts", f"q3tts-key.{wrong}"])
    finally:
        settings.api_key = None


def test_silent_sessions_end_at_the_idle_limits_and_free_their_slots(cv_server):
    """No first message within ws_config_timeout; an open utterance then silence past ws_idle_timeout: each
    session gets an idle_timeout error and a close, and the slot the open utterance held comes back."""
    settings = cv_server.app.state.settings
    saved = settings.ws_config_timeout, settings.ws_idle_timeout
    settings.ws_config_timeout, settings.ws_idle_timeout = 0.5, 1.0
    try:
        with connect(ws_url(cv_server)) as ws:
            err = json.loads(ws.recv(timeout=10))
            assert err["code"] == "idle_timeout" and "--ws-config-timeout" in err["message"]
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
        with connect(ws_url(cv_server)) as ws:
            ws.send(json.dumps({"type": "session.config", "voice": "ryan", **GREEDY, "max_new_tokens": 200}))
            ws.send(json.dumps({"type": "input.text", "text": "An utterance that is never finished"}))
            t0, msgs = time.monotonic(), []
            with pytest.raises(ConnectionClosed):
                while True:
                    msgs.append(ws.recv(timeout=10))
            err = json.loads(next(m for m in msgs if isinstance(m, str) and "idle_timeout" in m))
            assert "--ws-idle-timeout" in err["message"] and time.monotonic() - t0 < 8
        cv_server.wait_idle()
    finally:
        settings.ws_config_timeout, settings.ws_idle_timeout = saved


def test_a_flooding_session_is_capped_while_another_client_is_served(cv_server):
    """One session flushing many utterances gets queue_full (limit "session") past ws_max_utterances, answered with
    session.done per flush all the same; meanwhile another client's request is served."""
    settings = cv_server.app.state.settings
    saved = settings.ws_max_utterances
    settings.ws_max_utterances = 2
    try:
        with connect(ws_url(cv_server)) as ws:
            ws.send(json.dumps({"type": "session.config", "voice": "ryan", **GREEDY, "max_new_tokens": 40}))
            for i in range(6):
                ws.send(json.dumps({"type": "input.text", "text": f"Utterance number {i}."}))
                ws.send(json.dumps({"type": "input.done"}))
            other = cv_server.client().audio.speech.create(model="q3tts", voice="vivian", input="Me too.",
                                                            response_format="pcm",
                                                            extra_body={**GREEDY, "max_new_tokens": 4}).content
            assert len(other) > 0
            errors, dones, audio_done = [], 0, 0
            while dones < 6:
                msg = ws.recv(timeout=60)
                if isinstance(msg, bytes):
                    continue
                m = json.loads(msg)
                errors += [m] if m["type"] == "error" else []
                dones += m["type"] == "session.done"
                audio_done += m["type"] == "audio.done"
            assert audio_done == 2 and len(errors) == 4
            assert all(e["code"] == "queue_full" and e["limit"] == "session" and "--ws-max-utterances" in e["message"]
                       for e in errors)
        settings.ws_max_utterances, saved_client = 8, settings.ws_max_client_utterances
        settings.ws_max_client_utterances = 1
        try:  # the per-client share: a second session of the same client address is refused while the first speaks
            with connect(ws_url(cv_server)) as a, connect(ws_url(cv_server)) as b:
                for ws in (a, b):
                    ws.send(json.dumps({"type": "session.config", "voice": "ryan", **GREEDY, "max_new_tokens": 60}))
                a.send(json.dumps({"type": "input.text", "text": "First."}))
                assert json.loads(a.recv(timeout=30))["type"] == "audio.start"
                b.send(json.dumps({"type": "input.text", "text": "Second."}))
                err = json.loads(b.recv(timeout=30))
                assert err["code"] == "queue_full" and err["limit"] == "client"
        finally:
            settings.ws_max_client_utterances = saved_client
    finally:
        settings.ws_max_utterances = saved
    cv_server.wait_idle()



def test_the_next_utterance_at_the_cap_is_taken_on_audio_done(cv_server, monkeypatch):
    """A session at its cap (one utterance) that starts the next one as soon as audio.done arrives is served: the
    place is given back before audio.done goes out. Here the send of audio.done is held a moment after it went out,
    as a congested socket's is (a load client at the per-client cap was refused at random)."""
    import asyncio

    from q3tts.server.session import SpeechSession
    send = SpeechSession._send_json

    async def congested(self, obj):
        await send(self, obj)
        if obj.get("type") == "audio.done":
            await asyncio.sleep(0.2)
    monkeypatch.setattr(SpeechSession, "_send_json", congested)
    settings = cv_server.app.state.settings
    saved = settings.ws_max_utterances, settings.ws_max_client_utterances
    settings.ws_max_utterances = settings.ws_max_client_utterances = 1
    try:
        with connect(ws_url(cv_server)) as ws:
            ws.send(json.dumps({"type": "session.config", "voice": "ryan", **GREEDY, "max_new_tokens": 3}))
            for i in range(3):
                ws.send(json.dumps({"type": "input.text", "text": f"Utterance {i}."}))
                ws.send(json.dumps({"type": "input.done"}))
                while True:
                    msg = ws.recv(timeout=60)
                    if isinstance(msg, bytes):
                        continue
                    m = json.loads(msg)
                    assert m["type"] != "error", m
                    if m["type"] == "audio.done":
                        break
    finally:
        settings.ws_max_utterances, settings.ws_max_client_utterances = saved
    cv_server.wait_idle()

def test_unencodable_text_and_deep_json_get_invalid_message_and_the_session_goes_on(cv_server):
    with connect(ws_url(cv_server)) as ws:
        for bad, what in [('{"type": "input.text", "text": "a\\ud800b"}', "lone surrogate"),
                          ('{"type": "session.config", "voice": "\\udfff"}', "lone surrogate"),
                          ('{"type": "input.text", "text": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
                          ('{"type": "input.text", "x": ' + "[" * 40 + "]" * 40 + "}", "nested")]:
            ws.send(bad)
            err = json.loads(ws.recv(timeout=30))
            assert err["type"] == "error" and err["code"] == "invalid_message" and what in err["message"], err
        speaks(ws, "vivian", "Still usable.")
    cv_server.wait_idle()


def test_vllm_omni_config_fields(cv_server):
    """task_type checked against the served model; pcm only; speed 1.0 only; split_granularity none | sentence |
    clause; word timestamps (either form) refused without --aligner; a misspelt field refused by name; initial_codec_chunk_frames sizes the first chunk;
    an empty input.done answers session.done at once; the config is kept across flushes."""
    with connect(ws_url(cv_server)) as ws:
        for field, value, words in [("task_type", "Base", "CustomVoice"), ("response_format", "mp3", "pcm"),
                                    ("speed", 1.5, "1.0"), ("split_granularity", "word", "'clause'"),
                                    ("timestamp_type", "word", "--aligner"), ("word_timestamps", True, "--aligner"), ("stream_audo", True, "stream_audo")]:
            ws.send(json.dumps({"type": "session.config", "voice": "ryan", field: value}))
            err = json.loads(ws.recv(timeout=30))
            assert err["code"] == "invalid_config" and words in err["message"], (field, err)
        ws.send(json.dumps({"type": "input.done"}))
        assert json.loads(ws.recv(timeout=5)) == {"type": "session.done"}
        ws.send(json.dumps({"type": "session.config", "task_type": "CustomVoice", "response_format": "pcm",
                            "stream_audio": True, "speed": 1.0, "split_granularity": "none", "voice": "ryan",
                            "initial_codec_chunk_frames": 3, **GREEDY, "max_new_tokens": 12}))
        for _ in range(2):  # the config is kept for the second flush
            ws.send(json.dumps({"type": "input.text", "text": "Hello there."}))
            ws.send(json.dumps({"type": "input.done"}))
            assert json.loads(ws.recv(timeout=30))["type"] == "audio.start"
            first = ws.recv(timeout=30)
            assert isinstance(first, bytes) and len(first) == 3 * SPF * 2
            while isinstance(msg := ws.recv(timeout=30), bytes):
                pass
            assert json.loads(msg)["type"] == "audio.done"
            assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
    cv_server.wait_idle()


def test_stream_audio_false_sends_each_utterance_in_one_message(cv_server):
    with connect(ws_url(cv_server)) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "ryan", "stream_audio": False, **GREEDY,
                            "max_new_tokens": 12}))
        ws.send(json.dumps({"type": "input.text", "text": "Hello there."}))
        ws.send(json.dumps({"type": "input.done"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "audio.start"
        audio = ws.recv(timeout=60)
        done = json.loads(ws.recv(timeout=30))
        assert isinstance(audio, bytes) and done["type"] == "audio.done" and len(audio) == done["frames"] * SPF * 2 > 0
        assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
    cv_server.wait_idle()


def test_the_socket_declines_compression(cv_server):
    """The client offers permessage-deflate (websockets does by default); the server declines it, so no audio chunk is
    compressed on the event loop's thread (q3tts.server.app.uvicorn_config), and the session speaks as usual."""
    with connect(ws_url(cv_server), compression="deflate") as ws:
        assert "permessage-deflate" in ws.request.headers.get("Sec-WebSocket-Extensions", "")
        assert ws.response.headers.get("Sec-WebSocket-Extensions") is None
        speaks(ws, "ryan", "Hello.")
    cv_server.wait_idle()
