"""Batch-invariant mode on a GPU: a request's codes and audio are the same alone as beside other requests, admitted
together or one after another, through captured graphs or eager frames (bf16, random weights at the real
dimensions; bench/invariance.py is the same check as a script)."""

import pytest
import torch

from q3tts import TTS, invariant
from q3tts.engine.engine import Engine
from tests.engine.steps import generate_codes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    """The requests whose codes differ (empty: all identical)."""
    return [i for i, (x, y) in enumerate(zip(a, b)) if not (x.shape == y.shape and torch.equal(x, y))]


@pytest.fixture(scope="module", params=["0.6B-CustomVoice", "1.7B-CustomVoice"])
def inv(request, tmp_path_factory):
    """(TTS in batch-invariant mode, 16 slots, its 16 mixed requests, each one's codes alone)."""
    from bench.invariance import requests
    from bench.make_checkpoint import make
    path = tmp_path_factory.mktemp("inv") / "ck"
    make(request.param, path)
    tts = TTS.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_batch_size=16, max_seq_len=512,
                              batch_invariant=True)
    ps = requests(tts, 16, 24)
    alone = [generate_codes(tts.engine, [p])[0] for p in ps]
    yield tts, ps, alone
    invariant.set_enabled(False)  # process-wide: the other modules' engines run the default mode


def test_codes_alone_equal_batched_and_staggered(inv):
    """Mixed lengths, speakers, greedy / top-k / full (top_k 0) samplers and a streamed-text layout: alone == in a
    batch of 3, of 16, in reverse order, and admitted one every 3 frames (rows join and leave the batch)."""
    from bench.invariance import staggered
    tts, ps, alone = inv
    eng = tts.engine
    assert identical(alone[:3], generate_codes(eng, ps[:3])) == []
    assert identical(alone, generate_codes(eng, ps)) == []
    assert identical(alone[:5][::-1], generate_codes(eng, ps[:5][::-1])) == []
    assert identical(alone, staggered(eng, ps, 3)) == []


def test_eager_frames_equal_graphs(inv):
    """The engine without CUDA graphs (frames launched from Python) gives the captured frames' codes, batched."""
    tts, ps, alone = inv
    eager = Engine(tts.ckpt, max_slots=4, max_seq_len=512, use_cuda_graphs=False, batch_invariant=True)
    assert identical(alone[:4], generate_codes(eager, ps[:4])) == []


def test_pcm_alone_equals_batched(inv):
    """Streamed audio (the pooled streaming vocoder) alone == beside two other streams; offline audio (TTS.decode)
    of a request alone == decoded with seven others."""
    from bench.invariance import streamed
    tts, ps, alone = inv
    assert [streamed(tts, [p])[0] for p in ps[:3]] == streamed(tts, ps[:3])
    together = tts.decode(alone[:8])
    assert all(tts.decode([c])[0].tobytes() == w.tobytes() for c, w in zip(alone[:8], together))
