"""The talker module's own contracts."""

import torch

from tests.golden import fixtures as fx


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
