"""The runner's admission of a wave of newcomers: a constant number of launches and copies, whatever the wave. Its
feed of a step's streamed text (append_text): every row's tokens in one embed call, one copy and one scatter, writing
the places and values that feeding each row alone wrote (exactly: the same slots, positions and lengths, untouched
rows untouched; the values bit for bit where a token's projection does not depend on the call's other tokens, the
batch-invariant mode on CUDA, else to the projection's rounding)."""

import dataclasses

import pytest
import torch

from q3tts import invariant
from q3tts.engine.engine import Engine
from q3tts.engine.runner import ModelRunner
from tests.golden import fixtures as fx
from tests.models.test_talker import _row_by_row, _wave


def test_a_wave_is_one_text_projection_and_one_copy(monkeypatch):
    """runner.admit of a wave of several prompts: one text projection call (before: one or two per prompt), one
    staged copy for the embedding and one for the slots' fields; every row's state as the per-prompt path writes."""
    from q3tts.models.talker import TextProjection, embed_prompt
    talker, ps = _wave("cv06")
    calls = {"projection": 0, "talker": 0, "slots": 0}
    orig = TextProjection.forward

    def counted(self, x):
        calls["projection"] += 1
        return orig(self, x)

    import q3tts.engine.slots as slots_mod
    import q3tts.models.talker as talker_mod
    for mod, key in ((talker_mod, "talker"), (slots_mod, "slots")):
        def staged(tensors, device, pack=None, _key=key, _orig=mod.to_device):
            calls[_key] += 1
            return _orig(tensors, device, pack=True)  # staged in one buffer as on CUDA (views of its copy)
        monkeypatch.setattr(mod, "to_device", staged)
    monkeypatch.setattr(TextProjection, "forward", counted)
    runner = Engine(fx.tts("cv06").ckpt, max_slots=len(ps) + 1, max_seq_len=256).runner
    with torch.inference_mode():
        runner.admit(1, ps)
    assert calls == {"projection": 1, "talker": 1, "slots": 1}
    _row_by_row(monkeypatch)  # the per-prompt path's rows (the BLAS may round a row by the rows beside it)
    with torch.inference_mode():
        runner.admit(1, ps)
        alone = [embed_prompt(talker, p.layout, p.speaker_embedding, p.ref_codes) for p in ps]
    s = runner.slots
    for i, (p, (pre, trail)) in enumerate(zip(ps, alone)):
        row, S = 1 + i, trail.shape[0]
        assert torch.equal(s.trailing[row, :S], trail) and int(s.trailing_len[row]) == S
        assert s.position_cpu[row] == int(s.position[row]) == pre.shape[0] and int(s.num_generated[row]) == 1
        assert int(s.seed[row]) == p.params.seed
        for f in dataclasses.fields(s.sampling):
            assert getattr(s.sampling, f.name)[row] == torch.tensor(getattr(p.params, f.name),
                                                                    dtype=getattr(s.sampling, f.name).dtype), f.name


FEEDS = [(2, 5, [9707, 11, 1879]), (0, 0, [21806]), (3, 9, [13, 220]), (1, 4, [])]  # (slot, start, ids)


def per_row(runner: ModelRunner, feeds) -> tuple[torch.Tensor, torch.Tensor]:
    """(trailing, trailing_len) after feeding each row alone: one embed_text per row, its own writes."""
    trailing, lens = runner.slots.trailing.clone(), runner.slots.trailing_len.clone()
    with torch.inference_mode():
        for slot, start, ids in feeds:
            if ids:
                trailing[slot, start:start + len(ids)] = runner.talker.embed_text(torch.tensor(ids)).to(trailing.dtype)
                lens[slot] = start + len(ids)
    return trailing, lens


def batched(runner: ModelRunner, feeds) -> tuple[torch.Tensor, torch.Tensor]:
    runner.append_text(feeds)
    return runner.slots.trailing.clone(), runner.slots.trailing_len.clone()


def fresh_runner(tts) -> ModelRunner:
    """A runner whose trailing text is filled with a value no embedding writes (so every write shows)."""
    r = ModelRunner(tts.ckpt.talker, tts.ckpt.tts_pad_embed, max_slots=4, max_len=64, use_cuda_graphs=False,
                    compile=False)
    r.slots.trailing.fill_(7.0)
    r.slots.trailing_len.fill_(3)
    return r


def test_batched_feed_writes_the_places_and_values_of_the_per_row_feed():
    tts = fx.tts("cv06")
    runner = fresh_runner(tts)
    want, want_len = per_row(runner, FEEDS)
    got, got_len = batched(runner, FEEDS)
    assert torch.equal(got_len, want_len) and got_len.tolist() == [1, 3, 8, 11]
    assert torch.equal(got == 7.0, want == 7.0)  # the same (slot, position) cells written, nothing else
    assert (got != 7.0).any(-1).sum() == 6
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # CPU GEMMs round by their number of rows
    # exactly the rows of one embed_text call over every token, in feed order
    ids = torch.tensor([i for *_, row in FEEDS for i in row])
    with torch.inference_mode():
        one_call = tts.ckpt.talker.embed_text(ids)
    rows = torch.tensor([s for s, _, row in FEEDS for _ in row])
    cols = torch.tensor([st + j for _, st, row in FEEDS for j in range(len(row))])
    assert torch.equal(got[rows, cols], one_call)


