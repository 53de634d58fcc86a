"""bench.load.deliver_serve: per_chunk hands every chunk to the event loop in a callback of its own, batched several
in one; the streams get the same chunks either way."""

from q3tts.engine.async_engine import AsyncEngine
from tests.engine.test_async_engine import burst
from tests.golden import fixtures as fx


def test_per_chunk_wakes_the_loop_per_chunk_and_batched_fewer_times(monkeypatch):
    from bench.load import deliver_serve as ds
    monkeypatch.setattr(AsyncEngine, "_deliver", ds.deliver)
    monkeypatch.setitem(ds.MODE, "per_chunk", False)
    tts = fx.tts("cv06")

    def run(name):
        ds.apply(name)
        streams, wakes, steps = burst(tts, 4, 10)
        return [[(c.frame_index, c.num_frames, c.audio.tobytes()) for c in s] for s in streams], wakes, steps

    per_chunk, wakes, steps = run("per_chunk")
    chunks = sum(map(len, per_chunk))
    assert wakes == chunks > steps
    batched, wakes, steps = run("batched")
    assert wakes <= steps < chunks and batched == per_chunk  # a step's chunks wake the loop once
