#!/usr/bin/env bash
# Ray Serve scale-out, one device call on a host with G GPUs (nvidia-h100-x4 / h200-x4: G = 4; x2: G = 2): one
# replica per GPU; the same per-replica load on G, ..., 2, 1 replicas (closed loop: 32 streams per replica; open
# loop: 3 requests/s per replica of 10 s audio, 15 s), then an autoscaling step test (1 -> G replicas, target
# 32 streams per replica, arrivals stepping 2, 4, 8 requests/s, 20 s each). bench/load/scale_out.py does the work.
#
#   bash bench/load/ray_deps.sh              # here, once: .scratch/raywhl/ (Ray + server deps for cp312, packed)
#   run: kind nvidia-h100-x4, carry [".scratch/raywhl"], timeout_s 600, command: bash bench/load/scale_out.sh
#
# Time: the replicas start once, in parallel (each loads and compiles its engine on its own GPU: the first start
# on a fresh machine is the long part), then fewer replicas are the same warm ones; everything is bounded by
# LIMIT so that one call of 9 minutes holds it with the start-up; the results are written after every level,
# so a cut run keeps what it measured. Results in $OUT (default
# /tmp/out): scale_out.json, scale_out.md (the table), every bench.load.load JSON, the logs.
#
# Knobs (environment): COMPILE (1: torch.compile, as `q3tts serve` does by default on CUDA, the production
# setting; 0: CUDA graphs without compile, faster start, slower frames; on a CPU 0), PORT (8000), REPLICAS
# (default 1,2,4 up to G, and G), SLOTS (64: each replica's --max-concurrent), PER_REPLICA (32 streams), RATE
# (3 req/s per replica), DURATION (15), MAXTOK (126: 10 s of audio), AUTO_RATES (2,4,8; "" skips the step test),
# STEP_S (20), TARGET (32), SETTLE_S (30), CLIENT_CPUS (the last 4 CPUs), PROCESSES (4 client processes), CKPT
# (a checkpoint directory instead of a fresh random 0.6B), DEVICE (cuda; cpu for a smoke run), REPLICA_CPUS (the
# server's CPUs / G - 1: Ray sets each replica's OMP threads to it), ROUTER (least-ongoing | power-of-two), LIMIT
# (seconds for bench.load.scale_out; default 525 s from the script's start less what came before it).
#
# A CPU smoke run (tiny checkpoint, 2 replicas pretending to be GPUs), as validated on the dev machine:
#   DEVICE=cpu CKPT=<tiny checkpoint> GPUS=2 REPLICAS=2,1 SLOTS=4 PER_REPLICA=2 RATE=1 DURATION=3 MAXTOK=24 \
#   MAXSEQ=256 AUTO_RATES=1,3 STEP_S=6 TARGET=2 CLIENT_CPUS= PROCESSES=2 REPLICA_CPUS=0.5 bash bench/load/scale_out.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the hosts' rule (KINDS.md)
mkdir -p "$OUT"
T0=$(date +%s)
if ! python3 -c "import ray.serve" 2>/dev/null; then  # the GPU image has no Ray: the bundle goes first on the path
  tar -C /tmp -xJf .scratch/raywhl/raydeps.tar.xz && export PYTHONPATH=/tmp/raydeps:${PYTHONPATH:-} || exit 1
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
DEVICE=${DEVICE:-cuda}
[ "$DEVICE" = cpu ] && export Q3TTS_COMPILE=${COMPILE:-0} || export Q3TTS_COMPILE=${COMPILE:-1}
export Q3TTS_COMPILE_CACHE=${Q3TTS_COMPILE_CACHE:-/tmp/q3tts-compile}  # shared by the replicas
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
python3 -c "import sys, torch, ray, fastapi; print(sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'ray', ray.__version__)" || exit 1
G=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$DEVICE" = cpu ] && G=${GPUS:-2}
if [ -z "${REPLICAS:-}" ]; then
  REPLICAS=1; r=2; while [ $r -le "$G" ]; do REPLICAS="$REPLICAS,$r"; r=$((r * 2)); done; REPLICAS="$REPLICAS,$G"
fi
N=$(nproc)
CLIENT_CPUS=${CLIENT_CPUS-$((N - 4))-$((N - 1))}
echo "GPUs $G, replicas $REPLICAS, CPUs $N (client: ${CLIENT_CPUS:-shared}), Q3TTS_COMPILE=$Q3TTS_COMPILE"
if [ -z "${CKPT:-}" ]; then
  CKPT=/tmp/ck06
  python3 -m bench.make_checkpoint --model 0.6B-CustomVoice --out $CKPT > "$OUT/ckpt.log" 2>&1 || { tail -20 "$OUT/ckpt.log"; exit 1; }
fi
AUTO=${AUTO_RATES-2,4,8}
echo "checkpoint ready after $(( $(date +%s) - T0 )) s"
LIMIT=${LIMIT:-$(( 525 - ($(date +%s) - T0) ))}  # the call's 9 minutes, less what came before; SIGINT saves
timeout --signal=INT --kill-after=10 "$LIMIT" python3 -m bench.load.scale_out --ckpt "$CKPT" --device "$DEVICE" \
  --replicas "$REPLICAS" --slots "${SLOTS:-64}" --max-seq-len "${MAXSEQ:-1024}" --max-new-tokens "${MAXTOK:-126}" \
  --streams-per-replica "${PER_REPLICA:-32}" --rate-per-replica "${RATE:-3}" --duration "${DURATION:-15}" \
  ${AUTO:+--autoscale-rates "$AUTO"} --step-s "${STEP_S:-20}" --settle-s "${SETTLE_S:-30}" --target-ongoing "${TARGET:-32}" \
  --replica-cpus "${REPLICA_CPUS:-$(( (N - 4) / G > 2 ? (N - 4) / G - 1 : 1 ))}" --router "${ROUTER:-least-ongoing}" --processes "${PROCESSES:-4}" \
  ${CLIENT_CPUS:+--client-cpus "$CLIENT_CPUS"} --port "${PORT:-8000}" --out "$OUT" 2> "$OUT/scale_out.log"
echo "bench.load.scale_out: exit $? after $(( $(date +%s) - T0 )) s"
tail -5 "$OUT/scale_out.log"
cat "$OUT/scale_out.md" 2>/dev/null