def test_nothing_to_feed_writes_nothing():
    runner = fresh_runner(fx.tts("cv06"))
    before = runner.slots.trailing.clone(), runner.slots.trailing_len.clone()
    runner.append_text([])
    runner.append_text([(1, 0, []), (2, 3, [])])
    assert torch.equal(runner.slots.trailing, before[0]) and torch.equal(runner.slots.trailing_len, before[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_feed_equals_per_row_bit_for_bit_in_batch_invariant_mode(real_checkpoint):
    """On CUDA in bf16 with batch-invariant kernels (real dimensions: the kernels' tiles; the text embedding table in
    host memory, as load_checkpoint puts it): the batched feed's values equal the per-row feed's exactly."""
    from q3tts import TTS
    tts = TTS.from_pretrained(real_checkpoint("0.6B-CustomVoice"), device="cuda", dtype=torch.bfloat16)
    invariant.set_enabled(True)
    try:
        runner = fresh_runner(tts)
        assert runner.talker.model.text_embedding.weight.device.type == "cpu"
        want, want_len = per_row(runner, FEEDS)
        got, got_len = batched(runner, FEEDS)
    finally:
        invariant.set_enabled(False)
    assert torch.equal(got_len, want_len) and torch.equal(got, want)


def test_every_frame_key_has_its_code_predictor_half():
    """A frame on CUDA replays two graphs: the talker's half per graph_keys() key and the code predictor's per (batch
    bucket, sampler). Every key's (batch, sampler) has its half, and there is none beside them (no capture unused);
    a key not captured is an error naming it, not a frame skipped."""
    tts = fx.tts("cv06")
    r = ModelRunner(tts.ckpt.talker, tts.ckpt.tts_pad_embed, max_slots=24, max_len=1024, use_cuda_graphs=False,
                    compile=False)
    keys = r.graph_keys()
    assert {(B, c) for B, _, c in keys} == set(r.code_graph_keys())
    assert len(keys) == len(r.batch_buckets) * len({n for _, n, _ in keys}) * 2 > len(r.code_graph_keys())
    with pytest.raises(RuntimeError, match="batch 24 x length 1024"):
        r.frame_graphs(24, 1024, True)


def test_a_warm_up_frames_halves_run_one_after_the_other_are_its_whole_frame():
    """warm_up_frames' halves (a compile helper's units: compile_helpers.halves): the code predictor's half, then the
    talker's, leave every slot tensor and the frame's codes as the whole warm-up frame does, bit for bit (the same
    calls in the same order on the same inputs), and each half alone runs only its own part."""
    tts = fx.tts("cv06")
    keys = [(2, 64, False), (1, 64, True)]

    def state(halves):
        torch.manual_seed(0)
        r = ModelRunner(tts.ckpt.talker, tts.ckpt.tts_pad_embed, max_slots=4, max_len=64, use_cuda_graphs=False,
                        compile=False)
        r.slots.last_hidden.normal_()  # a talker state to start the code predictor from
        with torch.inference_mode():
            for key in keys:
                for half in halves:
                    r.warm_up_frames([key], half)
        return {name: t.clone() for name, t in [*vars(r.slots).items(), ("frame_codes", r.frame_codes)]
                if isinstance(t, torch.Tensor)}

    whole, split = state([""]), state(["codes", "talker"])
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)
    codes, talker, start = state(["codes"]), state(["talker"]), state([])
    assert codes["frame_codes"].ne(0).any() and torch.equal(codes["position"], start["position"])
    assert torch.equal(codes["last_hidden"], start["last_hidden"])  # the talker's step did not run
    assert talker["frame_codes"].eq(0).all() and talker["position"].sum() > 0  # the code predictor did not run


def test_every_wave_graph_runs_its_layers_through_one_compiled_variant():
    """A wave graph's input (wave_input) is a contiguous view for every (size, length): the first decoder layer takes
    the variant the others take. A strided slice of the largest wave's buffer compiled a second one, whose Dynamo
    symbols could differ between a compile helper's process and the engine's (a compile-cache miss on the start's
    critical path: BENCHMARKS.md). Random weights: only the compiled variants are counted."""
    from q3tts.models.layers import DecoderLayer
    from q3tts.models.talker import Talker
    cfg = fx.tts("cv06").ckpt.talker.cfg
    torch.manual_seed(0)
    # a talker of its own: compile=True compiles its layers in place (the shared fixture's stay uncompiled)
    runner = ModelRunner(Talker(cfg).eval(), torch.zeros(cfg.hidden_size), max_slots=4, max_len=64,
                         use_cuda_graphs=False, compile=True)
    runner.wave_sizes, runner.wave_lens = [2, 4], [32, 64]
    runner.alloc_wave_scratch()
    assert runner.wave_input(2, 32).is_contiguous() and runner.wave_input(2, 32).shape == (2, 32, cfg.hidden_size)
    torch._dynamo.reset()  # the layer's variants of earlier tests (other shapes) are not this test's
    with torch.inference_mode():
        runner._prefill_wave(2, 32)  # the smaller key: a slice of the largest wave's buffer
    variants = torch._dynamo.eval_frame._debug_get_cache_entry_list(DecoderLayer.forward.__code__)
    assert len(variants) == 1
