"""CUDA-graph path == eager path (GPU only; skipped on CPU CI via the `gpu` marker)."""

import pytest
import torch

from q3tts import TTS
from q3tts.engine.engine import Engine
from tests.golden import fixtures as fx

pytestmark = pytest.mark.gpu


def codes_with(tts, prepared, graphs: bool, max_slots=4):
    eng = Engine(tts, max_slots=max_slots, max_seq_len=256, use_cuda_graphs=graphs)
    return eng.generate_codes(prepared)


def test_graph_equals_eager_fp32_120_frames():
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cuda", dtype=torch.float32)
    prepared = tts.prepare_custom_voice("A longer run to compare the captured frame with eager code.", "vivian",
                                        "English", do_sample=False, subtalker_dosample=False, max_new_tokens=121)
    g, e = codes_with(tts, prepared, True)[0], codes_with(tts, prepared, False)[0]
    assert g.shape == (120, 16) and torch.equal(g, e)


def test_mixed_sampling_parameters_inside_the_graph():
    """Per-request temperature / top-k / top-p / penalty / seed are honoured by the captured frame:
    a batch of differently-configured requests gives each the codes it gets alone."""
    tts = TTS.from_pretrained(fx.checkpoint("cv17"), device="cuda", dtype=torch.float32)
    p = []
    p += tts.prepare_custom_voice("First request.", "ryan", "English", seed=1, temperature=0.6, top_k=10, max_new_tokens=41)
    p += tts.prepare_custom_voice("Second, greedy.", "vivian", do_sample=False, subtalker_dosample=False, max_new_tokens=31)
    p += tts.prepare_custom_voice("Third one here.", "serena", "Chinese", seed=7, top_p=0.7, repetition_penalty=1.3,
                                  subtalker_temperature=1.2, max_new_tokens=36, non_streaming_mode=False)
    p += tts.prepare_custom_voice("Fourth.", "eric", seed=3, subtalker_top_k=3, max_new_tokens=26, instruct="Slowly.")
    batched = codes_with(tts, p, True)
    alone = [codes_with(tts, [x], True, max_slots=1)[0] for x in p]
    for b, a in zip(batched, alone):
        assert torch.equal(b, a)
    assert [c.shape[0] for c in batched] == [40, 30, 35, 25]


def test_graph_equals_eager_bf16_real_dims(tmp_path):
    from bench.make_checkpoint import make
    make("0.6B-CustomVoice", tmp_path / "ck")
    tts = TTS.from_pretrained(tmp_path / "ck", device="cuda", dtype=torch.bfloat16)
    prepared = tts.prepare_custom_voice("Real dimensions, bf16.", "ryan", "English", do_sample=False,
                                        subtalker_dosample=False, max_new_tokens=101)
    g, e = codes_with(tts, prepared, True)[0], codes_with(tts, prepared, False)[0]
    same = (g == e).all(1).long()
    prefix = int(same.cumprod(0).sum())
    print(f"bf16 graph vs eager: identical prefix {prefix}/{g.shape[0]} frames")
    assert prefix >= 50
