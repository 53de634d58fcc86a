"""Batch-invariant mode on a GPU: a request's codes and audio are the same alone as beside other requests, admitted
together or one after another, beside rows that sit out frames waiting for streamed text, through captured graphs or
eager frames (bf16, random weights at the real dimensions; bench/invariance.py is the same check as a script).
tests/server/test_invariant_gpu.py: the same through `q3tts serve --batch-invariant`."""

import pytest
import torch

from q3tts import TTS, invariant
from q3tts.engine.engine import Engine
from tests.engine.steps import generate_codes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    """The requests whose codes differ (empty: all identical)."""
    assert len(a) == len(b)
    return [i for i, (x, y) in enumerate(zip(a, b)) if not (x.shape == y.shape and torch.equal(x, y))]


@pytest.fixture(scope="module", params=["0.6B-CustomVoice", "1.7B-CustomVoice"])
def inv(request, real_checkpoint):
    """(TTS in batch-invariant mode, its 16 mixed requests, each one's codes alone); 64 slots for 0.6B (the batch of
    64), 16 for 1.7B."""
    from bench.invariance import requests
    slots = 64 if request.param.startswith("0.6B") else 16
    tts = TTS.from_pretrained(real_checkpoint(request.param), device="cuda", dtype=torch.bfloat16,
                              max_batch_size=slots, max_seq_len=256, batch_invariant=True)
    ps = requests(tts, 16, 24)
    alone = [generate_codes(tts.engine, [p])[0] for p in ps]
    yield tts, ps, alone
    invariant.set_enabled(False)  # process-wide: the other modules' engines run the default mode


# NOTE: the tests that step tts.engine by hand come before test_pcm_alone_equals_batched, whose tts.stream starts
# the engine's one owner (AsyncEngine) for good


def test_codes_alone_equal_batched_and_staggered(inv):
    """Mixed lengths, speakers, greedy / top-k / full (top_k 0) samplers and the streamed-text layout: alone == in a
    batch of 3, of 16, in reverse order, and admitted one every 3 frames (rows join and leave the batch)."""
    from bench.invariance import staggered
    tts, ps, alone = inv
    eng = tts.engine
    assert identical(alone[:3], generate_codes(eng, ps[:3])) == []
    assert identical(alone, generate_codes(eng, ps)) == []
    assert identical(alone[:5][::-1], generate_codes(eng, ps[:5][::-1])) == []
    assert identical(alone, staggered(eng, ps, 3)) == []


def test_codes_alone_equal_in_a_batch_of_64(inv):
    """0.6B, 64 slots: 64 requests (24-36 frames, nine speakers, the four samplers, both layouts), each alone == all
    64 admitted together == admitted one per frame."""
    from bench.invariance import requests, staggered
    tts, ps, alone = inv
    eng = tts.engine
    if eng.scheduler.max_slots < 64:
        pytest.skip("the batch of 64 runs on the 0.6B engine (64 slots)")
    ps64 = requests(tts, 64, 24)  # the first 16 are the fixture's
    alone64 = alone + [generate_codes(eng, [p])[0] for p in ps64[16:]]
    assert identical(alone64, generate_codes(eng, ps64)) == []
    assert identical(alone64, staggered(eng, ps64, 1)) == []


def test_row_waiting_for_streamed_text_equals_whole_text_alone(inv):
    """A seeded request whose text comes in pieces of 1-3 characters, one every 3 steps, beside 15 running requests:
    its row sits out the frames its next word has not reached, and its codes equal those of its whole text alone
    (the same streamed-text layout); the 15 beside it equal theirs alone."""
    from bench.invariance import parked, streamed_text
    tts, ps, alone = inv
    eng = tts.engine
    whole, fed, pieces = streamed_text(tts)
    want = generate_codes(eng, [whole])[0]
    others, got, sat_out = parked(eng, ps[:15], fed, pieces)
    assert sat_out > 0  # it did wait beside running rows
    assert got.shape == want.shape and torch.equal(got, want)
    assert identical(alone[:15], others) == []


def test_eager_frames_equal_graphs(inv):
    """The engine without CUDA graphs (frames launched from Python) gives the captured frames' codes, batched."""
    tts, ps, alone = inv
    eager = Engine(tts.ckpt, max_slots=4, max_seq_len=256, use_cuda_graphs=False, batch_invariant=True)
    assert identical(alone[:4], generate_codes(eager, ps[:4])) == []


def test_pcm_alone_equals_batched(inv):
    """Streamed audio (the pooled streaming vocoder) alone == beside two other streams; offline audio (TTS.decode)
    of a request alone == decoded with seven others."""
    from bench.invariance import streamed
    tts, ps, alone = inv
    assert [streamed(tts, [p])[0] for p in ps[:3]] == streamed(tts, ps[:3])
    together = tts.decode(alone[:8])
    assert all(tts.decode([c])[0].tobytes() == w.tobytes() for c, w in zip(alone[:8], together))


@pytest.fixture(scope="module")
def clones(real_checkpoint):
    """(1.7B-Base TTS in batch-invariant mode, 8 slots; its voices: two ICL clones and an x-vector-only one)."""
    from bench.invariance import clone_voices
    tts = TTS.from_pretrained(real_checkpoint("1.7B-Base"), device="cuda", dtype=torch.bfloat16, max_batch_size=8,
                              max_seq_len=256, batch_invariant=True)
    yield tts, clone_voices(tts)
    invariant.set_enabled(False)


def test_voice_clones_alone_equal_batched(clones):
    """1.7B-Base: 8 requests cloning a short and a long ICL reference (their codes in the prompt, their audio in front
    of the decoder) and an x-vector, with the four samplers and both layouts. Codes alone == in a batch of 8 ==
    admitted one every 2 frames == with eager frames (4); a streamed text cloning the x-vector, sitting out
    frames beside 7 of them == its whole text alone; streamed PCM alone == in a batch of 3 (one per voice); offline
    PCM (the reference decoded in front, then cut) alone == decoded together. One test: one engine to build."""
    from bench.invariance import parked, requests, staggered, streamed, streamed_text
    tts, voices = clones
    eng = tts.engine
    ps = requests(tts, 8, 20, voices)
    alone = [generate_codes(eng, [p])[0] for p in ps]
    whole, fed, pieces = streamed_text(tts, voices)
    want = generate_codes(eng, [whole])[0]
    others, got, sat_out = parked(eng, ps[:7], fed, pieces)
    eager = Engine(tts.ckpt, max_slots=4, max_seq_len=256, use_cuda_graphs=False, batch_invariant=True)
    refs = [p.ref_codes for p in ps]
    together = tts.decode(alone, refs)
    differ = {
        "batch of 8": identical(alone, generate_codes(eng, ps)),
        "staggered": identical(alone, staggered(eng, ps, 2)),
        "beside the waiting row": identical(alone[:7], others),
        "waiting row vs its whole text": identical([want], [got]),
        "eager": identical(alone[:4], generate_codes(eager, ps[:4])),
        "offline PCM": [i for i, (c, r, w) in enumerate(zip(alone, refs, together))
                        if tts.decode([c], [r])[0].tobytes() != w.tobytes()],
    }
    stream_alone = [streamed(tts, [p])[0] for p in ps[:3]]  # last: it starts the engine's owner (AsyncEngine)
    differ["streamed PCM"] = [i for i, (a, b) in enumerate(zip(stream_alone, streamed(tts, ps[:3]))) if a != b]
    assert sat_out > 0 and [p.ref_codes is not None for p in ps[:3]] == [True, True, False]
    assert {k: v for k, v in differ.items() if v} == {}
