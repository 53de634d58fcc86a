"""POST /v1/audio/speech against a live server (tiny CustomVoice checkpoint, CPU), with the official client."""

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from torch._dynamo.utils import counters

from q3tts.engine.compile import compile_counts

from .live import GREEDY, SPF, SR, declared_rate, decode, duration_tolerance, pcm_samples, speak

FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm"]
TEXT = "Every format, streamed or not."
N_TOKENS = 12  # -> at most 11 frames (0.88 s)


def _create(client, fmt):
    return client.audio.speech.create(model="tiny", input=TEXT, voice="vivian", response_format=fmt,
                                      extra_body={"max_new_tokens": N_TOKENS, **GREEDY}).content


def _stream(client, fmt):
    with client.audio.speech.with_streaming_response.create(
            model="tiny", input=TEXT, voice="vivian", response_format=fmt,
            extra_body={"max_new_tokens": N_TOKENS, **GREEDY}) as r:
        assert r.status_code == 200
        parts = [p for p in r.iter_bytes() if p]
    return b"".join(parts), len(parts)


@pytest.fixture(scope="module")
def results(cv_server):
    """Every format, plain and streaming, all at once (12 concurrent clients on 4 slots)."""
    client = cv_server.client()
    with ThreadPoolExecutor(12) as pool:
        plain = {f: pool.submit(_create, client, f) for f in FORMATS}
        streamed = {f: pool.submit(_stream, client, f) for f in FORMATS}
        out = {("create", f): (fut.result(), 1) for f, fut in plain.items()}
        out.update({("stream", f): fut.result() for f, fut in streamed.items()})
    return out


@pytest.fixture(scope="module")
def num_frames(results):
    n = len(pcm_samples(results[("create", "pcm")][0]))
    assert n % SPF == 0 and 0 < n // SPF <= N_TOKENS - 1
    return n // SPF


