"""bench.load.deliver_serve: per_chunk hands every chunk to the event loop in a callback of its own, batched several
in one; the streams get the same chunks either way."""

import asyncio

from q3tts.engine.async_engine import AsyncEngine
from q3tts.engine.request import StreamOptions
from tests.golden import fixtures as fx


def test_per_chunk_wakes_the_loop_per_chunk_and_batched_fewer_times(monkeypatch):
    from bench.load import deliver_serve as ds
    monkeypatch.setattr(AsyncEngine, "_deliver", ds.deliver)
    monkeypatch.setitem(ds.MODE, "per_chunk", False)
    tts = fx.tts("cv06")
    server = AsyncEngine.of(tts.engine)

    def burst(name):
        ds.apply(name)
        wakes = []

        async def serve_all():
            loop = asyncio.get_running_loop()
            real = loop.call_soon_threadsafe
            loop.call_soon_threadsafe = lambda *a, **k: (wakes.append(a[0]), real(*a, **k))[1]

            async def one(i):
                p = tts.prepare_custom_voice(f"Stream {i} of a burst.", "ryan", max_new_tokens=10,
                                             do_sample=False, subtalker_dosample=False)[0]
                return [(c.frame_index, c.num_frames, c.audio.tobytes()) async for c in
                        server.generate(p, StreamOptions(1, 2))]

            return await asyncio.gather(*(one(i) for i in range(4)))

        steps0 = tts.engine.counters.steps
        streams = asyncio.run(serve_all())
        return streams, len(wakes), tts.engine.counters.steps - steps0, sum(map(len, streams))

    per_chunk, wakes, steps, chunks = burst("per_chunk")
    assert wakes == chunks > steps
    batched, wakes, steps, chunks = burst("batched")
    assert wakes < chunks and batched == per_chunk
