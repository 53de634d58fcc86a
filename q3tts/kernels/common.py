"""What every kernel family shares: Triton if installed, the switch that turns the engine's kernels off,
programmatic dependent launch, and the bf16 rounding of the fused kernels."""

from __future__ import annotations

import functools
import inspect
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear everywhere
    triton = None

MAX_ROWS = 16
ENABLED = triton is not None and os.environ.get("Q3TTS_SKINNY_GEMM", "1") != "0"  # the engine's Triton kernels


@functools.cache
def pdl() -> bool:
    """Programmatic dependent launch (Hopper and later): a kernel is scheduled while the one before it finishes, and
    loads what does not depend on it (its weights) before waiting for it (griddepcontrol): a shorter frame graph
    (BENCHMARKS.md). Inductor's kernels do not take part (engine.compile.compile_layers says why). Q3TTS_PDL=0 turns
    it off. Asked at the first launch (CUDA is up by then)."""
    return (ENABLED and os.environ.get("Q3TTS_PDL", "1") != "0" and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9)


def unspecialized(*args: str) -> dict:
    """triton.jit's keywords that compile a kernel once whatever these arguments are: an integer's value (Triton
    otherwise compiles a variant for 1 and for multiples of 16) and a pointer's alignment (a variant per 16-byte
    alignment). For kernels whose first launch with new values would otherwise compile a variant while streams wait:
    those launched outside CUDA graphs on rows [lo, lo + N) of per-slot tensors (a newcomer's slice starts at any
    row), and those captured per shape bucket while the engine serves (the aligner's conv1_gelu)."""
    names = list(args)
    keys = inspect.signature(triton.jit).parameters
    return {"do_not_specialize": names} | ({"do_not_specialize_on_alignment": names}
                                           if "do_not_specialize_on_alignment" in keys else {})


if triton is not None:

    @triton.jit
    def _bf(x):  # round fp32 to bf16 and back: where the eager module stores a bf16 result
        return x.to(tl.bfloat16).to(tl.float32)
