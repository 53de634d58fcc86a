"""bench.load.final_serve: the signals switch how every stream's final chunk is vocoded; streams get the same chunks
either way, their audio within float rounding."""

import numpy as np

from q3tts.engine.request import StreamOptions
from tests.engine.test_async_engine import burst
from tests.golden import fixtures as fx


def test_the_switch_sets_the_final_chunks_pieces_and_the_streams_keep_their_chunks(monkeypatch):
    from bench.load import final_serve as fs
    from q3tts.engine import vocoder
    tts = fx.tts("cv06")
    monkeypatch.setattr(vocoder, "final_pieces", vocoder.final_pieces)  # restored after the test
    calls = []
    call = tts.engine.vocoder._call
    monkeypatch.setattr(tts.engine.vocoder, "_call", lambda rows, codes: calls.append(codes.shape[2]) or call(rows, codes))

    def run(name):
        fs.apply(name)
        calls.clear()
        streams, _, _ = burst(tts, 4, 30, StreamOptions(1, 16))  # 29 frames: chunks of 1, 2, 4, 8, then a final 14
        return [[(c.frame_index, c.num_frames, c.audio) for c in s] for s in streams], sorted(calls)

    cut, cut_calls = run("cut")
    assert vocoder.final_pieces is vocoder.pieces
    padded, padded_calls = run("padded")
    assert vocoder.final_pieces is fs.PADDED
    assert padded_calls != cut_calls and len(padded_calls) < len(cut_calls)  # fewer, larger calls
    # the same frames in the same chunks; the audio within float32 rounding: a padded piece's convolutions and attention
    # sum the same terms in other groupings (tests/engine/test_vocoder.py: full decode vs streaming, 1e-5)
    assert [[c[:2] for c in s] for s in cut] == [[c[:2] for c in s] for s in padded] and all(cut)
    for a, b in zip(cut, padded):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x[2], y[2], rtol=0, atol=1e-4)
