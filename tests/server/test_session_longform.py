"""Long form on the WebSocket (split_granularity sentence | clause in session.config): the streamed text's
sentences (clauses) are segment requests submitted as soon as their end is known, run in parallel and joined in
order with pause_ms, the same PCM as the HTTP long-form request; a bad granularity is a clear error; cancel,
disconnect stop every segment."""

import json
import random
import socket

import numpy as np
from websockets.sync.client import connect

from .live import GREEDY, pcm_samples, pieces
from .test_longform import long_text, same
from .test_speech_stream import utterance, ws_url

TEXT = ("The first sentence is here, costing 3.5 dollars. Dr. Smith said the second one follows it; with a clause! "
        "Then a third sentence ends the text.")


def http_long(server, granularity: str, pause_ms: int, **kw) -> np.ndarray:
    body = {"model": "tiny", "input": TEXT, "voice": "ryan", "response_format": "pcm", "stream": False,
            "split_granularity": granularity, "pause_ms": pause_ms, **GREEDY, **kw}
    with server.http() as http:
        r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["x-q3tts-split"].endswith("segments"), r.text
    return pcm_samples(r.content)


def config(granularity: str, pause_ms: int, **kw) -> str:
    return json.dumps({"type": "session.config", "voice": "ryan", "split_granularity": granularity,
                       "pause_ms": pause_ms, **GREEDY, **kw})


def test_streamed_sentences_equal_the_http_long_form_request(cv_server):
    """Pieces cut anywhere: the first sentence speaks before the flush (its end is known once "Dr. Smith said"
    follows it: not "3." + digits, and enough text for a segment of its own), and the utterance's PCM is the HTTP
    request's with the same split and pause."""
    want = http_long(cv_server, "sentence", 100, max_new_tokens=6)
    cut = TEXT.index("Dr. Smith said") + 15
    with connect(ws_url(cv_server)) as ws:
        ws.send(config("sentence", 100, max_new_tokens=6))
        for piece in pieces(TEXT[:cut], random.Random(0)):
            ws.send(json.dumps({"type": "input.text", "text": piece}))
        assert json.loads(ws.recv(timeout=60))["type"] == "audio.start"
        pcm = ws.recv(timeout=60)
        assert isinstance(pcm, bytes)  # the first segment speaks while the text is still open
        for piece in pieces(TEXT[cut:], random.Random(1)):
            ws.send(json.dumps({"type": "input.text", "text": piece}))
        ws.send(json.dumps({"type": "input.done"}))
        while isinstance(msg := ws.recv(timeout=60), bytes):
            pcm += msg
        done = json.loads(msg)
        assert done["type"] == "audio.done" and done["finish_reason"] == "length"  # max_new_tokens ended each
        assert done["frames"] == 3 * 5  # three segments of max_new_tokens - 1 frames
        assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
    assert same(pcm_samples(pcm), want)
    cv_server.wait_idle()


def test_clauses_and_a_second_flush(cv_server):
    want = http_long(cv_server, "clause", 0, max_new_tokens=4)
    with connect(ws_url(cv_server)) as ws:
        ws.send(config("clause", 0, max_new_tokens=4))
        for flush in range(2):  # the config is kept: each flush is one utterance of clauses
            for piece in pieces(TEXT, random.Random(flush)):
                ws.send(json.dumps({"type": "input.text", "text": piece}))
            ws.send(json.dumps({"type": "input.done"}))
            _, pcm, done, _ = utterance(ws)
            assert same(pcm_samples(pcm), want) and done["frames"] * 1920 == len(want)
            assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}
    cv_server.wait_idle()


