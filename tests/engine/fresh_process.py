"""A Python process of its own for the compile-cache and artifact tests: a start that finds only the caches it is
given, as a restart or a fresh machine does."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "Q3TTS_COMPILE_CACHE", "Q3TTS_PRECOMPILE")


def run_child(script: str, *args: str, timeout: int = 300, **env: str) -> dict:
    """`python -c script args` in a fresh process -> the JSON of its last line. It inherits none of this process's
    compile-cache settings (CACHE_VARS), only those in `env`; torch and Inductor use one CPU thread unless `env` says
    otherwise; the repository is on its path."""
    base = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}
    base.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script, *args], env=base | env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
