#!/usr/bin/env bash
# Ray Serve scale-out, one device call on a host with G GPUs (nvidia-h100-x4 / h200-x4: G = 4; x2: G = 2), one
# replica per GPU; bench/load/scale_out.py does the work:
#   1. `q3tts warmup --save` on GPU 0, in compile caches of its own: one cold start, which writes the compiled
#      artifact (as an image build on a GPU builder would);
#   2. G replicas start in parallel from empty compile caches, each loading the artifact (a new node with the
#      artifact baked in); then the same per-replica load on G, ..., 2, 1 of them (fewer replicas are the same warm
#      ones): closed loop, 32 streams per replica, 2 requests each back to back; open loop, Poisson arrivals at 12
#      requests/s per replica for 15 s; 10 s of audio per request;
#   3. an autoscaling step test from 1 replica up to G: target 16 ongoing requests per replica (below the streams
#      one GPU serves without stalls, so a replica is asked for when the queue builds, not after streams stall),
#      upscale delay 2 s, arrivals stepping 8 -> 24 -> 40 requests/s for 20, 70 and 40 s (the last past one GPU's
#      stall-free load; the middle one long enough for a replica asked for in it to start); an added replica loads
#      the artifact too. Per step: arrivals, replicas running, first audio p50/p95/p99, stalls; per added replica:
#      when Serve asked for it, when it ran, its first request.
#
# The call (one): kind nvidia-h100-x4, timeout_s 600, carry [".scratch/raywhl"], command:
#   bash bench/load/scale_out.sh
# (.scratch/raywhl: `bash bench/load/ray_deps.sh` here, once). What comes back, in $OUT (default /tmp/out): only
# scale_out.json (every level's load JSON, the warm-up's line, Serve's replica log, the per-step table, the replicas'
# q3tts log lines, all merged), scale_out.md (the tables) and scale_out.log (the logs' tails); the rest stays in WORK.
#
# Time: everything ends within BUDGET (540 s) of the script's start: the warm-up is bounded (WARMUP_LIMIT) and
# bench.load.scale_out gets what is left (LIMIT) less the shutdown's grace; it saves after every level, shortens
# the step test's steps to fit what is left (or skips it), and on SIGINT saves what it measured.
#
# Knobs (environment): COMPILE (1: torch.compile, as `q3tts serve` does by default on CUDA; 0: CUDA graphs without
# compile; on a CPU 0), ARTIFACT (1: step 1 and the replicas load its file; 0: each replica compiles, the compile
# cache shared), PORT (8000), REPLICAS (default 1,2,4 up to G, and G), SLOTS (64: each replica's --max-concurrent),
# PER_REPLICA (32 streams), CLOSED_REQS (2), RATE (12 req/s per replica), DURATION (15), MAXTOK (126: 10 s of audio),
# MAXSEQ (1024), AUTO_RATES (8,24,40; "" skips the step test), STEP_S (20,70,40: one or one per rate), TARGET (16),
# UPSCALE_DELAY (2), SETTLE_S (20), CLIENT_CPUS (the last 4 CPUs), PROCESSES (4 client processes), CKPT (a
# checkpoint directory instead of a fresh random 0.6B), DEVICE (cuda; cpu for a smoke run), GPUS (cpu: replicas),
# REPLICA_CPUS (the server's CPUs / G - 1: Ray sets each replica's OMP threads to it), ROUTER (least-ongoing |
# power-of-two), BUDGET (540), WARMUP_LIMIT (240), WORK (/tmp/scale_work).
#
# A CPU smoke run (tiny checkpoint, 2 replicas pretending to be GPUs, the artifact compiled on the CPU):
#   python3 -m q3tts.cli make-checkpoint --tiny --out /tmp/tiny   # (or any tiny checkpoint directory)
#   DEVICE=cpu COMPILE=1 CKPT=/tmp/tiny GPUS=2 REPLICAS=2,1 SLOTS=4 PER_REPLICA=2 RATE=1 DURATION=3 MAXTOK=24 \
#   MAXSEQ=256 AUTO_RATES=1,3 STEP_S=6,10 TARGET=2 CLIENT_CPUS= PROCESSES=2 REPLICA_CPUS=0.5 BUDGET=900 \
#   bash bench/load/scale_out.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the hosts' rule (KINDS.md)
WORK=${WORK:-/tmp/scale_work}
mkdir -p "$OUT" "$WORK"
T0=$(date +%s)
BUDGET=${BUDGET:-540}
elapsed() { echo $(( $(date +%s) - T0 )); }
finish() {  # the one log that comes back: the tails of every log of this run
  for f in "$WORK"/ckpt.log "$WORK"/warmup.log "$WORK"/scale_out.err "$WORK"/[!s]*.err; do
    [ -f "$f" ] && { echo "=== $f"; tail -c 20000 "$f"; }
  done > "$OUT/scale_out.log" 2>&1
}
if ! python3 -c "import ray.serve" 2>/dev/null; then  # the GPU image has no Ray: the bundle goes first on the path
  tar -C /tmp -xJf .scratch/raywhl/raydeps.tar.xz && export PYTHONPATH=/tmp/raydeps:${PYTHONPATH:-} || exit 1
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
DEVICE=${DEVICE:-cuda}
[ "$DEVICE" = cpu ] && export Q3TTS_COMPILE=${COMPILE:-0} || export Q3TTS_COMPILE=${COMPILE:-1}
export Q3TTS_COMPILE_CACHE=$WORK/compile-cache  # the replicas' (shared by them; empty at their first start)
python3 -c "import sys, torch, ray, fastapi; print(sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'ray', ray.__version__)" || exit 1
G=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$DEVICE" = cpu ] && G=${GPUS:-2}
if [ -z "${REPLICAS:-}" ]; then
  REPLICAS=1; r=2; while [ $r -le "$G" ]; do REPLICAS="$REPLICAS,$r"; r=$((r * 2)); done; REPLICAS="$REPLICAS,$G"
