#!/usr/bin/env bash
# Ray Serve scale-out on one host: `q3tts serve --replicas 2` (a local Ray, one GPU per replica) against one
# `q3tts serve` on one GPU, the same random 0.6B checkpoint and bench/load/load.py load (64 and 128 streams, 10 s
# of audio each); prints aggregate audio s/s both ways. One device call on a 2-GPU machine (nvidia-h200-x2):
#
#   bash bench/load/ray_deps.sh              # here, once: .scratch/raywhl/ (Ray + server deps for cp312, packed)
#   run: kind nvidia-h200-x2, carry [".scratch/raywhl"], timeout_s 600, command: bash bench/load/ray_load.sh
#
# Knobs (environment): CONC (64,128), SLOTS (64: --max-concurrent of each server), MAXTOK (126: frames + 1),
# REPLICAS (2), CKPT (a checkpoint directory instead of a fresh random 0.6B one), DEVICE (cuda; cpu for a
# smoke run), OUT (results: ray.json, one.json, summary.txt, logs).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -f .scratch/raywhl/raydeps.tar.xz ]; then  # the GPU machine has no Ray: the bundle goes first on the path
  tar -C /tmp -xJf .scratch/raywhl/raydeps.tar.xz && export PYTHONPATH=/tmp/raydeps:${PYTHONPATH:-} || exit 1
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
CONC=${CONC:-64,128}; SLOTS=${SLOTS:-64}; MAXTOK=${MAXTOK:-126}; REPLICAS=${REPLICAS:-2}; DEVICE=${DEVICE:-cuda}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
python3 -c "import sys, torch, ray, fastapi; print(sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'ray', ray.__version__)" || exit 1
df -h /dev/shm | tail -1
t0=$(date +%s)
if [ -z "${CKPT:-}" ]; then
  CKPT=/tmp/ck06
  python3 -m bench.make_checkpoint --model 0.6B-CustomVoice --out $CKPT > "$OUT/ckpt.log" 2>&1 || { tail -20 "$OUT/ckpt.log"; exit 1; }
fi
SERVE=(serve --model "$CKPT" --device "$DEVICE" --max-concurrent "$SLOTS" --max-seq-len 1024 --voice-dir /tmp/q3tts-voices)

wait_ready() {  # port pid log: until /ready is 200 (for Ray: from every replica, one request each time)
  local ok=0
  for _ in $(seq 480); do
    kill -0 "$2" 2>/dev/null || { echo "server exited"; tail -40 "$3"; return 1; }
    if curl -sf "localhost:$1/ready" > /dev/null; then ok=$((ok + 1)); [ $ok -ge 8 ] && return 0; fi
    sleep 0.5
  done
  echo "not ready"; tail -40 "$3"; return 1
}

load() {  # port name
  timeout 240 python3 -m bench.load.load --url "http://127.0.0.1:$1" --concurrency "$CONC" --max-new-tokens "$MAXTOK" \
      --no-server-metrics --out "$OUT/$2.json" 2> "$OUT/$2.err" > /dev/null
  cat "$OUT/$2.err"
}

# 1) Ray Serve: REPLICAS replicas, one GPU each (Ray hands each replica its own CUDA_VISIBLE_DEVICES)
python3 -m q3tts.cli "${SERVE[@]}" --replicas "$REPLICAS" --port 8000 > "$OUT/ray_serve.log" 2>&1 &
RP=$!
wait_ready 8000 $RP "$OUT/ray_serve.log" || { kill -INT $RP; wait $RP; exit 1; }
echo "ray: $REPLICAS replicas ready after $(( $(date +%s) - t0 )) s"
load 8000 ray
kill -INT $RP; wait $RP; echo "ray serve exited: $?"
t1=$(date +%s)

# 2) one server, one GPU, the same load
CUDA_VISIBLE_DEVICES=0 python3 -m q3tts.cli "${SERVE[@]}" --port 8001 > "$OUT/one.log" 2>&1 &
SP=$!
wait_ready 8001 $SP "$OUT/one.log" || { kill $SP; exit 1; }
echo "one GPU: ready after $(( $(date +%s) - t1 )) s"
load 8001 one
kill -INT $SP; wait $SP

python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
out = sys.argv[1]
ray, one = (json.load(open(f"{out}/{n}.json"))["levels"] for n in ("ray", "one"))
print("| streams | Ray Serve 2 replicas: audio s/s | one GPU: audio s/s | ratio | errors (ray / one) "
      "| TTFA p50 / p95 ms (ray) | (one) | requests per replica |")
print("|---:|---:|---:|---:|---|---|---|---|")
for r, o in zip(ray, one):
    print(f"| {r['concurrency']} | {r['audio_s_per_s']} | {o['audio_s_per_s']} | "
          f"{r['audio_s_per_s'] / o['audio_s_per_s']:.2f}x | {r['errors']} / {o['errors']} | "
          f"{r['ttfa_ms']['p50']} / {r['ttfa_ms']['p95']} | {o['ttfa_ms']['p50']} / {o['ttfa_ms']['p95']} | "
          f"{sorted(r['replicas'].values())} |")
EOF
