"""bench.load.turn_serve: the signals switch the host turn of every engine built; streams get the same chunks with the
turn on or off."""

import numpy as np

from tests.engine.test_async_engine import burst
from tests.golden import fixtures as fx


def test_the_switch_sets_every_engines_turn_and_the_streams_keep_their_chunks(monkeypatch):
    from bench.load import turn_serve as ts
    tts = fx.tts("cv06")
    monkeypatch.setattr(ts, "ENGINES", [tts.engine])
    assert not tts.engine.turn.enabled  # a CPU engine's steps are host work: no turn by default

    def run(name):
        ts.apply(name)
        streams, _, _ = burst(tts, 4, 10)
        return [[(c.frame_index, c.num_frames, c.audio) for c in s] for s in streams]

    try:
        on = run("turn")
        assert tts.engine.turn.enabled
        off = run("free")
        assert not tts.engine.turn.enabled
    finally:
        tts.engine.turn.enabled = False
    # the same frames in the same chunks; the audio within float32 rounding: the turn changes when requests reach a
    # step, so which rows share a vocoder call, and a CPU convolution's sums group differently by the batch; through the
    # decoder's layers that moves a sample by up to ~1e-5 (measured), against samples of ~1e-2
    assert [[c[:2] for c in s] for s in off] == [[c[:2] for c in s] for s in on] and all(on)
    for a, b in zip(off, on):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x[2], y[2], rtol=0, atol=1e-4)
