#!/usr/bin/env bash
# One device call: GPU tests, our benchmark and (with PEERS=1) the peers, same checkpoint and text.
#   bash bench/device_run.sh            (in the repo root on the GPU machine; carry .whl for the peers)
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
FRAMES=${FRAMES:-125}; REPEATS=${REPEATS:-3}
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -s tests/engine/test_graphs_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
fi
for M in ${MODELS:-0.6B-CustomVoice}; do
  CK=/tmp/ck-$M
  python3 -m bench.make_checkpoint --model "$M" --out "$CK" > /dev/null
  python3 -m bench.ours --ckpt "$CK" --frames "$FRAMES" --repeats "$REPEATS" --batch ${BATCH:-16,64} \
      --out "$OUT/ours-$M.json" > /dev/null
  if [ "${COMPILE:-0}" = 1 ]; then
    Q3TTS_COMPILE=1 python3 -m bench.ours --ckpt "$CK" --frames "$FRAMES" --repeats "$REPEATS" --batch ${BATCH:-16,64} \
        --out "$OUT/ours-compiled-$M.json" > /dev/null
  fi
  if [ "${PEERS:-0}" = 1 ]; then
    python3 -m bench.peers --ckpt "$CK" --frames "$FRAMES" --repeats "$REPEATS" --timeout 200 \
        --out "$OUT/peers-$M.json" > /dev/null
  fi
done
