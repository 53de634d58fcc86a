"""The skinny-GEMM dispatcher: F.linear wherever the kernels do not apply; on CUDA, close to cuBLAS."""

import pytest
import torch
import torch.nn.functional as F

from q3tts import kernels


def test_falls_back_to_f_linear_on_cpu_and_fp32():
    x, w, b = torch.randn(3, 512), torch.randn(64, 512), torch.randn(64)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))
    assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("N,K", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (2048, 1024)])
def test_skinny_linear_matches_cublas(rows, N, K):
    torch.manual_seed(0)
    x = torch.randn(rows, 1, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    ref = F.linear(x.float(), w.float())
    out = kernels.linear(x, w)
    assert out.shape == (rows, 1, N) and out.dtype == torch.bfloat16
    # both are fp32 accumulations rounded to bf16 once: within one bf16 step of the exact result
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-2).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_quant_linear_matches_the_dequantized_weight(wdtype, rows):
    """x @ (w * scale).T with the 1-byte weight converted in the kernel == the same product on the dequantized
    weight in fp32 (both accumulate in fp32; the kernel rounds once to bf16)."""
    torch.manual_seed(1)
    N, K = 2048, 1024
    x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") * 40).clamp(-127, 127)
    w = w.round().to(torch.int8) if wdtype == torch.int8 else w.to(wdtype)
    scale = torch.rand(N, device="cuda") * 1e-3 + 1e-4
    ref = x.float() @ (w.float() * scale[:, None]).T
    out = kernels.quant_linear(x, w, scale)
    assert out.shape == (rows, N) and out.dtype == torch.bfloat16
    # one bf16 rounding of an fp32 sum (relative 2**-8), plus fp32 summation-order differences over K terms
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-3 * ref.abs().max()).all()


def _random_layer(hidden: int, n: int, B: int):
    """A bf16 decoder layer of the real models' head shape (16 x 128, 8 KV heads) with random weights (norm weights
    away from 1), its float64 twin (the same bf16 values), one token per row at positions < n (row 0 at n - 1) and
    caches of 300 positions holding random older keys and values."""
    import copy

    from q3tts.config import DecoderLayerConfig
    from q3tts.models import layers
    torch.manual_seed(hidden + 100 * n + B)
    H, Hkv, Dh = 16, 8, 128
    lay = layers.DecoderLayer(DecoderLayerConfig(hidden, 3 * hidden, 1, H, Hkv, Dh, 1e-6, 1e6, 2048))
    with torch.no_grad():
        for p in lay.parameters():
            p.normal_(0, 0.05)
        for m in (lay.input_layernorm, lay.post_attention_layernorm, lay.self_attn.q_norm, lay.self_attn.k_norm):
            m.weight.normal_(1, 0.3)
    lay = lay.to("cuda", torch.bfloat16)
    exact = copy.deepcopy(lay).double()
    layers.fuse_projections(lay)
    x = torch.randn(B, 1, hidden, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, B, Hkv, 300, Dh, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, n, (B, 1), device="cuda")
    pos[0] = n - 1
    mask = torch.arange(n, device="cuda")[None, None, None, :] <= pos[:, None, :, None]
    inv_freq = layers.rope_inv_freq(Dh, 1e6).to("cuda")

    def run(module, dtype, fused: bool, part=lambda m: m, write: bool = False):
        """(output, caches) of part(module) run in dtype; fused False: with the module's own ops; write: the fused
        attention writes the caches itself."""
        cache = kv.to(dtype, copy=True)
        cos, sin = layers.rope_cos_sin(pos, inv_freq, dtype)
        with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
            if not fused:
                mp.setattr(layers, "decode_attention_applies", lambda *a: False)
                mp.setattr(layers, "gemv_ex_applies", lambda *a: False)
            ctx = layers.AttnContext(pos, mask, fused_attention=fused, write_kv_in_attention=write)
            out = part(module)(x.to(dtype), cos, sin, cache[0], cache[1], ctx)
        return out.double(), cache.double()

    return lay, exact, x, kv, run


