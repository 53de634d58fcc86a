"""q3tts.server.serving's process-wide pieces: the heap frozen after the warm-up, slow collections logged."""

import gc
import logging

import pytest

from q3tts.server import serving


@pytest.fixture
def thawed():
    yield
    serving.thaw_heap()
    assert serving._log_slow_collections not in gc.callbacks and gc.get_freeze_count() == 0


def test_freeze_heap_moves_the_survivors_out_of_later_collections(thawed):
    kept = [[i] for i in range(1000)]  # alive at the freeze: frozen, out of every generation a collection scans
    frozen = serving.freeze_heap()
    assert frozen == gc.get_freeze_count() >= len(kept)
    made = [[i] for i in range(10)]  # made after it: collected as usual
    gc.collect()
    scanned = {id(o) for o in gc.get_objects(generation=2)}
    assert not any(id(x) in scanned for x in kept) and all(id(x) in scanned for x in made)
    serving.thaw_heap()  # (what the app's shutdown does)
    scanned = {id(o) for o in gc.get_objects(generation=2)}
    assert all(id(x) in scanned for x in kept)


def test_a_slow_collection_is_logged_once_per_collection(thawed, monkeypatch, caplog):
    serving.freeze_heap()
    serving.freeze_heap()  # (the callback is installed once)
    assert gc.callbacks.count(serving._log_slow_collections) == 1
    monkeypatch.setattr(serving, "GC_SLOW_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="q3tts.server"):
        gc.collect()
    slow = [r for r in caplog.records if "cycle collection of generation 2" in r.getMessage()]
    assert len(slow) == 1