fi
N=$(nproc)
CLIENT_CPUS=${CLIENT_CPUS-$((N - 4))-$((N - 1))}
SLOTS=${SLOTS:-64}; MAXSEQ=${MAXSEQ:-1024}
RCPUS=${REPLICA_CPUS:-$(( (N - 4) / G > 2 ? (N - 4) / G - 1 : 1 ))}
echo "GPUs $G, replicas $REPLICAS, CPUs $N (client: ${CLIENT_CPUS:-shared}), Q3TTS_COMPILE=$Q3TTS_COMPILE, $(elapsed) s"
if [ -z "${CKPT:-}" ]; then
  CKPT=/tmp/ck06
  python3 -m bench.make_checkpoint --model 0.6B-CustomVoice --out $CKPT > "$WORK/ckpt.log" 2>&1 \
    || { finish; tail -20 "$WORK/ckpt.log"; exit 1; }
fi
echo "checkpoint ready after $(elapsed) s"
ART=()
if [ "${ARTIFACT:-1}" = 1 ] && [ "$Q3TTS_COMPILE" = 1 ]; then  # (nothing is compiled, nothing to save, without)
  # on GPU 0 (free again before the replicas start), with caches of its own: the replicas' stay empty; with the
  # replicas' torch threads (Ray sets OMP_NUM_THREADS to a replica's whole CPUs): Inductor's key for a graph with
  # C++ code holds the thread count, so an artifact built with another finds no hit there
  OMP_NUM_THREADS=$(python3 -c "print(max(1, int(float('$RCPUS'))))") \
  CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} Q3TTS_COMPILE_CACHE=$WORK/build-cache \
    timeout --kill-after=10 "${WARMUP_LIMIT:-240}" python3 -m q3tts.cli warmup --save "$WORK/q3tts.artifact" \
    --model "$CKPT" --device "$DEVICE" --max-concurrent "$SLOTS" --max-seq-len "$MAXSEQ" > "$WORK/warmup.log" 2>&1
  rc=$?
  echo "q3tts warmup --save: exit $rc after $(elapsed) s: $(grep '^{' "$WORK/warmup.log" | tail -1)"
  [ $rc = 0 ] && [ -f "$WORK/q3tts.artifact" ] && ART=(--artifact "$WORK/q3tts.artifact")  # else: each compiles
  ART+=(--warmup-json "$WORK/warmup.log")
fi
AUTO=${AUTO_RATES-8,24,40}
GRACE=25  # after SIGINT: Serve's and Ray's shutdown, then the logs
LIMIT=${LIMIT:-$(( BUDGET - $(elapsed) - GRACE ))}
echo "bench.load.scale_out: limit $LIMIT s"
timeout --signal=INT --kill-after=20 "$LIMIT" python3 -m bench.load.scale_out --ckpt "$CKPT" --device "$DEVICE" \
  --replicas "$REPLICAS" --slots "$SLOTS" --max-seq-len "$MAXSEQ" --max-new-tokens "${MAXTOK:-126}" \
  --streams-per-replica "${PER_REPLICA:-32}" --closed-requests "${CLOSED_REQS:-2}" \
  --rate-per-replica "${RATE:-12}" --duration "${DURATION:-15}" \
  ${AUTO:+--autoscale-rates "$AUTO"} --step-s "${STEP_S:-20,70,40}" --settle-s "${SETTLE_S:-20}" \
  --target-ongoing "${TARGET:-16}" --upscale-delay-s "${UPSCALE_DELAY:-2}" --deadline-s $(( LIMIT - 15 )) \
  --replica-cpus "$RCPUS" --router "${ROUTER:-least-ongoing}" \
  --processes "${PROCESSES:-4}" ${CLIENT_CPUS:+--client-cpus "$CLIENT_CPUS"} --port "${PORT:-8000}" "${ART[@]}" \
  --out "$OUT" --work "$WORK" 2> "$WORK/scale_out.err"
echo "bench.load.scale_out: exit $? after $(elapsed) s"
finish
grep "scale_out:" "$WORK/scale_out.err" | tail -20
cat "$OUT/scale_out.md" 2>/dev/null
