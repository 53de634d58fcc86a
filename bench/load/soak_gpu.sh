#!/usr/bin/env bash
# Soak on the GPU machine: q3tts serve (0.6B-CustomVoice, real-size random weights) + bench.load.soak for
# ${SOAK_S:-600} s at twice the server's capacity (SLOTS engine slots, 2 x SLOTS streaming clients), 20% of
# streams dropped mid-stream, 5% cancelled before their first audio, bursts of SLOTS every 60 s.
# Prints soak's table; soak.json (per-request records, /metrics samples) and the server log go to $OUT.
# The server's Python deps travel as cp312 packages unpacked into .scratch/serverdeps (carry it), as for
# serve_load.sh. Exit code: soak's verdict (0 = no 5xx, no leaked slot, RSS and GPU memory flat).
set -x
export PYTHONPATH=$PWD/.scratch/serverdeps:$PWD
OUT=${OUT:-/tmp/soak-out}; mkdir -p $OUT
SLOTS=${SLOTS:-16}
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, fastapi, uvicorn, httpx; print(torch.__version__, torch.cuda.is_available())" || exit 1
t0=$(date +%s)
python3 -m bench.make_checkpoint --model 0.6B-CustomVoice --out /tmp/ckpt06 > $OUT/ckpt.log 2>&1 || { tail -20 $OUT/ckpt.log; exit 1; }
# queue room for every client beyond the slots plus a burst: any 503 is then a real failure (--strict-no-5xx)
python3 -m q3tts.cli serve --model /tmp/ckpt06 --max-concurrent $SLOTS --max-queue $((SLOTS * 4)) \
  --max-seq-len 1024 --port 8000 --voice-dir /tmp/vv > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 300); do curl -sf localhost:8000/ready && break; kill -0 $SP 2>/dev/null || { tail -30 $OUT/serve.log; exit 1; }; sleep 1; done
echo "ready after $(( $(date +%s) - t0 )) s"
# 10..150 frames (0.8..12 s of audio) per request; memory counts from 60 s on (compile + graphs warmed)
timeout $(( ${SOAK_S:-600} + 120 )) python3 -m bench.load.soak --url http://127.0.0.1:8000 --duration ${SOAK_S:-600} \
  --load 2 --disconnect 0.2 --cancel 0.05 --burst-every 60 --burst-size $SLOTS --min-frames 10 --max-frames 150 \
  --warmup 60 --poll 2 --strict-no-5xx --out $OUT/soak.json
RC=$?
curl -s localhost:8000/metrics > $OUT/metrics.txt
kill $SP; sleep 2
grep -ciE "error|traceback" $OUT/serve.log; tail -5 $OUT/serve.log
exit $RC
