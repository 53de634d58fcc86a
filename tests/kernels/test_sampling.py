"""q3tts.kernels.sampling: the frame's noise kernel is the torch hash; the top-k kernels draw as sample_topk's torch ops."""

import pytest
import torch

from q3tts import kernels


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
def test_frame_noise_compiles_once_for_any_rows():
    """A newcomer's code 0 draws its noise on its rows' seed and step, a slice that starts at any row
    (runner._sample_code0): one compiled variant serves every offset and row count, else the first admission at an
    odd row compiles one while every running stream waits."""
    from q3tts import sampling
    from tests.kernels import triton_variants
    seed = torch.randint(0, 2**40, (40,), device="cuda")
    step = torch.randint(-1, 5000, (40,), device="cuda")
    kernels.frame_noise_cuda(seed[:5], step[:5], 2048, 1, 15)  # its variant, if this process has none yet
    before = triton_variants(kernels.sampling._frame_noise)
    for lo, n, first, num in ((1, 1, 0, 1), (3, 2, 0, 1), (2, 16, 1, 15), (5, 3, 0, 1), (0, 32, 1, 15)):
        out = kernels.frame_noise_cuda(seed[lo:lo + n], step[lo:lo + n], 2048, first, num)
        ref = sampling.frame_noise(seed[lo:lo + n].cpu(), step[lo:lo + n].cpu(), 2048, first, num)
        assert torch.equal(out.cpu(), ref), (lo, n)
    assert triton_variants(kernels.sampling._frame_noise) == before
