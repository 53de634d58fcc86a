"""bench.load.turn_serve: the signals switch the host turn of every engine built; streams get the same chunks with the
turn on or off."""

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
        return [[(c.frame_index, c.num_frames, c.audio.tobytes()) for c in s] for s in streams]

    try:
        on = run("turn")
        assert tts.engine.turn.enabled
        off = run("free")
        assert not tts.engine.turn.enabled
    finally:
        tts.engine.turn.enabled = False
    assert on == off and all(on)
