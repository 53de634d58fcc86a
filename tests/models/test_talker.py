"""The talker module's own contracts."""

import pytest
import torch

from tests.golden import fixtures as fx
from tests.test_parity import CASES, _prepare


def test_stacked_codec_tables_embed_frames_bit_identically_and_hold_the_weights_once():
    from q3tts.models.talker import Talker
    cfg = fx.tts("cv06").ckpt.talker.cfg
    torch.manual_seed(0)
    talker = Talker(cfg).eval()
    K = cfg.num_code_groups
    codes = torch.stack([torch.randint(0, cfg.vocab_size if k == 0 else cfg.code_predictor.vocab_size, (3, 5))
                         for k in range(K)], dim=-1)  # [3, 5, K]: code 0 from the talker's vocabulary, 1.. the CP's
    with torch.no_grad():
        before = talker.embed_codes(codes)
        talker.fuse_codec_embeddings()
        after = talker.embed_codes(codes)
    assert torch.equal(before, after)
    table = talker.codec_table.untyped_storage().data_ptr()
    assert talker.model.codec_embedding.weight.untyped_storage().data_ptr() == table
    assert all(e.weight.untyped_storage().data_ptr() == table for e in talker.code_predictor.model.codec_embedding)


def _embed_prompt_by_masks(talker, layout, speaker_embedding=None, ref_codes=None):
    """embed_prompt as boolean masks on the device pick the slots (each mask a host sync on CUDA): the reference."""
    from q3tts.models.talker import NONE, REF, SPEAKER
    dev, dt = talker.codec_head.weight.device, talker.codec_head.weight.dtype
    text_ids, codec_ids = torch.tensor(layout.text_ids), torch.tensor(layout.codec_ids, device=dev)
    x = torch.zeros(len(layout), talker.cfg.hidden_size, device=dev, dtype=dt)
    has_text = text_ids != NONE
    if has_text.any():
        x[has_text.to(dev)] += talker.embed_text(text_ids[has_text])
    if (codec_ids >= 0).any():
        x[codec_ids >= 0] += talker.model.codec_embedding(codec_ids[codec_ids >= 0])
    if (codec_ids == SPEAKER).any():
        x[codec_ids == SPEAKER] += speaker_embedding.to(dev, dt)
    if (codec_ids == REF).any():
        x[codec_ids == REF] += talker.embed_codes(ref_codes.to(dev))
    trailing = (talker.embed_text(torch.tensor(layout.trailing_ids)) if layout.trailing_ids
                else x.new_zeros(0, talker.cfg.hidden_size))
    return x, trailing


