"""Long form on the server: a text over --max-text-length is split at sentences (X-Q3TTS-Split) and streamed in
order up to --max-split-text-length; split_granularity / pause_ms; X-Finish-Reason on a response that is not
streamed; a client that leaves stops every segment."""

import time

import numpy as np

from .live import GREEDY, SPF, SR, pcm_samples, speak

WORDS = ("the cat sat on a mat and then it ran to see what was in the house where we live with our dog who "
         "likes to play all day").split()


def sentence(i: int) -> str:
    # ~400 characters: one segment each (under split_text's 600), ~90 text tokens (under the test server's 256)
    words = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(85))
    return f"Sentence {i} says {words}."


def long_text(min_chars: int) -> list[str]:
    out, n, i = [], 0, 0
    while n < min_chars:
        out.append(sentence(i))
        n += len(out[-1]) + 1
        i += 1
    return out


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max(initial=0)) <= 2


def test_a_200k_character_text_is_split_and_streamed_in_order(cv_server):
    sentences = long_text(200_000)
    text = " ".join(sentences)
    n = len(sentences)
    assert len(text) >= 200_000 and n > 400
    pause_ms = 20
    gap = pause_ms * SR // 1000
    body = {"model": "tiny", "input": text, "voice": "vivian", "response_format": "pcm", "pause_ms": pause_ms,
            "max_new_tokens": 2, **GREEDY}  # one frame per segment (EOS is banned on the first two)
    t0 = time.time()
    with cv_server.http() as http, http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["x-q3tts-split"] == f"{n} segments"
        data = b"".join(r.iter_bytes())
    took = time.time() - t0
    pcm = pcm_samples(data)
    assert pcm.shape[0] == n * SPF + (n - 1) * gap, took
    client = cv_server.client()
    for k in (0, 1, n // 2, n - 1):  # segment k's place holds segment k's audio, alone
        alone = pcm_samples(speak(client, sentences[k], "pcm", 2, seed=None))
        start = k * (SPF + gap)
        assert same(pcm[start: start + SPF], alone), k
        if k:
            assert not pcm[start - gap: start].any()
    cv_server.wait_idle()


def test_split_granularity_pause_and_finish_reason_header(cv_server):
    text = "The first sentence is here. And the second one follows it, with a clause."
    client = cv_server.client()
    with cv_server.http() as http:
        base = {"model": "tiny", "input": text, "voice": "ryan", "response_format": "pcm", "max_new_tokens": 5,
                **GREEDY}
        r = http.post("/v1/audio/speech", json={**base, "split_granularity": "clause", "pause_ms": 100,
                                                "stream": False})
        assert r.status_code == 200 and r.headers["x-q3tts-split"] == "3 segments"
        assert r.headers["x-finish-reason"] == "length"  # max_new_tokens ended every segment
        parts = ["The first sentence is here.", "And the second one follows it,", "with a clause."]
        alone = [pcm_samples(speak(client, p, "pcm", 5, voice="ryan")) for p in parts]
        gap = np.zeros(SR // 10, np.int16)
        assert same(pcm_samples(r.content), np.concatenate([alone[0], gap, alone[1], gap, alone[2]]))
        one = http.post("/v1/audio/speech", json={**base, "split_granularity": "none", "stream": False})
        assert "x-q3tts-split" not in one.headers and one.headers["x-finish-reason"] == "length"
        assert same(pcm_samples(one.content), pcm_samples(speak(client, text, "pcm", 5, voice="ryan")))
        for bad, field in (({"split_granularity": "word"}, "split_granularity"), ({"pause_ms": -1}, "pause_ms")):
            r = http.post("/v1/audio/speech", json={**base, **bad})
            assert r.status_code == 400 and field in r.text
        over = "Words. " * 700  # 4 900 characters: over --max-text-length (4 096)
        r = http.post("/v1/audio/speech", json={**base, "input": over, "split_granularity": "none"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "input_too_long"
        assert "split_granularity" in r.json()["error"]["message"]
        r = http.post("/v1/audio/speech", json={**base, "input": "x. " * 400_001})
        assert r.status_code == 400 and "--max-split-text-length" in r.json()["error"]["message"]
        r = http.post("/v1/audio/speech", json={**base, "input": "Words here. " * 2000, "stream": False})
        assert r.status_code == 400 and "--max-unstreamed-text-length" in r.json()["error"]["message"]
    cv_server.wait_idle()


def test_leaving_a_long_stream_stops_every_segment(cv_server):
    sentences = long_text(30_000)
    admitted = cv_server.stats.counters.admitted
    body = {"model": "tiny", "input": " ".join(sentences), "voice": "aiden", "response_format": "pcm",
            "max_new_tokens": 40, **GREEDY}
    with cv_server.http() as http, http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        assert len(next(r.iter_bytes())) > 0
        assert cv_server.stats.active_slots > 1  # segments run together
    cv_server.wait_idle(timeout=10)  # every segment was cancelled: no slot busy, nothing queued
    assert cv_server.stats.counters.admitted - admitted < len(sentences)
    assert cv_server.metric("q3tts_active_slots") == 0
