#!/usr/bin/env bash
# One device call: the GPU tests (`pytest -m gpu`) and, at the same time on the other cores, the whole CPU suite
# on the machine's own CPU (its Intel Xeon; issue 16 asks for the suite on a second CPU besides CI's).
#
#   run: carry [".scratch/xeonwhl"], command: bash bench/device_tests.sh
#
# .scratch/xeonwhl: cp312 manylinux wheels of the server extra and the openai client that the GPU image lacks
# (av, fastapi, starlette, pydantic, uvicorn, websockets, python-multipart, soundfile, soxr, openai, ...).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .scratch/xeonwhl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .scratch/xeonwhl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee "$OUT/cpu.txt"
N=$(nproc)
# GPU tests: 4 workers on the first cores (compilation is the long part, and it runs on the CPU)
timeout 570 taskset -c 0-$((N * 5 / 8 - 1)) python3 -m pytest -q -p no:cacheprovider -m gpu -n 3 tests > "$OUT/gpu_tests.txt" 2>&1 &
G=$!
# the CPU suite with no GPU visible, on the other cores
CUDA_VISIBLE_DEVICES= timeout 570 taskset -c $((N * 5 / 8))-$((N - 1)) python3 -m pytest -q -p no:cacheprovider -n $((N * 3 / 8 - 1)) tests \
  > "$OUT/cpu_tests.txt" 2>&1 &
C=$!
wait $G; echo "gpu tests: exit $?"; tail -5 "$OUT/gpu_tests.txt"
wait $C; echo "cpu suite: exit $?"; tail -5 "$OUT/cpu_tests.txt"