@pytest.mark.parametrize("variant,name", CASES)
def test_prompt_embedding_picks_slots_on_the_host_bit_identically(variant, name):
    """embed_prompt's slots chosen on the host (one asynchronous copy, no sync) give the masks' embeddings bit for
    bit, for every model type's prompts (speaker, ICL reference, instruct, text-only rows)."""
    from q3tts.models.talker import embed_prompt
    tts, prepared = _prepare(variant, fx.get_case(variant, name))
    for pr in prepared:
        args = (tts.ckpt.talker, pr.layout, pr.speaker_embedding, pr.ref_codes)
        with torch.inference_mode():
            got, want = embed_prompt(*args), _embed_prompt_by_masks(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _wave(variant):
    """(talker, a wave of prepared requests mixing every prompt kind the processor builds for this model type, lengths
    different; cv06 adds a streamed text's layout: its prompt without trailing text)."""
    import dataclasses
    tts = fx.tts(variant)
    if variant == "cv06":
        greedy = dict(do_sample=False, subtalker_dosample=False)
        ps = tts.prepare_custom_voice(["Hello there.", "你好，今天天气真不错。", "A longer sentence, with commas, and words.",
                                       "Auto."], ["vivian", "dylan", "eric", "ryan"],
                                      ["English", "Auto", "Chinese", "Auto"], **greedy)
        ps += tts.prepare_custom_voice("Streamed text layout.", "serena", "Japanese", non_streaming_mode=False,
                                       seed=3)
        streamed = tts.prepare_custom_voice("Streamed, its text still coming.", "aiden", non_streaming_mode=False)[0]
        ps.append(dataclasses.replace(streamed, layout=dataclasses.replace(streamed.layout, trailing_ids=[])))
    elif variant == "vd17":
        ps = tts.prepare_voice_design(["Designed voice.", "A much longer designed sentence, with more words."],
                                      ["A robot.", ""], ["English", "Auto"])
        ps += tts.prepare_voice_design("Streamed design.", "A warm narrator.", non_streaming_mode=False)
    else:  # Base: x-vector, ICL with a short and a long reference, both layouts
        items = [it for name in ("icl_short_ref_stream", "icl_long_ref_stream", "xvec_stream", "icl_nsm")
                 for it in fx.case_prompt_items(variant, fx.get_case(variant, name))]
        ps = tts.prepare_voice_clone(["Short clone.", "A longer sentence to clone with the long reference.",
                                      "X-vector.", "Non-streaming ICL."], ["English", "Auto", "English", "Auto"],
                                     voice_clone_prompt=items[:4])
        ps += tts.prepare_voice_clone("Streamed clone.", "English", voice_clone_prompt=items[:1],
                                      non_streaming_mode=False)
    return tts.ckpt.talker, ps


def _row_by_row(monkeypatch):
    """The text projection computed one row per call, in either path: a BLAS may round a row differently by the
    number of rows in its GEMM (MKL does for 1-3 rows, or more with threads), which is not what these tests check."""
    from q3tts.models.talker import TextProjection
    orig = TextProjection.forward
    monkeypatch.setattr(TextProjection, "forward", lambda self, x: torch.cat(
        [orig(self, r[None]) for r in x.reshape(-1, x.shape[-1])]).view(*x.shape[:-1], -1))


@pytest.mark.parametrize("variant", ["cv06", "vd17", "base06"])
def test_a_wave_embedded_at_once_equals_each_prompt_embedded_alone(variant, monkeypatch):
    """embed_prompts over a wave mixing kinds and lengths (speaker ids, dialects, languages / auto, instruct,
    x-vector, ICL references, both layouts, a streamed text without trailing) == embed_prompt per prompt, bit for
    bit: the padded prefill rows (zeros past each prompt) and the packed trailing rows. With the projection's
    rounding left to the BLAS, equal to float32 rounding."""
    from q3tts.models.talker import embed_prompt, embed_prompts
    talker, ps = _wave(variant)
    assert len({len(p.layout) for p in ps}) > 2 and len({len(p.layout.trailing_ids) for p in ps}) > 1
    args = ([p.layout for p in ps], [p.speaker_embedding for p in ps], [p.ref_codes for p in ps])
    L = max(len(p.layout) for p in ps) + 3
    for exact in (False, True):
        if exact:
            _row_by_row(monkeypatch)
        with torch.inference_mode():
            x, trailing = embed_prompts(talker, *args, L=L)
            alone = [embed_prompt(talker, p.layout, p.speaker_embedding, p.ref_codes) for p in ps]
        want_x = torch.zeros_like(x)
        for i, (pre, _) in enumerate(alone):
            want_x[i, :pre.shape[0]] = pre
        want_trailing = torch.cat([t for _, t in alone])
        assert x.shape == (len(ps), L, talker.cfg.hidden_size) and trailing.shape == want_trailing.shape
        if exact:
            assert torch.equal(x, want_x) and torch.equal(trailing, want_trailing)
        else:
            torch.testing.assert_close(x, want_x, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(trailing, want_trailing, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_wave_embeds_each_prompt_as_alone_in_batch_invariant_mode(real_checkpoint):
    """bf16 at the real dimensions, batch-invariant mode (the projection is invariant.matmul: a row's sums in one order
    whatever the rows beside it; the text table in host memory, as load_checkpoint leaves it): a wave of 16 mixed
    prompts embedded at once == each embedded alone == embed_prompt, bit for bit."""
    from q3tts import TTS, invariant
    from q3tts.models.talker import embed_prompt, embed_prompts
    tts = TTS.from_pretrained(real_checkpoint("0.6B-CustomVoice"), device="cuda", dtype=torch.bfloat16)
    speakers = tts.get_supported_speakers()
    texts = ["Hi.", "A longer sentence, with commas, to vary the prompt length.", "你好，今天天气真不错。", "Numbers 1 2 3."]
    ps = []
    for i in range(16):
        ps += tts.prepare_custom_voice(texts[i % 4] * (1 + i // 4), speakers[i % len(speakers)],
                                       ["English", "Auto", "Chinese", "Auto"][i % 4], non_streaming_mode=i % 2 == 0)
    talker = tts.ckpt.talker
    assert talker.model.text_embedding.weight.device.type == "cpu"
    invariant.set_enabled(True)
    try:
        with torch.inference_mode():
            x, trailing = embed_prompts(talker, [p.layout for p in ps], [None] * 16, [None] * 16)
            alone = [embed_prompts(talker, [p.layout], [None], [None]) for p in ps]
            old = [embed_prompt(talker, p.layout) for p in ps]
    finally:
        invariant.set_enabled(False)
    trailing = trailing.split([len(p.layout.trailing_ids) for p in ps])
    for i, (p, (xa, ta), (xo, to)) in enumerate(zip(ps, alone, old)):
        n = len(p.layout)
        assert torch.equal(x[i, :n], xa[0]) and torch.equal(x[i, :n], xo), i
        assert torch.equal(trailing[i], ta) and torch.equal(trailing[i], to), i
        assert not x[i, n:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_take_rows_is_index_select_bit_for_bit(dtype):
    """The host-resident text table's rows gathered by take_rows (numpy, on the calling thread) are index_select's,
    bit for bit (NaN and infinity too: a copy of the bits), repeated ids included; an id outside the table is an
    IndexError, as index_select's."""
    from q3tts.models.talker import take_rows
    table = torch.randn(50, 24).to(dtype)
    table[3, 0], table[4, 1] = float("nan"), float("inf")
    ids = torch.tensor([3, 4, 0, 49, 3, 17])
    out = torch.empty(6, 24, dtype=dtype)
    take_rows(table, ids, out)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), torch.index_select(table, 0, ids).view(bits))
    with pytest.raises(IndexError):
        take_rows(table, torch.tensor([0, 50]), torch.empty(2, 24, dtype=dtype))
