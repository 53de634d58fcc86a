"""Faults and overload against a live server of its own (tiny CustomVoice, 2 slots, queue of 2): a full queue
answers 503 + Retry-After at once; an engine step that raises fails only the requests it held, the queued
ones are served and so is everyone after; no slot or vocoder row leaks."""

import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from .live import SPF, pcm_samples, start_server

SLOTS, QUEUE = 2, 2
FRAME_DELAY_S = 0.05  # slow the engine down so that streams overlap for certain on any CPU


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server("cv06", tmp_path_factory.mktemp("voices-rel"), max_concurrent=SLOTS, max_queue=QUEUE)
    yield s
    s.stop()


@contextmanager
def patched(obj, name, make):
    """obj.name = make(original) for the duration."""
    orig = getattr(obj, name)
    setattr(obj, name, make(orig))
    try:
        yield
    finally:
        setattr(obj, name, orig)


def slow(orig):
    def decode_frame(*a, **kw):
        time.sleep(FRAME_DELAY_S)
        return orig(*a, **kw)
    return decode_frame


def fail_once(orig, calls: list):
    def wrapped(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return orig(*a, **kw)
    return wrapped


def body(i: int, frames: int = 200) -> dict:
    return {"input": f"Stream number {i}.", "voice": "aiden", "response_format": "pcm",
            "max_new_tokens": frames, "seed": i}


def open_stream(base_url: str, i: int, frames: int = 200):
    c = httpx.Client(base_url=base_url, timeout=60)
    r = c.send(c.build_request("POST", "/v1/audio/speech", json=body(i, frames)), stream=True)
    return c, r


def wait_for(cond, timeout=10.0, what=""):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def check_no_leaks(server):
    server.wait_idle(timeout=15)
    eng = server.app.state.engine.engine
    assert len(eng.vocoder.free_rows) == SLOTS, "a vocoder row leaked"
    assert sorted(eng.scheduler.free_slots) == list(range(SLOTS)), "an engine slot leaked"


def test_full_queue_is_503_at_once_with_retry_after(server):
    runner = server.app.state.engine.engine.runner
    holders, queued = [], []
    with patched(runner, "decode_frame", slow):
        try:
            for i in range(SLOTS):  # every slot streaming
                holders.append(open_stream(server.base_url, i))
            wait_for(lambda: server.stats.active_slots == SLOTS, what="slots busy")
            results = []  # the queued ones wait for their first chunk in threads
            for i in range(QUEUE):
                t = threading.Thread(target=lambda i=i: results.append(
                    httpx.post(server.base_url + "/v1/audio/speech", json=body(10 + i, 4), timeout=60)))
                t.start()
                queued.append(t)
            wait_for(lambda: server.stats.queue_depth == QUEUE, what="queue full")
            t0 = time.perf_counter()
            r = httpx.post(server.base_url + "/v1/audio/speech", json=body(99, 4), timeout=60)
            dt = time.perf_counter() - t0
            # "at once": no engine step is awaited (a step here is >= FRAME_DELAY_S, a stream >= 4 s)
            assert r.status_code == 503 and dt < 1.0, (r.status_code, dt)
            assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
            err = r.json()["error"]
            assert err["type"] == "server_busy" and err["code"] == "queue_full" and "max_queue" in err["message"]
        finally:
            for c, resp in holders:
                resp.close()
                c.close()
        for t in queued:
            t.join(timeout=60)
    assert [q.status_code for q in results] == [200] * QUEUE  # the queued ones were served once slots freed
    check_no_leaks(server)


def test_engine_fault_fails_only_the_requests_it_held(server):
    eng = server.app.state.engine.engine
    alone = httpx.post(server.base_url + "/v1/audio/speech", json=body(0, 30), timeout=60).content
    full = len(alone)
    assert full > 0
    calls = []
    got: dict[str, httpx.Response] = {}
    with patched(eng.runner, "decode_frame", slow):
        holders = [open_stream(server.base_url, 0, 30) for _ in range(SLOTS)]  # running
        iters = [r.iter_bytes() for _, r in holders]
        firsts = [next(it) for it in iters]
        wait_for(lambda: server.stats.active_slots == SLOTS, what="slots busy")
        t = threading.Thread(target=lambda: got.setdefault("queued", httpx.post(
            server.base_url + "/v1/audio/speech", json=body(0, 30), timeout=60)))
        t.start()
        wait_for(lambda: server.stats.queue_depth == 1, what="one queued")
        with patched(eng.runner, "decode_frame", lambda orig: fail_once(orig, calls)):
            wait_for(lambda: calls, what="the fault")
            # the running streams end early (the response had started: the stream just stops)
            lens = [len(f) + sum(len(b) for b in it) for f, it in zip(firsts, iters)]
            t.join(timeout=60)
    for c, r in holders:
        r.close()
        c.close()
    assert all(0 < n < full for n in lens), (lens, full)
    queued = got["queued"]  # never touched by the failing step: served in full, the same audio as alone
    assert queued.status_code == 200 and len(queued.content) == full
    print(f"fault: running streams cut at {lens} of {full} bytes; the queued one served in full")
    assert server.app.state.engine.last_error == "RuntimeError: injected fault"
    check_no_leaks(server)

    # a fault before the first audio (in the prefill) is a JSON 500, and the next request is served
    calls.clear()
    with patched(eng.runner, "prefill_padded", lambda orig: fail_once(orig, calls)):
        r = httpx.post(server.base_url + "/v1/audio/speech", json=body(5, 8), timeout=60)
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_error" and "injected fault" in err["message"]
        r = httpx.post(server.base_url + "/v1/audio/speech", json=body(5, 8), timeout=60)
        assert r.status_code == 200 and len(pcm_samples(r.content)) % SPF == 0 and r.content
    check_no_leaks(server)
    server.app.state.engine.last_error = None
