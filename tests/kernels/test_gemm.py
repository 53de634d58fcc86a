"""q3tts.kernels.gemm: the skinny-GEMM dispatcher (F.linear wherever the kernels do not apply; on CUDA, close to
cuBLAS), the weight-only quantized GEMM, and the one-row layer whose norms, gate and residuals ride in its GEMVs."""

import pytest
import torch
import torch.nn.functional as F

from q3tts import kernels

from .layer import no_less_accurate, random_layer


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
def test_a_compiled_caller_serves_every_row_count_with_one_graph():
    """The choice between the skinny kernels and cuBLAS is made inside the op (rows_linear), so a function compiled
    with a dynamic batch, as the decoder layer is, traces once for 2 rows and serves 16 and 17 and 64 rows without
    another graph, with the very values of the eager dispatch (the same kernel for each row count)."""
    import torch._dynamo.utils
    torch.manual_seed(2)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    f = torch.compile(lambda x: kernels.linear(x, w) * 2, dynamic=True, fullgraph=True)
    counters = torch._dynamo.utils.counters["stats"]
    for i, rows in enumerate((2, 5, 16, 17, 64)):
        x = torch.randn(rows, 1, 1024, device="cuda", dtype=torch.bfloat16)
        out = f(x)
        if i == 0:
            traced = counters["unique_graphs"]
        assert torch.equal(out, kernels.linear(x, w) * 2), rows
    assert counters["unique_graphs"] == traced


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("hidden,n", [(1024, 16), (1024, 256), (2048, 64)])
def test_one_row_layer_is_as_accurate_as_the_eager_module(hidden, n):
    """One token of one row: the layer whose norms, SiLU gate and residual adds ride in its GEMVs (and, for short
    spans, the fused attention), at the 0.6B (1024) and 1.7B talker (2048) widths: as close to the float64 result
    as the module's own ops get, caches included."""
    lay, exact, x, kv, run = random_layer(hidden, n, 1)
    assert kernels.gemv_ex_applies(x, lay.self_attn.qkv_weight, lay.mlp.down_proj.weight)
    fused, fused_kv = run(lay, torch.bfloat16, True)
    eager, eager_kv = run(lay, torch.bfloat16, False)
    ref, ref_kv = run(exact, torch.float64, False)
    no_less_accurate(fused_kv, eager_kv, ref_kv, f"hidden={hidden} n={n} caches")
    no_less_accurate(fused, eager, ref, f"hidden={hidden} n={n} output")
