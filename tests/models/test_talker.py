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