@pytest.mark.parametrize("mode", ["create", "stream"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_decodes_to_the_generated_duration(results, num_frames, fmt, mode):
    data, parts = results[(mode, fmt)]
    if fmt != "pcm":  # raw PCM declares no rate
        assert declared_rate(fmt, data) == SR
    if fmt == "pcm":
        samples, rate = pcm_samples(data), SR
    else:
        samples, rate = decode(data)
    seconds = len(samples) / rate
    assert abs(seconds - num_frames * 0.08) <= duration_tolerance(fmt), (fmt, seconds, num_frames)
    if mode == "stream" and fmt in ("pcm", "wav"):
        assert parts >= 2, "audio should arrive in several pieces"


def same_audio(a: np.ndarray, b: np.ndarray) -> bool:
    """Same frames and the same samples up to 1 LSB of s16: the codes are identical whatever the batch, but the
    vocoder decodes several requests as one batch, and a batched convolution rounds differently from a single
    one (float32 on CPU), which can move a sample across a rounding boundary."""
    return len(a) == len(b) and np.abs(a.astype(np.int32) - b.astype(np.int32)).max(initial=0) <= 1


def test_lossless_formats_carry_the_same_samples(results):
    pcm = pcm_samples(results[("create", "pcm")][0])
    assert same_audio(pcm_samples(results[("stream", "pcm")][0]), pcm)
    wav = results[("create", "wav")][0]
    assert wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt " and same_audio(pcm_samples(wav[44:]), pcm)
    flac, _ = decode(results[("create", "flac")][0])
    assert same_audio(np.round(flac * 32768).astype(np.int16), pcm)  # lossless


def test_sse_events(cv_server, results):
    client = cv_server.client()
    with client.audio.speech.with_streaming_response.create(
            model="tiny", input=TEXT, voice="vivian", response_format="pcm", stream_format="sse",
            extra_body={"max_new_tokens": N_TOKENS, **GREEDY}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert same_audio(pcm_samples(audio), pcm_samples(results[("create", "pcm")][0]))
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == len(audio) // 2 // SPF
    assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_changes_duration_not_pitch(cv_server, results, speed):
    pcm = pcm_samples(results[("create", "pcm")][0])
    got = pcm_samples(speak(cv_server.client(), TEXT, "pcm", N_TOKENS, speed=speed))
    assert abs(len(got) - round(len(pcm) / speed)) <= 1
    sse_done = None
    with cv_server.client().audio.speech.with_streaming_response.create(
            model="tiny", input=TEXT, voice="vivian", response_format="pcm", stream_format="sse", speed=speed,
            extra_body={"max_new_tokens": N_TOKENS, **GREEDY}) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"speech.audio.done"' in line:
                sse_done = json.loads(line[5:])
    assert abs(sse_done["audio_seconds"] - len(got) / SR) < 1e-3


def test_concurrent_clients(cv_server):
    """Six clients with their own seeds at once (more than the 4 slots): all served, all distinct."""
    client = cv_server.client()
    start = threading.Barrier(6)

    def one(i):
        start.wait()
        r = client.audio.speech.create(model="tiny", input=f"Client number {i} speaking.", voice="ryan",
                                       response_format="pcm", extra_body={"max_new_tokens": 8, "seed": i})
        return pcm_samples(r.content)

    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(one, range(6)))
    assert all(len(o) > 0 and len(o) % SPF == 0 for o in outs)
    assert len({o.tobytes() for o in outs}) == 6
    cv_server.wait_idle()


def test_batched_equals_alone(cv_server):
    """Greedy requests of different texts and voices give the same audio together as each one alone."""
    client = cv_server.client()
    reqs = [("Short one.", "vivian", 10), ("A somewhat longer sentence to vary the prompt.", "dylan", 14),
            ("你好，世界。", "eric", 7), ("Third voice here.", "serena", 12)]

    def run(args):
        text, voice, n = args
        return speak(client, text, "pcm", n, voice=voice)

    alone = [run(r) for r in reqs]
    start = threading.Barrier(len(reqs))

    def together(args):
        start.wait()
        return run(args)

    with ThreadPoolExecutor(len(reqs)) as pool:
        batched = list(pool.map(together, reqs))
    for a, b, r in zip(alone, batched, reqs):
        assert len(a) > 0 and same_audio(pcm_samples(a), pcm_samples(b)), r


def test_disconnect_frees_the_slot(cv_server):
    client = cv_server.client()
    cancelled = cv_server.metric("q3tts_speech_requests_total", outcome="cancelled", format="pcm")
    with client.audio.speech.with_streaming_response.create(
            model="tiny", input="A long story that the client will not wait for.", voice="aiden",
            response_format="pcm", extra_body={"max_new_tokens": 200, "seed": 3}) as r:
        first = next(r.iter_bytes())
        assert len(first) > 0
        assert cv_server.stats.active_slots == 1
    # leaving the block closes the connection mid-stream
    cv_server.wait_idle(timeout=10)
    deadline = time.time() + 5
    while cv_server.metric("q3tts_speech_requests_total", outcome="cancelled", format="pcm") < cancelled + 1:
        assert time.time() < deadline, "the cancelled stream was not booked"
        time.sleep(0.05)
    assert cv_server.metric("q3tts_active_slots") == 0


def test_disconnect_while_queued(cv_server):
    """A client that leaves before its first audio (here: while its request waits) is dropped too."""
    import httpx
    eng = cv_server.app.state.engine.engine
    slots = eng.scheduler.max_slots
    holders = []
    try:
        for i in range(slots):  # occupy every slot with long streams
            c = httpx.Client(base_url=cv_server.base_url, timeout=60)
            resp = c.send(c.build_request("POST", "/v1/audio/speech", json={
                "input": f"Holder {i} talks for a long time.", "voice": "aiden", "response_format": "pcm",
                "max_new_tokens": 200, "seed": i}), stream=True)
            holders.append((c, resp))
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(cv_server.base_url + "/v1/audio/speech", timeout=0.5, json={
                "input": "Queued and then abandoned.", "voice": "aiden", "response_format": "pcm",
                "max_new_tokens": 200})
        deadline = time.time() + 5
        while cv_server.stats.queue_depth:
            assert time.time() < deadline, "the abandoned request stayed in the queue"
            time.sleep(0.05)
    finally:
        for c, resp in holders:
            resp.close()
            c.close()
    cv_server.wait_idle(timeout=10)


def test_bad_requests_are_400_with_a_clear_message(cv_server):
    client = cv_server.client()
    cases = [
        ({"voice": "nobody"}, "voice", "vivian"),
        ({"input": "   "}, "input", "empty"),
        ({"input": "x" * 5000, "extra_body": {"split_granularity": "none"}}, "input", "at most 4096"),
        ({"speed": 5.0}, "speed", "less than or equal to 4"),
        ({"speed": 0.1}, "speed", "greater than or equal to 0.25"),
        ({"extra_body": {"temprature": 0.5}}, "temprature", "unknown field"),
        ({"extra_body": {"language": "klingon"}}, "language", "Supported"),
        ({"extra_body": {"top_p": 1.5}}, "top_p", "less than or equal to 1"),
        ({"response_format": "ogg"}, "response_format", "mp3"),
    ]
    for kw, param, words in cases:
        args = {"model": "tiny", "input": "Hello.", "voice": "vivian", "response_format": "pcm"}
        args.update(kw)
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(**args)
        err = e.value.body
        assert e.value.status_code == 400 and err["param"] == param, (kw, err)
        assert words in err["message"] and err["type"] == "invalid_request_error", (kw, err)


def test_queue_full_is_503(cv_server):
    """One request, and a long text's first segment (split_granularity), refused alike."""
    sched = cv_server.app.state.engine.engine.scheduler
    old, sched.max_queue = sched.max_queue, 0
    try:
        for extra in ({}, {"split_granularity": "sentence"}):
            with pytest.raises(openai.InternalServerError) as e:
                speak(cv_server.client(), "No room. None at all.", **extra)
            assert e.value.status_code == 503 and e.value.body["code"] == "queue_full", extra
    finally:
        sched.max_queue = old


def test_api_key(cv_server):
    settings = cv_server.app.state.settings
    settings.api_key = "sekret"
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            speak(cv_server.client(api_key="wrong"), "Who goes there?")
        assert e.value.status_code == 401 and "API key" in e.value.body["message"]
        with pytest.raises(openai.AuthenticationError):
            cv_server.client(api_key="wrong").models.list()
        assert len(pcm_samples(speak(cv_server.client(api_key="sekret"), "Friend.", max_new_tokens=4))) > 0
        with cv_server.http() as h:
            assert h.get("/health").status_code == 200  # probes stay open
    finally:
        settings.api_key = None


def test_models_health_ready_metrics_and_page(cv_server):
    client = cv_server.client()
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-cv06"]
    assert models[0].model_extra["tts_model_type"] == "custom_voice"
    with cv_server.http() as h:
        assert h.get("/health").json() == {"status": "ok"}
        assert h.get("/ready").json() == {"ready": True}
        text = h.get("/metrics").text
        for name in ("q3tts_http_requests_total", "q3tts_queue_depth", "q3tts_active_slots",
                     "q3tts_time_to_first_audio_seconds_bucket", "q3tts_real_time_factor_bucket",
                     "q3tts_speech_requests_total", "q3tts_errors_total"):
            assert name in text, name
        # the engine's counters: by now the warm-up and earlier tests have been admitted and stepped
        assert cv_server.metric("q3tts_engine_steps_total") > 0
        assert cv_server.metric("q3tts_admitted_requests_total") > 0
        assert cv_server.metric("q3tts_admission_wait_seconds_total") > 0
        assert all(cv_server.metric("q3tts_engine_step_seconds_total", phase=p) > 0 for p in ("admit", "decode", "vocode"))
        # compilation as the process counts it (q3tts.engine.compile.compile_counts), read at each scrape
        traced = counters["stats"]["unique_graphs"]
        try:
            counters["stats"]["unique_graphs"] += 3
            counts = compile_counts()
            assert [cv_server.metric("q3tts_compiled_graphs_total", kind=k) for k in ("traced", "cached", "compiled")] \
                == [counts[k] for k in ("traced", "fx_hit", "fx_miss")] and counts["traced"] == traced + 3
        finally:
            counters["stats"]["unique_graphs"] = traced
        page = h.get("/")
        assert page.status_code == 200 and "<textarea" in page.text and "/v1/audio/speech" in page.text
        voices = h.get("/v1/audio/voices").json()["data"]
        assert "vivian" in [v["id"] for v in voices] and not any(v["deletable"] for v in voices)
        r = h.delete("/v1/audio/voices/vivian")
        assert r.status_code == 400 and "built-in" in r.json()["error"]["message"]
        r = h.post("/v1/audio/voices", json={"name": "me", "audio_sample": "AAAA"})
        assert r.status_code == 400 and "Base model" in r.json()["error"]["message"]
        assert h.get("/nope").json()["error"]["type"] == "not_found_error"


def test_health_turns_unhealthy_after_a_cuda_error(cv_server):
    engine = cv_server.app.state.engine
    try:
        engine.last_error = "RuntimeError: CUDA error: device-side assert triggered"
        r = cv_server.http().get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unhealthy" and "CUDA" in r.json()["last_error"]
        engine.last_error = "ValueError: one bad request"
        r = cv_server.http().get("/health")
        assert r.status_code == 200 and r.json()["last_error"] == "ValueError: one bad request"
    finally:
        engine.last_error = None


def test_a_codec_s_held_back_audio_reaches_the_engine(cv_server, monkeypatch):
    """The engine is told what each format's encoder keeps from the listener (its slack and first send count it): an
    mp3 stream's HELD_BACK_S, none for pcm."""
    from q3tts.server.encode import HELD_BACK_S

    engine = cv_server.app.state.serving.engine
    seen, submit = [], engine.submit

    def spy(prepared, stream=None, *args, **kw):
        seen.append(stream)
        return submit(prepared, stream, *args, **kw)
    monkeypatch.setattr(engine, "submit", spy)
    for fmt in ("mp3", "pcm"):
        _stream(cv_server.client(), fmt)
    assert [s.held_back_s for s in seen] == [HELD_BACK_S["mp3"], 0.0]
    assert HELD_BACK_S["mp3"] > 0


def test_a_codec_encodes_in_an_encoder_process(cv_server):
    """mp3 goes through the server's encoder processes (never its event loop's or engine's thread: a codec at many
    streams would take their cores and GIL), pcm stays in place; a finished or abandoned stream gives its worker's
    stream back."""
    import os

    pool = cv_server.app.state.serving.encoders
    data, _ = _stream(cv_server.client(), "mp3")
    assert data[:3] == b"ID3" or data[0] == 0xFF  # an mp3 stream
    live = [w for w in pool.workers if w is not None and w.alive]
    assert live and all(w.proc.pid != os.getpid() for w in live)
    with cv_server.client().audio.speech.with_streaming_response.create(
            model="tiny", input=TEXT, voice="vivian", response_format="mp3",
            extra_body={"max_new_tokens": N_TOKENS, **GREEDY}) as r:
        next(r.iter_bytes())  # the client leaves after the first bytes
    deadline = time.time() + 10
    while sum(w.streams for w in live) and time.time() < deadline:
        time.sleep(0.05)
    assert sum(w.streams for w in live) == 0
