"""The talker's interleaved multimodal RoPE is plain RoPE when its 3 position streams agree (C1)."""

import torch

from q3tts.models.layers import apply_rope, rope_cos_sin, rope_inv_freq


def upstream_interleaved_mrope(q, cos3, sin3, mrope_section):
    """Transcription of qwen-tts 0.1.1 apply_multimodal_rotary_pos_emb(..., mrope_interleaved=True) for one
    tensor. cos3/sin3: [3, B, S, Dh] (one per position stream); q: [B, H, S, Dh]."""
    def interleave(x, modality_num):
        x_t = x[0].clone()
        for i, n in enumerate(mrope_section[1:], 1):
            x_t[..., i:n * modality_num:modality_num] = x[i, ..., i:n * modality_num:modality_num]
        return x_t
    dim = cos3.shape[-1]
    cos = torch.cat([interleave(cos3[..., : dim // 2], 3)] * 2, dim=-1).unsqueeze(1)
    sin = torch.cat([interleave(sin3[..., : dim // 2], 3)] * 2, dim=-1).unsqueeze(1)
    rot = torch.cat((-q[..., q.shape[-1] // 2:], q[..., : q.shape[-1] // 2]), dim=-1)
    return q * cos + rot * sin


def test_interleaved_mrope_equals_plain_rope_for_text_positions():
    for head_dim, section in [(128, [24, 20, 20]), (32, [6, 5, 5]), (16, [4, 2, 2])]:
        inv = rope_inv_freq(head_dim, 1e6)
        pos = torch.tensor([[0, 1, 2, 5, 17, 300, 4095]])
        cos, sin = rope_cos_sin(pos, inv, torch.float32)
        q = torch.randn(1, 4, pos.shape[1], head_dim)
        ours = apply_rope(q, cos, sin)
        theirs = upstream_interleaved_mrope(q, cos.expand(3, -1, -1, -1), sin.expand(3, -1, -1, -1), section)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_interleaved_mrope_differs_when_streams_differ():
    """Sanity of the transcription: with different positions per stream the result does change."""
    inv = rope_inv_freq(32, 1e6)
    cos, sin = rope_cos_sin(torch.tensor([[3, 4]]), inv, torch.float32)
    cos2, sin2 = rope_cos_sin(torch.tensor([[7, 9]]), inv, torch.float32)
    q = torch.randn(1, 2, 2, 32)
    a = upstream_interleaved_mrope(q, torch.stack([cos[0], cos2[0], cos2[0]])[:, None], torch.stack([sin[0], sin2[0], sin2[0]])[:, None], [6, 5, 5])
    assert not torch.allclose(a, apply_rope(q, cos, sin))


def test_fused_projections_hold_the_weights_once_and_compute_the_same():
    from q3tts.config import DecoderLayerConfig
    from q3tts.models.layers import AttnContext, DecoderLayer, fuse_projections
    cfg = DecoderLayerConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=8)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg).eval()
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(2, 5, 32)
    pos = torch.arange(5)[None].expand(2, -1)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(16, 10000.0), torch.float32)

    def run():
        kv = torch.zeros(2, 2, 2, 8, 16)
        ctx = AttnContext(write_pos=pos, mask=(torch.arange(8)[None, :] <= torch.arange(5)[:, None])[None, None])
        with torch.no_grad():
            return layer(x, cos, sin, kv[0], kv[1], ctx)

    plain = run()
    fuse_projections(layer)
    torch.testing.assert_close(run(), plain)
    after = layer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    attn, mlp = layer.self_attn, layer.mlp
    for fused, projs in ((attn.qkv_weight, (attn.q_proj, attn.k_proj, attn.v_proj)), (mlp.gate_up_weight, (mlp.gate_proj, mlp.up_proj))):
        assert all(p.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for p in projs)


def test_long_attention_one_kv_head_at_a_time_is_bit_identical(monkeypatch):
    """Scores above ATTN_SCORES_CHUNK elements (a long prefill) are computed per KV head: same values exactly."""
    import q3tts.models.layers as L
    from q3tts.config import DecoderLayerConfig
    cfg = DecoderLayerConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=10)
    torch.manual_seed(0)
    att = L.Attention(cfg).eval()
    B, S, n = 2, 40, 64
    x = torch.randn(B, S, 64)
    pos = torch.arange(S)[None].expand(B, -1)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(32, 1e4), torch.float32)
    ctx = L.AttnContext(pos, (torch.arange(n)[None, :] <= pos[0][:, None])[None, None])
    outs = []
    for chunk in (L.ATTN_SCORES_CHUNK, 100):
        monkeypatch.setattr(L, "ATTN_SCORES_CHUNK", chunk)
        with torch.no_grad():
            outs.append(att(x, cos, sin, torch.zeros(B, 2, n, 32), torch.zeros(B, 2, n, 32), ctx))
    assert torch.equal(*outs)
