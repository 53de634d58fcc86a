"""The aligner's modules on their own: batching utterances changes no row (audio encoder chunks and windows, the LM's
right padding), and the token count matches the encoder's output."""

import torch

from q3tts.models.audio_encoder import tokens_after_cnn
from tests.test_align import aligner


def _feats(*frames):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(128, n, generator=g) * 0.5 for n in frames]


def test_encoder_rows_equal_alone_and_token_counts():
    tower = aligner().thinker.audio_tower
    feats = _feats(37, 100, 250, 1130)  # under one chunk, one chunk, a tail, past one attention window (800 frames)
    with torch.inference_mode():
        batched = tower(feats)
        for f, b in zip(feats, batched):
            alone = tower([f])[0]
            assert b.shape == alone.shape == (tokens_after_cnn(f.shape[1]), tower.cfg.output_dim)
            torch.testing.assert_close(b, alone, atol=1e-5, rtol=1e-5)


def test_windows_are_independent():
    """Past one window (n_window_infer frames), changing frames of the second window leaves the first's tokens."""
    tower = aligner().thinker.audio_tower
    (f,) = _feats(1200)
    g = f.clone()
    g[:, 900:] += 1.0
    w = tokens_after_cnn(tower.cfg.n_window_infer)
    with torch.inference_mode():
        a, b = tower([f])[0], tower([g])[0]
    torch.testing.assert_close(a[:w], b[:w])
    assert not torch.allclose(a[w:], b[w:])


def test_lm_rows_equal_alone():
    """Right padding: a row's logits do not depend on longer rows in its batch."""
    th = aligner().thinker
    cfg = th.cfg
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 1000, (n,), generator=g) for n in (9, 23)]
    for r in rows:
        r[2:5] = cfg.audio_token_id
    audio = [torch.randn(3, cfg.text.hidden_size, generator=g) for _ in rows]
    ids = torch.zeros(2, 23, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    with torch.inference_mode():
        batched = th(ids, torch.tensor([9, 23]), audio)
        for i, r in enumerate(rows):
            alone = th(r[None], torch.tensor([len(r)]), [audio[i]])[0]
            torch.testing.assert_close(batched[i, :len(r)], alone, atol=1e-4, rtol=1e-4)  # fp32 GEMM order
