"""q3tts.kernels.attention: one token's attention in one kernel, as accurate as the module's own ops, writing the
caches as the index_put does."""

import pytest
import torch

from q3tts import kernels

from .layer import no_less_accurate, random_layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,n", [(1, 16), (3, 16), (16, 16), (1, 64), (5, 48)])
def test_decode_attention_is_as_accurate_as_the_eager_module(B, n):
    """The fused one-token attention (norms, RoPE, softmax, values): values copied into the cache, keys and output as
    close to the float64 result as the module's own ops get."""
    lay, exact, x, kv, run = random_layer(1024, n, B)
    assert kernels.decode_attention_applies(x, kv[0], n)
    att = lambda m: m.self_attn  # noqa: E731
    fused, fused_kv = run(lay, torch.bfloat16, True, att)
    eager, eager_kv = run(lay, torch.bfloat16, False, att)
    ref, ref_kv = run(exact, torch.float64, False, att)
    assert torch.equal(fused_kv[1], eager_kv[1])
    no_less_accurate(fused_kv[0], eager_kv[0], ref_kv[0], f"B={B} n={n} keys")
    no_less_accurate(fused, eager, ref, f"B={B} n={n} output")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,n", [(1, 16), (3, 16), (5, 48)])
def test_decode_attention_writing_the_caches_is_it_and_the_index_put(B, n):
    """AttnContext.write_kv_in_attention: the kernel stores this token's key and value itself, bit for bit what it
    hands the index_put otherwise, and the same output."""
    lay, exact, x, kv, run = random_layer(1024, n, B)
    att = lambda m: m.self_attn  # noqa: E731
    out, caches = run(lay, torch.bfloat16, True, att)
    out_w, caches_w = run(lay, torch.bfloat16, True, att, write=True)
    assert torch.equal(out_w, out) and torch.equal(caches_w, caches) and not torch.equal(caches, kv.double())
