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