def _no_less_accurate(fused, eager, exact, what: str):
    """The fused kernels' error against the float64 result is that of the module's own bf16 ops: both round each
    op's result to bf16 and sum in fp32, in other orders, so neither is the reference; the fused one may not be
    worse on average (1.25x: run-to-run spread of which elements a rounding flips) nor at its worst (2x)."""
    ef, ee = (fused - exact).abs(), (eager - exact).abs()
    print(f"{what}: mean error fused {ef.mean():.3g} / eager {ee.mean():.3g}, max {ef.max():.3g} / {ee.max():.3g}")
    assert ef.mean() <= 1.25 * ee.mean() and ef.max() <= 2 * ee.max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,n", [(1, 16), (3, 16), (16, 16), (1, 64), (5, 48)])
def test_decode_attention_is_as_accurate_as_the_eager_module(B, n):
    """The fused one-token attention (norms, RoPE, softmax, values): values copied into the cache, keys and output as
    close to the float64 result as the module's own ops get."""
    lay, exact, x, kv, run = _random_layer(1024, n, B)
    assert kernels.decode_attention_applies(x, kv[0], n)
    att = lambda m: m.self_attn  # noqa: E731
    fused, fused_kv = run(lay, torch.bfloat16, True, att)
    eager, eager_kv = run(lay, torch.bfloat16, False, att)
    ref, ref_kv = run(exact, torch.float64, False, att)
    assert torch.equal(fused_kv[1], eager_kv[1])
    _no_less_accurate(fused_kv[0], eager_kv[0], ref_kv[0], f"B={B} n={n} keys")
    _no_less_accurate(fused, eager, ref, f"B={B} n={n} output")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("B,n", [(1, 16), (3, 16), (5, 48)])
