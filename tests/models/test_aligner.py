"""The aligner's modules on their own: batching utterances changes no row (audio encoder chunks and windows, the LM's
right padding), and the token count matches the encoder's output."""

import pytest
import torch

from q3tts.models.audio_encoder import Ragged, tokens_after_cnn
from tests.test_align import aligner


def _tower(tower, feats):
    """Per utterance [tokens, D] from a list of log-mels [mel, F_i] (the encoder takes them padded + packs its output)."""
    mel = torch.nn.utils.rnn.pad_sequence([f.T for f in feats], batch_first=True).transpose(1, 2)
    frames = [f.shape[1] for f in feats]
    return list(tower(mel, frames).split([tokens_after_cnn(n) for n in frames]))


def _feats(*frames):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(128, n, generator=g) * 0.5 for n in frames]


def test_encoder_rows_equal_alone_and_token_counts():
    tower = aligner().thinker.audio_tower
    feats = _feats(37, 100, 250, 1130)  # under one chunk, one chunk, a tail, past one attention window (800 frames)
    with torch.inference_mode():
        batched = _tower(tower, feats)
        for f, b in zip(feats, batched):
            alone = _tower(tower, [f])[0]
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
        a, b = _tower(tower, [f])[0], _tower(tower, [g])[0]
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
    everything = torch.arange(sum(map(len, rows)))
    with torch.inference_mode():
        batched = th(torch.cat(rows), Ragged.of([9, 23], "cpu"), torch.cat(audio), everything).split([9, 23])
        for i, r in enumerate(rows):
            alone = th(r, Ragged.of([len(r)], "cpu"), audio[i], torch.arange(len(r)))
            torch.testing.assert_close(batched[i], alone, atol=1e-4, rtol=1e-4)  # fp32 GEMM order


def test_ragged_pad_unpad_round_trip():
    r = Ragged.of([3, 1, 4], "cpu")
    x = torch.arange(8.0)[:, None].expand(8, 2)
    p = r.pad(x)  # [3, 4, 2]
    assert p.shape == (3, 4, 2) and r.valid.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert p[:, :, 0].tolist() == [[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 6, 7]]
    assert torch.equal(r.unpad(p), x) and r.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_lm_row_is_unchanged_by_padding_after_it():
    """Right padding + is_causal: a row's logits are the same padded to 12 slots as alone (its real tokens never
    read the slots after them)."""
    th = aligner().thinker
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 1000, (5,), generator=g)
    with torch.inference_mode():
        alone = th(ids, Ragged.of([5], "cpu"), torch.zeros(0, th.cfg.text.hidden_size), torch.arange(5))
        padded = th(ids, Ragged.of([5], "cpu", pad_to=12), torch.zeros(0, th.cfg.text.hidden_size), torch.arange(5))
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=1e-5)


