"""q3tts.server.serving's process-wide pieces: the heap frozen after the warm-up, slow collections logged. Each test
runs in a fresh interpreter: the freeze is process-wide, and the live servers of other tests freeze and thaw it."""

import subprocess
import sys
import textwrap


def run_fresh(code: str) -> None:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_freeze_heap_moves_the_survivors_out_of_later_collections():
    run_fresh("""
        import gc
        from q3tts.server import serving
        kept = [[i] for i in range(1000)]  # alive at the freeze: out of every generation a collection scans
        frozen = serving.freeze_heap()
        assert frozen == gc.get_freeze_count() >= len(kept)
        made = [[i] for i in range(10)]  # made after it: collected as usual
        gc.collect()
        scanned = {id(o) for o in gc.get_objects(generation=2)}
        assert not any(id(x) in scanned for x in kept) and all(id(x) in scanned for x in made)
        serving.thaw_heap()  # the app's shutdown: collectable again, no longer logged
        scanned = {id(o) for o in gc.get_objects(generation=2)}
        assert all(id(x) in scanned for x in kept) and gc.get_freeze_count() == 0
        assert serving._log_slow_collections not in gc.callbacks
    """)


def test_a_slow_collection_is_logged_once_per_collection():
    run_fresh("""
        import gc, logging
        from q3tts.server import serving
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("q3tts.server").addHandler(handler)
        serving.freeze_heap()
        serving.freeze_heap()  # (the callback is installed once)
        assert gc.callbacks.count(serving._log_slow_collections) == 1
        gc.collect()
        assert not records  # what is left after the freeze: far under GC_SLOW_S
        serving.GC_SLOW_S = 0.0
        gc.collect()
        slow = [r for r in records if "cycle collection of generation 2" in r.getMessage()]
        assert len(slow) == 1 and slow[0].levelno == logging.WARNING, [r.getMessage() for r in records]
    """)
