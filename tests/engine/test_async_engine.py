"""One loop steps an Engine: the Python API and the server submit through the same AsyncEngine, at the same time,
and each gets what it gets alone."""

import asyncio
import threading
import time

import numpy as np
import pytest

from q3tts.engine.async_engine import AsyncEngine
from q3tts.engine.request import StreamOptions
from tests.golden import fixtures as fx

GREEDY = dict(do_sample=False, subtalker_dosample=False)


def test_a_tts_call_and_the_server_share_one_loop_and_get_what_they_get_alone():
    tts = fx.tts("cv06")

    first_api_chunk = []

    def api_call():  # the Python API, from a thread of its own
        chunks = []
        for c in tts.generate_custom_voice_stream("A call from the Python API.", "vivian", max_new_tokens=24,
                                                  first_chunk_frames=1, chunk_frames=4, **GREEDY):
            first_api_chunk.append(time.perf_counter())
            chunks.append(c)
        return np.concatenate([c.audio for c in chunks]), tts.generate_custom_voice(
            "Offline, beside the stream.", "ryan", max_new_tokens=12, **GREEDY)[0][0]

    def server_request():
        return tts.prepare_custom_voice("The server streams this one meanwhile.", "ryan", max_new_tokens=40,
                                        **GREEDY)[0]

    server = AsyncEngine.of(tts.engine)
    assert tts.driver is server  # the API's calls go through the server's loop
    with pytest.raises(RuntimeError, match="another AsyncEngine"):
        AsyncEngine(tts.engine)

    last = [0.0]

    async def serve(during=None):
        chunks = []
        async for c in server.generate(server_request(), StreamOptions(1, 4)):
            chunks.append(c)
            last[0] = time.perf_counter()
            if during is not None and len(chunks) == 1:  # the API call starts while this stream runs
                during.start()
        return chunks

    alone_stream, alone_offline = api_call()
    alone_server = asyncio.run(serve())

    out = {}
    first_api_chunk.clear()
    api = threading.Thread(target=lambda: out.update(api=api_call()))
    together_server = asyncio.run(serve(during=api))
    api.join(timeout=600)
    assert not api.is_alive()
    assert first_api_chunk[0] < last[0]  # they ran at the same time
    stream, offline = out["api"]
    np.testing.assert_array_equal(stream, alone_stream)
    np.testing.assert_array_equal(offline, alone_offline)
    np.testing.assert_array_equal(np.concatenate([c.audio for c in together_server]),
                                  np.concatenate([c.audio for c in alone_server]))
    assert together_server[-1].is_last and together_server[-1].finish_reason in ("stop", "length")
    s = tts.engine.scheduler
    assert s.num_running == 0 and s.queue_depth == 0


@pytest.mark.gpu
def test_on_cuda_the_loop_steps_on_a_stream_above_the_default_and_the_codes_do_not_change():
    """With step_stream set (the server beside a forced aligner) the loop's steps run on a stream of higher priority
    than the default's, ordered after what other threads queued on the default stream: the codes are those of steps
    on the default stream, bit for bit (fp32, greedy)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from q3tts import TTS
    from q3tts.engine.async_engine import step_stream
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cuda", dtype=torch.float32)
    driver = tts.driver
    assert driver.step_stream is None  # (no other work shares the GPU)
    stream = driver.step_stream = step_stream(torch.device("cuda"))
    assert stream is not None and stream.priority < torch.cuda.default_stream().priority

    def codes():
        prepared = tts.prepare_custom_voice(["A stream above the default.", "And a second request."],
                                            ["vivian", "ryan"], max_new_tokens=30, **GREEDY)
        return driver.generate_codes(prepared)

    high = codes()
    driver.step_stream = None
    default = codes()
    assert all(torch.equal(a, b) for a, b in zip(high, default)) and len(high) == 2


def test_the_loop_thread_compiles_under_the_settings_of_the_thread_that_built_it():
    """torch keeps Dynamo's settings per context from 2.13 on: the loop thread starts in its creator's, so what
    compile_layers set (room for the layer's variants, no float symbols...) holds where the engine compiles."""
    import torch._dynamo

    seen = []

    class Engine:  # the one call the loop makes while idle
        wake = threading.Event()

        def wait_for_work(self):
            seen.append(torch._dynamo.config.cache_size_limit)
            time.sleep(0.01)
            return False

    limit = torch._dynamo.config.cache_size_limit + 17  # (no default has it)
    with torch._dynamo.config.patch(cache_size_limit=limit):
        driver = AsyncEngine(Engine())
    try:
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen and seen[0] == limit
    finally:
        driver.shutdown()


def burst(tts, n: int, max_new_tokens: int, stream: StreamOptions | None = None) -> tuple[list[list], int, int]:
    """n streams of one event loop at once through the engine's AsyncEngine, in chunks of `stream` (default 1, then
    2 frames) -> (each stream's chunks, the loop's call_soon_threadsafe calls while they ran, the engine's steps)."""
    server = AsyncEngine.of(tts.engine)
    wakes = []

    async def serve_all():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: (wakes.append(a[0]), real(*a, **k))[1]

        async def one(text, voice):
            prepared = tts.prepare_custom_voice(text, voice, max_new_tokens=max_new_tokens, **GREEDY)[0]
            return [c async for c in server.generate(prepared, stream or StreamOptions(1, 2))]

        return await asyncio.gather(*(one(f"Stream number {i} of a burst.", ["ryan", "vivian"][i % 2])
                                      for i in range(n)))

    steps0 = tts.engine.counters.steps
    streams = asyncio.run(serve_all())
    return streams, len(wakes), tts.engine.counters.steps - steps0


def test_a_step_hands_its_chunks_to_the_event_loop_in_one_callback():
    """Streams of one event loop get a step's chunks through one call_soon_threadsafe (the loop is woken once they are
    all in), not one per chunk; each stream its chunks in order and complete."""
    streams, wakes, steps = burst(fx.tts("cv06"), 6, 12)
    chunks = sum(len(s) for s in streams)
    for s in streams:
        assert [c.frame_index for c in s] == sorted(c.frame_index for c in s) and s[-1].is_last
        assert not any(c.is_last for c in s[:-1])
    assert chunks > steps  # several streams' chunks come from one step ...
    assert wakes <= steps  # ... and reach the loop together: at most one wake-up per step