def test_an_unknown_granularity_or_pause_is_a_clear_error(cv_server):
    with connect(ws_url(cv_server)) as ws:
        for bad, words in (({"split_granularity": "word"}, ("'none', 'sentence', 'clause'", "'word'")),
                           ({"split_granularity": "sentence", "pause_ms": -5}, ("pause_ms",))):
            ws.send(json.dumps({"type": "session.config", "voice": "ryan", **bad}))
            err = json.loads(ws.recv(timeout=30))
            assert err["code"] == "invalid_config" and all(w in err["message"] for w in words), err
        ws.send(config("sentence", 0, max_new_tokens=4))  # the session goes on
        ws.send(json.dumps({"type": "input.text", "text": "   "}))
        ws.send(json.dumps({"type": "input.done"}))
        _, pcm, done, other = utterance(ws)
        assert done["finish_reason"] == "error" and not pcm and any(o["code"] == "empty_input" for o in other)
    cv_server.wait_idle()


def test_cancel_and_disconnect_stop_every_segment(cv_server):
    sentences = long_text(6_000)
    text = " ".join(sentences)
    for leave in ("cancel", "disconnect"):
        admitted = cv_server.stats.counters.admitted
        with connect(ws_url(cv_server)) as ws:
            ws.send(config("sentence", 0, max_new_tokens=40))
            ws.send(json.dumps({"type": "input.text", "text": text}))
            assert json.loads(ws.recv(timeout=60))["type"] == "audio.start"
            assert isinstance(ws.recv(timeout=60), bytes)
            assert cv_server.stats.active_slots > 1  # segments run together
            if leave == "cancel":
                ws.send(json.dumps({"type": "response.cancel"}))
                while isinstance(msg := ws.recv(timeout=30), bytes):
                    pass
                assert json.loads(msg)["finish_reason"] == "cancelled"
            else:
                ws.socket.shutdown(socket.SHUT_RDWR)  # no close handshake: the client is simply gone
        cv_server.wait_idle(timeout=10)  # every segment stopped: no slot busy, nothing queued
        assert cv_server.stats.counters.admitted - admitted < len(sentences)
    assert cv_server.metric("q3tts_active_slots") == 0


def test_a_queued_utterance_cancelled_before_its_turn_ends_at_once(cv_server):
    """An utterance cancelled while the one before it is still speaking (its text open, no sentence end known yet)
    ends with audio.done "cancelled" when its turn comes: nothing waits for its text."""
    with connect(ws_url(cv_server)) as ws:
        ws.send(config("sentence", 0, max_new_tokens=30))
        ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        ws.send(json.dumps({"type": "input.done"}))
        ws.send(json.dumps({"type": "input.text", "text": "A second utterance with no end yet"}))
        ws.send(json.dumps({"type": "response.cancel"}))  # the open one: the second
        first = utterance(ws)
        second = utterance(ws, timeout=30)
    assert first[2]["finish_reason"] in ("stop", "length") and len(first[1]) > 0
    assert second[2]["finish_reason"] == "cancelled" and len(second[1]) == 0
    cv_server.wait_idle(timeout=10)


def test_a_full_queue_refuses_a_split_utterance_as_busy(cv_server):
    """The server's queue full at a split utterance's first segment: queue_full with limit "server", as for one
    request (and HTTP's long form: a 503, test_speech)."""
    sched = cv_server.app.state.engine.engine.scheduler
    old, sched.max_queue = sched.max_queue, 0
    try:
        with connect(ws_url(cv_server)) as ws:
            ws.send(config("sentence", 0, max_new_tokens=20))
            ws.send(json.dumps({"type": "input.text", "text": TEXT}))
            ws.send(json.dumps({"type": "input.done"}))
            msgs = []
            while not msgs or msgs[-1].get("type") != "audio.done":
                msg = ws.recv(timeout=30)
                if not isinstance(msg, bytes):
                    msgs.append(json.loads(msg))
    finally:
        sched.max_queue = old
    errors = [m for m in msgs if m["type"] == "error"]
    assert [(e["code"], e.get("limit")) for e in errors] == [("queue_full", "server")], msgs
    assert "--max-queue" in errors[0]["message"]
