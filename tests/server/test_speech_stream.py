"""The WebSocket /v1/audio/speech/stream against a live server, with a real WebSocket client: text streamed in
pieces gives the official audio of the whole text; bad messages get an error and the session goes on; a
cancel ends the utterance; a disconnect frees its slot; the API key guards the socket."""

import json
import random
import socket

import numpy as np
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.golden import fixtures as fx

from .live import GREEDY, SPF


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


def pieces(text, rng):
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 3)
        out.append(text[i:i + k])
        i += k
    return out


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
    finally:
        settings.api_key = None