def test_channels_last_convs_are_the_convs():
    """The padded pass's conv front-end on CUDA (_convs_channels_last: every activation channels-last; outside bf16
    the first conv as a GEMM over its 3x3 patches) computes the convs' sums: in float32 they agree to float32's
    rounding of sums of 9 and 9 x channels products (1e-5 on activations of order 1), for chunk shapes of whole and
    odd lengths."""
    tower = aligner().thinker.audio_tower
    g = torch.Generator().manual_seed(1)
    for C, M, w in ((3, 128, 100), (2, 128, 37), (1, 20, 9)):
        x = torch.randn(C, M, w, generator=g)
        with torch.inference_mode():
            want = torch.nn.functional.gelu(tower.conv2d3(torch.nn.functional.gelu(tower.conv2d2(
                torch.nn.functional.gelu(tower.conv2d1(x[:, None]))))))
            got = tower._convs_channels_last(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert got.is_contiguous(memory_format=torch.channels_last)
        if M == tower.cfg.num_mel_bins:  # the whole _conv (conv_out takes every mel bin)
            with torch.inference_mode():
                torch.testing.assert_close(tower._conv(x, channels_last=True), tower._conv(x), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_channels_last_convs_on_cuda_are_as_accurate_as_cudnns():
    """On CUDA in bf16 (the padded pass's setting) the channels-last front-end against the float64 convs of the same
    bf16 weights and input: its error no larger than cuDNN's NCHW convs' own (max by a quarter, mean by a tenth;
    its first conv, kernels.prefill.conv1_gelu there, rounds once where cuDNN rounds the sum and then the bias)."""
    import copy
    cpu = aligner().thinker.audio_tower
    tower = copy.deepcopy(cpu).to("cuda", torch.bfloat16)
    exact = copy.deepcopy(tower).to("cpu", torch.float64)
    x = (torch.randn(6, cpu.cfg.num_mel_bins, 100, generator=torch.Generator().manual_seed(2)) * 0.5).to(torch.bfloat16)
    gelu = torch.nn.functional.gelu

    def nchw(t, m):
        return gelu(m.conv2d3(gelu(m.conv2d2(gelu(m.conv2d1(t[:, None]))))))
    with torch.inference_mode():
        want = nchw(x.double(), exact)
        eager = nchw(x.cuda(), tower).double().cpu()
        fast = tower._convs_channels_last(x.cuda()).double().cpu()
    e_fast, e_eager = (fast - want).abs(), (eager - want).abs()
    assert e_fast.max() <= 1.25 * e_eager.max(), (e_fast.max().item(), e_eager.max().item())
    assert e_fast.mean() <= 1.1 * e_eager.mean(), (e_fast.mean().item(), e_eager.mean().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_padded_pass_with_fused_residual_norms_has_the_bits_of_the_pass_without(monkeypatch):
    """Thinker.forward_padded in bf16 on CUDA at Qwen3-ForcedAligner-0.6B's dimensions (random weights): with each
    residual add fused with its norm (kernels.prefill add_rms_norm: 2 a LM layer, add_layer_norm: 2 an encoder
    layer) the logits are those of the same pass with the adds and norms apart (fuse_add_norm False), bit for bit,
    so the classes too."""
    from bench.aligner import real_config
    from q3tts.kernels import triton
    from q3tts.models import aligner as al
    from q3tts.models import audio_encoder as ae
    if triton is None:
        pytest.skip("needs Triton")
    cfg = al.parse_aligner_config(real_config())
    with torch.device("meta"):
        th = al.Thinker(cfg).to(torch.bfloat16)
    th = th.to_empty(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in th.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, device="cuda", generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, device="cuda", generator=g))
            else:  # embeddings ~1, a linear or conv keeps its input's scale
                fan_in = p[0].numel() if p.dim() > 1 and "embed" not in name else 1
                p.copy_(torch.randn(p.shape, device="cuda", generator=g) / fan_in ** 0.5)
    th.init_buffers()
    th.eval()
    a = cfg.audio
    B, C, chunk = 4, 5, 2 * a.n_window  # 4 rows of 5 s
    t = ae._conv_len(chunk)
    A, T = C * t, th.audio_tower.window_tokens(C)
    mel = torch.randn(B, a.num_mel_bins, C * chunk, device="cuda", generator=g).to(torch.bfloat16)
    mel[3, :, 4 * chunk + 30:] = 0  # the last row 4.3 s: its tail zeroed and masked, as the pass pads it
    mask = torch.ones(B * A // T, T, dtype=torch.bool, device="cuda")
    mask[3, ae.tokens_after_cnn(4 * chunk + 30):] = False
    S = 160
    ids = torch.randint(0, 151000, (B, S), device="cuda", generator=g)
    ids[:, 1:A + 1] = cfg.audio_token_id
    ids[:, A + 2::3] = cfg.timestamp_token_id
    audio_at = torch.arange(B, device="cuda")[:, None] * A + (torch.arange(S, device="cuda")[None] - 1).clamp(0, A - 1)
    calls = {"rms": 0, "ln": 0}

    def counted(fn, key):
        def run(*args):
            calls[key] += 1
            return fn(*args)
        return run
    monkeypatch.setattr(al, "add_rms_norm", counted(al.add_rms_norm, "rms"))
    monkeypatch.setattr(ae, "add_layer_norm", counted(ae.add_layer_norm, "ln"))
    with torch.inference_mode():
        fused = th.forward_padded(ids, mel, mask, audio_at)
        assert calls == {"rms": 2 * cfg.text.num_hidden_layers, "ln": 1 + 2 * a.encoder_layers}  # + the first norm
        th.fuse_add_norm = th.audio_tower.fuse_add_norm = False
        apart = th.forward_padded(ids, mel, mask, audio_at)
    assert fused.shape == (B, S, cfg.classify_num) and fused.dtype == torch.bfloat16
    assert fused.isfinite().all() and fused.float().std() > 0
    assert torch.equal(fused, apart)
    assert torch.equal(fused.argmax(-1), apart.argmax(-1))
