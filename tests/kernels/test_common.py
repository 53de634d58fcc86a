"""q3tts.kernels.common: Q3TTS_SKINNY_GEMM=0 turns every kernel family off (their `*_applies` say no, PDL is off, and
`linear` is F.linear bit for bit), read once at import: checked in a fresh process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from q3tts import kernels

SWITCHED_OFF = """
import torch, torch.nn.functional as F
from q3tts import kernels
x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
kv = torch.zeros(1, 8, 32, 128, device="cuda", dtype=torch.bfloat16)
assert not kernels.ENABLED and not kernels.pdl()
assert not kernels.gemv_ex_applies(x, w) and not kernels.decode_attention_applies(x[:, None], kv, 16)
assert not kernels.sample_top_applies(torch.randn(1, 2048, device="cuda"), 64)
assert torch.equal(kernels.linear(x, w), F.linear(x, w))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels.triton is None, reason="needs CUDA and Triton")
def test_the_switch_turns_every_kernel_off():
    assert kernels.ENABLED  # this process: on, so the check below sees the switch and not a missing Triton
    root = Path(kernels.__file__).parents[2]  # this checkout's q3tts, whatever is installed
    env = {**os.environ, "Q3TTS_SKINNY_GEMM": "0", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-c", SWITCHED_OFF], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
