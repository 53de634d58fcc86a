"""Long form (split_granularity): each segment's audio is that segment's request alone (and the official output where
a golden fixture has that text), joined in order with exact pauses; parallel == sequential; stream == offline;
seed + i per segment; one clone prompt for every segment."""

import numpy as np
import pytest

from q3tts import longform
from tests.golden import fixtures as fx

SR = 24000
GREEDY = {"do_sample": False, "subtalker_dosample": False}
MIXED = "HelloWorld 123 it's a mixed-case test, ok?"  # a fixture text (one sentence)


def pause(ms: int) -> np.ndarray:
    return np.zeros(ms * SR // 1000, np.float32)


def check_joined(wav: np.ndarray, parts: list[np.ndarray], pause_ms: int, atol: float = 1e-4) -> None:
    """wav == parts[0] + pause + parts[1] + ...: lengths exact, pauses exactly zero, audio within atol."""
    gap = pause(pause_ms).size
    assert wav.shape[0] == sum(p.shape[0] for p in parts) + gap * (len(parts) - 1)
    pos = 0
    for i, p in enumerate(parts):
        if i:
            assert not wav[pos: pos + gap].any(), f"pause {i} is not silence"
            pos += gap
        assert np.abs(wav[pos: pos + p.shape[0]] - p).max() <= atol, f"segment {i}"
        pos += p.shape[0]


@pytest.mark.parametrize("variant,method,kw,row", [
    ("cv06", "generate_custom_voice", {"speaker": "serena", "language": "Japanese"}, ("batch_mixed", 2)),
    ("vd17", "generate_voice_design", {"instruct": "Young woman, cheerful and fast.", "language": "French",
                                       "non_streaming_mode": False}, ("french_stream", 0)),
    ("base06", "generate_voice_clone", {"language": "Auto", "non_streaming_mode": True}, ("xvec_auto_nsm", 0)),
])
def test_each_segment_equals_the_official_output(variant, method, kw, row):
    tts = fx.tts(variant)
    if variant == "base06":
        kw = dict(kw, voice_clone_prompt=fx.case_prompt_items(variant, fx.get_case(variant, row[0])))
    wavs, sr = getattr(tts, method)(f"{MIXED}  {MIXED}\n\n{MIXED}", **kw, split_granularity="sentence", pause_ms=125,
                                    max_new_tokens=fx.manifest(variant)["greedy"]["max_new_tokens"], **GREEDY)
    official = fx.outputs(variant)[f"{row[0]}.wav.{row[1]}"].numpy()
    assert sr == SR and len(wavs) == 1
    check_joined(wavs[0], [official] * 3, 125)


TEXT = "Hi there, this is one. And here comes the second sentence! Is this the third? 你好，今天天气真不错。"


def test_segments_equal_alone_parallel_equals_sequential_stream_equals_offline():
    tts = fx.tts("cv06")
    kw = dict(speaker="vivian", language="Auto", max_new_tokens=20, **GREEDY)
    segs = longform.segments(TEXT, longform.make_options("sentence"))
    assert len(segs) == 4
    alone = [tts.generate_custom_voice(s, **kw)[0][0] for s in segs]
    split = {"split_granularity": "sentence", "pause_ms": 40}
    running, step = [], tts.engine.step
    tts.engine.step = lambda: running.append(tts.engine.scheduler.num_running) or step()
    try:
        wav = tts.generate_custom_voice(TEXT, **kw, **split)[0][0]
    finally:
        del tts.engine.step
    assert max(running) == 4  # the segments ran together
    check_joined(wav, alone, 40)
    # one segment at a time (window 1) gives the same audio as all of them at once
    prepare = lambda t, **k: tts.prepare_custom_voice(t, "vivian", "Auto", **k)  # noqa: E731
    gen = {k: v for k, v in kw.items() if k not in ("speaker", "language")}
    seq = longform.generate(tts, prepare, TEXT, longform.make_options("sentence", 40), gen, window=1)[0][0]
    assert np.array_equal(seq, wav)
    # streamed: chunks in order, the same audio (exact stateful decoder vs upstream's decode: < 1e-4)
    stream = tts.generate_custom_voice_stream(TEXT, **kw, **split, first_chunk_frames=2, chunk_frames=4)
    chunks = list(stream)
    assert stream.num_segments == 4 and stream.segments_done == 4
    assert [c.is_last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [c.frame_index for c in chunks] == list(np.cumsum([0] + [c.num_frames for c in chunks[:-1]]))
    assert len({c.request_id for c in chunks}) == 1 and chunks[-1].finish_reason in ("stop", "length")
    streamed = np.concatenate([c.audio for c in chunks])
    check_joined(streamed, alone, 40)


def test_sampling_uses_seed_plus_i_per_segment():
    tts = fx.tts("cv06")
    kw = {"speaker": "vivian", "max_new_tokens": 12, "do_sample": True, "subtalker_dosample": True}
    segs = longform.segments(TEXT, longform.make_options("sentence"))
    wav = tts.generate_custom_voice(TEXT, **kw, seed=7, split_granularity="sentence")[0][0]
    alone = [tts.generate_custom_voice(s, **kw, seed=7 + i)[0][0] for i, s in enumerate(segs)]
    check_joined(wav, alone, 0)


def test_voice_clone_prompt_made_once(monkeypatch):
    tts = fx.tts("base06")
    calls = []
    make = tts.create_voice_clone_prompt
    monkeypatch.setattr(tts, "create_voice_clone_prompt", lambda *a, **k: calls.append(1) or make(*a, **k))
    ref = (np.random.default_rng(0).standard_normal(SR * 2).astype(np.float32) * 0.1, SR)
    kw = dict(language="English", ref_audio=ref, x_vector_only_mode=True, max_new_tokens=10, **GREEDY)
    wav = tts.generate_voice_clone(TEXT, **kw, split_granularity="clause")[0][0]
    assert len(calls) == 1
    items = make(ref, None, True)
    segs = longform.segments(TEXT, longform.make_options("clause"))
    alone = [tts.generate_voice_clone(s, language="English", voice_clone_prompt=items, max_new_tokens=10,
                                      **GREEDY)[0][0] for s in segs]
    check_joined(wav, alone, 0)
    chunks = list(tts.generate_voice_clone_stream(TEXT, **kw, split_granularity="clause"))
    assert len(calls) == 2  # once for the streamed call too
    check_joined(np.concatenate([c.audio for c in chunks]), alone, 0)


def test_default_is_one_request_and_bad_options_are_named():
    tts = fx.tts("cv06")
    one = tts.generate_custom_voice(TEXT, "vivian", max_new_tokens=8, **GREEDY)[0][0]
    none = tts.generate_custom_voice(TEXT, "vivian", max_new_tokens=8, split_granularity="none", **GREEDY)[0][0]
    assert np.array_equal(one, none) and one.shape[0] == 7 * 1920
    with pytest.raises(ValueError, match="split_granularity must be one of"):
        tts.generate_custom_voice(TEXT, "vivian", split_granularity="word")
    with pytest.raises(ValueError, match="pause_ms must be an integer"):
        tts.generate_custom_voice(TEXT, "vivian", split_granularity="sentence", pause_ms=-1)
    with pytest.raises(ValueError, match="one text"):
        tts.generate_custom_voice([TEXT, TEXT], "vivian", split_granularity="sentence")
    with pytest.raises(ValueError, match="Unsupported speaker"):  # checked before any work
        tts.generate_custom_voice(TEXT, "nobody", split_granularity="sentence")
    with pytest.raises(ValueError, match="text_stream"):
        tts.generate_custom_voice_stream(text_stream=["a"], speaker="vivian", split_granularity="sentence")
    assert tts.engine.scheduler.num_running == 0 and tts.engine.scheduler.queue_depth == 0


def test_leaving_a_stream_early_aborts_every_segment():
    tts = fx.tts("cv06")
    stream = tts.generate_custom_voice_stream(TEXT, "vivian", max_new_tokens=30, split_granularity="sentence",
                                              **GREEDY)
    next(stream)
    stream.close()
    assert tts.engine.scheduler.num_running == 0 and tts.engine.scheduler.queue_depth == 0


# --------------------------------------------------------------------------- the server's path, on a fake engine
class FakeHandle:
    def __init__(self, i, fail=False):
        self.i, self.fail, self.closed = i, fail, False

    async def chunks(self):
        from q3tts.engine.engine import AudioChunk
        for k in range(2):
            last = k == 1
            yield AudioChunk(f"s{self.i}", np.full(4, self.i, np.float32), 8000, k, 1, last,
                             ("error" if self.fail else "stop") if last else None, 0.0,
                             "boom" if self.fail and last else None)

    def close(self):
        self.closed = True


class FakeEngine:
    """AsyncEngine's submit: refuses with QueueFullError when `full` says so; records what is in flight."""

    def __init__(self, slots=2, full=lambda n: False, fail_at=None):
        from types import SimpleNamespace
        self.engine = SimpleNamespace(scheduler=SimpleNamespace(max_slots=slots))
        self.full, self.fail_at, self.handles, self.tries = full, fail_at, [], 0

    def submit(self, p, options, request_id, arrival):
        from q3tts.engine.scheduler import QueueFullError
        self.tries += 1
        if self.full(self.tries):
            raise QueueFullError("full")
        h = FakeHandle(p, p == self.fail_at)
        self.handles.append(h)
        return h


async def _collect(engine, n, pause_ms=0):
    async def prepare(i):
        return i
    joiner = longform.Joiner("long", n, 8000, pause_ms)
    return [c async for c in longform.generate_async(engine, prepare, joiner, None)]


def test_generate_async_in_order_windowed_and_a_full_queue_delays():
    import asyncio
    eng = FakeEngine(full=lambda t: t % 3 == 0)  # every third submission is refused
    chunks = asyncio.run(_collect(eng, 7, pause_ms=1))
    audio = np.concatenate([c.audio for c in chunks])
    expected = np.concatenate([np.concatenate([np.zeros(8 if i else 0), np.full(8, i)]) for i in range(7)])
    assert np.array_equal(audio, expected)  # in order, 8 zero samples (1 ms at 8 kHz) between segments
    assert [h.i for h in eng.handles] == list(range(7)) and chunks[-1].is_last and chunks[-1].finish_reason == "stop"
    assert [c.frame_index for c in chunks] == list(range(14))
    with pytest.raises(Exception, match="full"):  # the first segment refused: the caller answers 503
        asyncio.run(_collect(FakeEngine(full=lambda t: True), 3))


def test_generate_async_a_failed_segment_ends_the_stream_and_closes_the_rest():
    import asyncio
    eng = FakeEngine(slots=2, fail_at=1)
    chunks = asyncio.run(_collect(eng, 9))
    assert chunks[-1].is_last and chunks[-1].finish_reason == "error" and chunks[-1].error == "boom"
    assert {c.audio[0] for c in chunks} == {0, 1}
    assert len(eng.handles) <= 1 + 4 and all(h.closed for h in eng.handles[2:])  # window: twice the slots
