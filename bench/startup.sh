#!/usr/bin/env bash
# One device call: start-up time of the engine as `q3tts serve` builds it (compile + CUDA graphs + warm-up request),
# with an empty compile cache (cold, a fresh machine) and then with the cache the cold process left (warm, a restart).
#   run: command: bash bench/startup.sh        (one cold + warm pair fits the 10-minute call: 145 s + 58 s on an
#                                               H100 host for serve's defaults; RUNS=2 for two pairs, QUANT=none,fp8;
#                                               PROFILE=1: per-key times, compile times, recompile reasons)
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
M=${MODEL:-0.6B-CustomVoice}
CK=/tmp/ck-$M
python3 -m bench.make_checkpoint --model "$M" --out "$CK" > /dev/null
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
timeout ${LIMIT:-570} python3 -m bench.startup --ckpt "$CK" --device cuda --quantization "${QUANT:-none}" \
    --runs "${RUNS:-1}" ${PROFILE:+--profile} --out "$OUT/startup-$GPU-$M.json" > /dev/null
echo "startup: exit $?"
