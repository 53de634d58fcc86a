"""q3tts.invariant: each row's bits do not depend on the rows beside it (GPU), and the mode is inert on a CPU."""

import pytest
import torch

from q3tts import invariant
from q3tts.models import layers


@pytest.fixture
def mode_on():
    was = invariant.ENABLED
    invariant.set_enabled(True)
    yield
    invariant.set_enabled(was)


def test_inert_on_cpu(mode_on):
    """On a CPU the mode's kernels never apply: the layers compute what they compute with it off."""
    torch.manual_seed(0)
    norm = layers.RMSNorm(256, 1e-6)
    x, w = torch.randn(3, 256), torch.randn(512, 256)
    assert not invariant.active(x) and not invariant.matmul_applies(x, w)
    from q3tts.kernels import linear
    with torch.no_grad():
        on = (norm(x), linear(x, w))
        invariant.set_enabled(False)
        off = (norm(x), linear(x, w))
    assert all(torch.equal(a, b) for a, b in zip(on, off))


@pytest.mark.parametrize("N,K", [(4096, 1024), (1024, 2048), (3072, 1024), (6144, 2048)])
@pytest.mark.usefixtures("mode_on")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or invariant.triton is None, reason="needs CUDA and Triton")
def test_matmul_rows_alone_equal_batched(N, K):
    """Rows 0..199 at once, and any slice of them (1, 2, 3, 16, 17, 64, 100 rows, at any offset): the same bits; within
    one bf16 rounding of the fp32 product."""
    torch.manual_seed(N + K)
    x = torch.randn(200, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.03
    full = invariant.matmul(x, w)
    for m in (1, 2, 3, 16, 17, 64, 100):
        for a in (0, 5, 37):
            assert torch.equal(invariant.matmul(x[a:a + m], w), full[a:a + m]), (m, a)
    ref = x.float() @ w.float().T
    assert ((full.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-2).all()
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(invariant.matmul(x[:3], w, b), full[:3] + b)


@pytest.mark.usefixtures("mode_on")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or invariant.triton is None, reason="needs CUDA and Triton")
def test_rms_norm_rows_alone_equal_batched_and_close_to_the_module():
    torch.manual_seed(1)
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16) * 3
    norm = layers.RMSNorm(1024, 1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
        full = norm(x)  # through the kernel (the mode is on)
        for m, a in ((1, 0), (3, 7), (64, 100)):
            assert torch.equal(norm(x[a:a + m]), full[a:a + m])
        invariant.set_enabled(False)
        eager = norm(x)
    # the same roundings; the fp32 statistics summed in another order: at most one bf16 step apart
    assert ((full.float() - eager.float()).abs() <= eager.float().abs() * 2**-7 + 1e-6).all()


@pytest.mark.parametrize("S", [1, 2])
@pytest.mark.usefixtures("mode_on")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or invariant.triton is None, reason="needs CUDA and Triton")
def test_attention_row_alone_over_its_span_equals_batched_over_a_longer_one(S):
    """Eight rows at positions 5..1000 over a 1024-position span == each row alone over its own span (the engine's
    power-of-two bucket of its position); close to the eager attention."""
    torch.manual_seed(2 + S)
    B, H, Hkv, Dh, L = 8, 16, 8, 128, 1024
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, H, S, Dh, device=dev, dtype=dt)
    kc, vc = torch.randn(2, B, Hkv, L, Dh, device=dev, dtype=dt)
    pos = (torch.tensor([5, 63, 64, 200, 255, 256, 700, 1000], device=dev)[:, None]
           + torch.arange(S, device=dev)).clamp(max=L - 1)  # [B, S]
    mask = torch.arange(L, device=dev)[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, S, L]
    full = invariant.attention(q, kc, vc, mask)
    for b in range(B):
        n = max(64, 1 << int(pos[b].max()).bit_length())
        one = invariant.attention(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n], mask[b:b + 1, ..., :n])
        assert torch.equal(one, full[b:b + 1]), b
    G = H // Hkv
    ref = layers._attend(q.reshape(B, Hkv, G * S, Dh), kc, vc, mask.repeat(1, 1, G, 1), Dh).view(B, H, S, Dh)
    assert (full.float() - ref.float()).abs().max() < 2e-2


@pytest.mark.usefixtures("mode_on")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or invariant.triton is None, reason="needs CUDA and Triton")
def test_embed_sum_rows_alone_equal_batched():
    torch.manual_seed(3)
    table = torch.randn(16 * 2048, 1024, device="cuda", dtype=torch.bfloat16)
    off = torch.arange(16, device="cuda") * 2048
    codes = torch.randint(0, 2048, (64, 16), device="cuda")
    full = invariant.embed_sum(codes, off, table)
    assert all(torch.equal(invariant.embed_sum(codes[a:a + 1], off, table), full[a:a + 1]) for a in range(64))
    ref = table[codes + off].float().sum(1)
    assert ((full.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-2).all()
