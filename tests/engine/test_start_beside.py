"""The engine's start with the vocoder's warm-ups on a thread beside the runner's (q3tts.engine.graphs.StartBeside):
the handover's order, errors from either thread, the switch. On a CPU nothing is captured: what only a GPU shows
(the same graphs and audio, the time saved) is in test_start_beside_gpu.py and bench/startup.py."""

import threading

import numpy as np
import pytest
import torch

from q3tts.engine import graphs
from q3tts.engine.engine import Engine
from q3tts.engine.graphs import StartBeside, want_overlap
from q3tts.engine.request import StreamOptions
from q3tts.engine.runner import ModelRunner
from q3tts.engine.vocoder import StreamingVocoder
from tests.engine.steps import run_to_completion
from tests.golden import fixtures as fx

CPU = torch.device("cpu")


def test_the_thread_runs_up_to_the_handover_then_waits_for_join():
    events, here = [], threading.Event()

    def fn(handover):
        events.append(("warm", threading.current_thread().name))
        here.set()
        handover()
        events.append(("capture", threading.current_thread().name))
    start = StartBeside(fn, CPU, "beside-test")
    assert here.wait(10)
    events.append(("runner", threading.current_thread().name))  # this thread's work while the other waits
    start.join()
    assert [e for e, _ in events] == ["warm", "runner", "capture"]
    assert events[0][1] == events[2][1] == "beside-test" != events[1][1]
    t = start.times  # (the engine logs them: how long the runner waited for the vocoder)
    assert 0 <= t["handover"] <= t["join"] <= t["done"]


def test_an_error_on_the_thread_is_raised_by_join_once():
    def fn(handover):
        raise ValueError("vocoder broke")
    start = StartBeside(fn, CPU, "beside-test")
    with pytest.raises(ValueError, match="vocoder broke"):
        start.join()
    start.join()  # raised once: a second join (the engine's after the handover) has nothing to raise


def test_cancel_stops_the_thread_at_its_handover_and_logs_its_own_error(caplog):
    done = []

    def fn(handover):
        handover()
        done.append(True)  # never reached: the engine's start failed
    start = StartBeside(fn, CPU, "beside-test")
    start.join(cancel=True)
    start._thread.join(10)
    assert not done and not start._thread.is_alive()

    def broken(handover):
        raise RuntimeError("also broken")
    start = StartBeside(broken, CPU, "beside-test")
    with caplog.at_level("WARNING", logger="q3tts.engine"):
        start.join(cancel=True)  # the engine's own error is the one raised; this one is logged
    assert "also broken" in caplog.text


def test_the_thread_stays_until_released_and_an_engine_releases_it_when_collected():
    """NOTE(keep-alive): the thread that captured the vocoder's graphs outlives join (its thread-local cuDNN state)."""
    start = StartBeside(lambda handover: handover(), CPU, "beside-test")
    start.join()
    assert start._thread.is_alive()
    start.release()
    start._thread.join(10)
    assert not start._thread.is_alive()

    import gc
    eng = Engine(fx.tts("cv06").ckpt, max_slots=1, max_seq_len=256, overlap_capture=True)
    thread = next(t for t in threading.enumerate() if t.name == "q3tts-vocoder-start" and t.is_alive())
    del eng
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_the_switch(monkeypatch):
    monkeypatch.delenv(graphs.OVERLAP_ENV, raising=False)
    assert want_overlap(torch.device("cuda")) and not want_overlap(CPU)
    assert want_overlap(CPU, True) and not want_overlap(torch.device("cuda"), False)
    monkeypatch.setenv(graphs.OVERLAP_ENV, "0")
    assert not want_overlap(torch.device("cuda"))
    monkeypatch.setenv(graphs.OVERLAP_ENV, "1")
    assert want_overlap(CPU) and not want_overlap(CPU, False)


def record_threads(monkeypatch):
    """Which thread ran the vocoder's capture_graphs and with which arguments."""
    seen = []
    orig = StreamingVocoder.capture_graphs

    def spy(self, *args, **kw):
        seen.append((threading.current_thread() is threading.main_thread(), args, kw))
        return orig(self, *args, **kw)
    monkeypatch.setattr(StreamingVocoder, "capture_graphs", spy)
    return seen


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_start_on_either_path_gives_the_same_audio(monkeypatch, overlap):
    """The vocoder's start runs on its own thread with the switch on (every key warmed, the handover called), on this
    one with it off; the engine streams the same audio either way."""
    tts = fx.tts("cv06")
    seen = record_threads(monkeypatch)
    eng = Engine(tts.ckpt, max_slots=2, max_seq_len=256, overlap_capture=overlap)
    assert len(seen) == 1 and seen[0][0] is not overlap
    if overlap:
        assert seen[0][1][0] is True and callable(seen[0][1][1])  # every_key, handover
    prepared = tts.prepare_custom_voice("Either way.", "vivian", do_sample=False, subtalker_dosample=False,
                                        max_new_tokens=8)
    req = eng.add_request(prepared[0], StreamOptions(1, 2))
    chunks = run_to_completion(eng, [req])
    audio = np.concatenate([c.audio for c in chunks])
    ref = Engine(tts.ckpt, max_slots=2, max_seq_len=256, overlap_capture=False)
    ref_chunks = run_to_completion(ref, [ref.add_request(prepared[0], StreamOptions(1, 2))])
    assert np.array_equal(audio, np.concatenate([c.audio for c in ref_chunks]))


def test_a_vocoder_error_fails_the_engine_start(monkeypatch):
    def broken(self, *args, **kw):
        raise RuntimeError("cuDNN said no")
    monkeypatch.setattr(StreamingVocoder, "capture_graphs", broken)
    with pytest.raises(RuntimeError, match="cuDNN said no"):
        Engine(fx.tts("cv06").ckpt, max_slots=1, max_seq_len=256, overlap_capture=True)


def test_a_runner_error_stops_the_vocoder_thread_and_is_the_one_raised(monkeypatch):
    started, finished = threading.Event(), []
    orig = StreamingVocoder.capture_graphs

    def slow(self, every_key=False, before_capture=None):
        started.set()
        orig(self, every_key, before_capture)  # waits at the handover: cancelled there
        finished.append(True)

    def broken(self, *args, **kw):
        assert started.wait(10)
        raise ValueError("compile failed")
    monkeypatch.setattr(StreamingVocoder, "capture_graphs", slow)
    monkeypatch.setattr(ModelRunner, "capture_graphs", broken)
    alive = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match="compile failed"):
        Engine(fx.tts("cv06").ckpt, max_slots=1, max_seq_len=256, overlap_capture=True)
    assert not finished
    for t in threading.enumerate():
        if t.ident not in alive and t.name == "q3tts-vocoder-start":
            t.join(10)
            assert not t.is_alive()


def test_a_runner_error_after_the_handover_releases_the_vocoder_thread(monkeypatch):
    def broken_after(self, before_capture=None):
        before_capture()  # the vocoder's graphs are made, then the runner's capture fails
        raise RuntimeError("capture failed")
    monkeypatch.setattr(ModelRunner, "capture_graphs", broken_after)
    alive = {t.ident for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="capture failed"):
        Engine(fx.tts("cv06").ckpt, max_slots=1, max_seq_len=256, overlap_capture=True)
    mine = [t for t in threading.enumerate() if t.ident not in alive and t.name == "q3tts-vocoder-start"]
    assert len(mine) <= 1
    for t in mine:
        t.join(10)
        assert not t.is_alive()