def test_decode_attention_writing_the_caches_is_it_and_the_index_put(B, n):
    """AttnContext.write_kv_in_attention: the kernel stores this token's key and value itself, bit for bit what it
    hands the index_put otherwise, and the same output."""
    lay, exact, x, kv, run = _random_layer(1024, n, B)
    att = lambda m: m.self_attn  # noqa: E731
    out, caches = run(lay, torch.bfloat16, True, att)
    out_w, caches_w = run(lay, torch.bfloat16, True, att, write=True)
    assert torch.equal(out_w, out) and torch.equal(caches_w, caches) and not torch.equal(caches, kv.double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("hidden,n", [(1024, 16), (1024, 256), (2048, 64)])
def test_one_row_layer_is_as_accurate_as_the_eager_module(hidden, n):
    """One token of one row: the layer whose norms, SiLU gate and residual adds ride in its GEMVs (and, for short
    spans, the fused attention), at the 0.6B (1024) and 1.7B talker (2048) widths: as close to the float64 result
    as the module's own ops get, caches included."""
    lay, exact, x, kv, run = _random_layer(hidden, n, 1)
    assert kernels.gemv_ex_applies(x, lay.self_attn.qkv_weight, lay.mlp.down_proj.weight)
    fused, fused_kv = run(lay, torch.bfloat16, True)
    eager, eager_kv = run(lay, torch.bfloat16, False)
    ref, ref_kv = run(exact, torch.float64, False)
    _no_less_accurate(fused_kv, eager_kv, ref_kv, f"hidden={hidden} n={n} caches")
    _no_less_accurate(fused, eager, ref, f"hidden={hidden} n={n} output")


def _draw_float64(vals, idx, noise, temp, top_k, top_p):
    """sample_topk's warps and race in float64 on its ranked values / indices [B, cap] -> (tokens [B], near [B]: rows
    whose draw is within 1e-4 relative of another: the two best race scores, or a kept token's tail mass and the
    fp32 threshold 1 - top_p). fp32 softmax over <= 64 terms is good to ~64 x 6e-8 = 4e-6 relative (the kernel's
    exp: a few ulp more), so 1e-4 is 25 times what fp32 can move."""
    cap = vals.shape[1]
    r = torch.arange(cap)
    x = (vals.double() / temp.double()[:, None]).masked_fill(r >= top_k[:, None], float("-inf"))
    tail = x.softmax(-1).flip(-1).cumsum(-1).flip(-1)
    thr = (1 - top_p).double()[:, None]  # computed in fp32 by both
    kept = (r > 0) & (r < top_k[:, None])
    near = (((tail - thr).abs() <= 1e-4 * thr) & kept).any(-1)
    x = x.masked_fill((tail <= thr) & (r > 0), float("-inf"))
    score = x.softmax(-1) / -noise.gather(1, idx).double().log()
    best = score.topk(2, dim=-1).values
    near |= best[:, 0] - best[:, 1] <= 1e-4 * best[:, 0]
    return idx.gather(1, score.argmax(-1, keepdim=True))[:, 0], near


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("V", [2048, 3072])
def test_sample_top_kernel_draws_as_sample_topk(V):
    """The sampling kernel (sample_topk on CUDA, up to TOP_KERNEL_MAX_ROWS rows) against sample_topk's torch ops on
    the CPU, on the code predictor's (2048) and the talker's (3072, its suppressed tail at -inf) logit widths: the
    ranking is a stable sort's (bf16-valued logits tie often), greedy rows take the argmax, and every sampled token
    is the float64 draw's except at near ties (_draw_float64), which stay rare."""
    from q3tts import sampling
    g = torch.Generator().manual_seed(V)
    B, cap = 512, sampling.TOPK_CAP  # (any number of rows is drawn alike)
    logits = (torch.randn(B, V, generator=g) * 3).bfloat16().float()
    logits[: B // 2, 2048 + 1:] = float("-inf")  # the talker's suppressed codes (all but EOS)
    noise = sampling.uniform_noise(torch.arange(B), torch.full((B,), 7), 2, V)
    top_k = torch.randint(1, cap + 1, (B,), generator=g)
    top_p = torch.rand(B, generator=g) * 0.9 + 0.1
    temp = torch.rand(B, generator=g) + 0.3
    do = torch.rand(B, generator=g) > 0.2
    args = [t.cuda() for t in (logits, do, temp, top_k, top_p, noise)]
    assert kernels.sample_top_applies(args[0][: kernels.TOP_KERNEL_MAX_ROWS], cap)
    assert not kernels.sample_top_applies(args[0], cap)  # many rows: torch.topk's path
    vals, nsel = torch.empty(2, B, cap, device="cuda")
    idx = torch.empty(B, cap, device="cuda", dtype=torch.long)
    kernels.sampling._top_rank[(B, V // kernels.TOP_RANK_ROWS)](args[0], args[5], vals, idx, nsel, V, CAP=cap,
                                                       BI=kernels.TOP_RANK_ROWS, BJ=kernels.TOP_RANK_COLS, PDL=False)
    ref_vals, ref_idx = torch.sort(logits, dim=-1, descending=True, stable=True)
    assert torch.equal(vals.cpu(), ref_vals[:, :cap]) and torch.equal(idx.cpu(), ref_idx[:, :cap])
    assert torch.equal(nsel.cpu(), noise.gather(1, ref_idx[:, :cap]))
    got = kernels.sample_top(*args, cap)
    assert torch.equal(kernels.sample_top(args[0].bfloat16(), *args[1:], cap), got)  # bf16-valued logits
    table = torch.randn(V, 1024, device="cuda", dtype=torch.bfloat16)
    tokens, rows = kernels.sample_top(*args, cap, emb=table)  # with the next step's input looked up
    assert torch.equal(tokens, got) and torch.equal(rows, table[tokens])
    few = kernels.TOP_KERNEL_MAX_ROWS
    assert torch.equal(sampling.sample_topk(*(a[:few] for a in args)), got[:few])  # what the engine runs
    got = got.cpu()
    assert torch.equal(got[~do], ref_idx[~do, 0])
    exact, near = _draw_float64(ref_vals[:, :cap], ref_idx[:, :cap], noise, temp, top_k, top_p)
    torch_ops = sampling.sample_topk(logits, do, temp, top_k, top_p, noise)  # the CPU: the torch ops
    sure = do & ~near
    assert near.sum() <= B // 20, f"{int(near.sum())} near ties of {B}: the check would say little"
    assert torch.equal(got[sure], exact[sure]) and torch.equal(torch_ops[sure], exact[sure])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
def test_frame_noise_kernel_is_the_torch_hash():
    from q3tts import sampling
    seed = torch.randint(0, 2**40, (5,), device="cuda")
    step = torch.randint(-1, 5000, (5,), device="cuda")
    for vocab, first, num in ((2048, 1, 15), (3072, 0, 1)):
        out = kernels.frame_noise_cuda(seed, step, vocab, first, num)
        ref = sampling.frame_noise(seed.cpu(), step.cpu(), vocab, first, num)
        assert torch.equal(out.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("C, ctx, pad, act, pairs, xb", [
    (96, 54, 3, True, False, False), (192, 6, 0, True, False, False), (1024, 6, 0, False, False, False),
    (768, 0, 0, True, False, True), (96, 18, 5, True, False, True), (1536, 1, 0, True, True, False),
    (192, 1, 0, True, True, False), (96, 2, 0, False, True, True)])
def test_snake_join_matches_the_torch_ops(dtype, C, ctx, pad, act, pairs, xb):
    """The vocoder's join: the tail rows copied bit for bit, SnakeBeta of a strided x (a slice, as a convolution's
    output is) plus a bias, computed in fp32 from the same values and rounded once, zero pad rows; or the pairs of
    rows."""
    torch.manual_seed(C + ctx)
    B, N = 3, 200
    x = (torch.randn(B, N + 7, C, device="cuda") * 3).to(dtype)[:, 2: N + 2]  # batch stride (N + 7) * C
    tail = torch.randn(B, ctx + 1, C, device="cuda").to(dtype)[:, 1:] if ctx else None  # strided too
    alpha, beta = (torch.randn(C, device="cuda") * 0.5).to(dtype), (torch.randn(C, device="cuda") * 0.5).to(dtype)
    ab = (alpha, beta) if act else (None, None)
    x_bias = torch.randn(C, device="cuda").to(dtype) if xb else None
    out = kernels.snake_join(x, tail, pad, *ab, pairs=pairs, x_bias=x_bias)
    # the torch ops on the same values in float64

    def f64(t):
        return None if t is None else t.double().cpu()
    ref = kernels.snake_join(f64(x), f64(tail), pad, *map(f64, ab), pairs=pairs, x_bias=f64(x_bias)).to(out.device)
    assert out.shape == ref.shape == ((B, N, C, 2) if pairs else (B, ctx + N + pad, C))
    assert out.dtype == dtype and out.is_contiguous()
    if pairs:
        assert torch.equal(out[:, 0, :, 1], tail[:, -1]) and torch.equal(out[:, 1:, :, 1], out[:, :-1, :, 0])
        body, ref = out[..., 0].double(), ref[..., 0]
    else:
        if ctx:
            assert torch.equal(out[:, :ctx], tail)
        assert torch.equal(out[:, ctx + N:], torch.zeros_like(out[:, ctx + N:]))
        body, ref = out[:, ctx: ctx + N].double(), ref[:, ctx: ctx + N]
    # one rounding to `dtype` (relative 2**-8 for bf16, 2**-24 for fp32 with a few more ulps from the sums), plus the
    # fp32 rounding of sin's argument (x + x_bias) * e^alpha (relative ~2**-22 with exp's and the sum's errors),
    # through a slope |sin 2u| <= 1, scaled by 1 / e^beta
    rel = 2**-8 if dtype == torch.bfloat16 else 2**-21
    xs = x.double() if x_bias is None else x.double().abs() + x_bias.double().abs()
    arg_err = (xs * alpha.double().exp()).abs() * 2**-20 / beta.double().exp() if act else 0
    assert ((body - ref).abs() <= ref.abs() * rel + arg_err + 1e-7).all()
