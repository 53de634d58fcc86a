#!/usr/bin/env bash
# Streaming-text benchmark on the GPU machine: q3tts serve (0.6B-CustomVoice, real-size random weights, compiled)
# + bench.load.text_stream (simulated LLMs over the WebSocket) at RATES tokens/s and SESSIONS sessions.
# Every session comes from this one address: the per-client cap (--ws-max-client-utterances, default 32) is
# lifted. The server's Python deps travel as cp312 packages unpacked into .scratch/serverdeps (carry it).
# TRACE=1: the server's engine traced (bench/load/phase_trace.py): where each utterance's first audio waits, summed up
# in $OUT/trace.txt. The engine's own environment passes through (e.g. Q3TTS_DEADLINE=1).
set -x
export PYTHONPATH=$PWD/.scratch/serverdeps:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv
t0=$(date +%s)
[ -d /tmp/ckpt06 ] || python3 -m bench.make_checkpoint --model 0.6B-CustomVoice --out /tmp/ckpt06 > $OUT/ckpt.log 2>&1
SERVE="-m q3tts.cli"; [ "${TRACE:-0}" = 1 ] && { rm -f $OUT/trace.jsonl; SERVE="-m bench.load.phase_trace $OUT/trace.jsonl"; }
python3 $SERVE serve --model /tmp/ckpt06 --max-concurrent ${SLOTS:-32} --max-seq-len 1024 --port 8000 \
  --ws-max-client-utterances 1024 \
  --voice-dir /tmp/vv > $OUT/serve-text.log 2>&1 &
SP=$!
for i in $(seq 400); do curl -sf localhost:8000/ready && break; kill -0 $SP 2>/dev/null || { tail -30 $OUT/serve-text.log; exit 1; }; sleep 1; done
echo "ready after $(( $(date +%s) - t0 )) s"
timeout ${TIMEOUT:-400} python3 -m bench.load.text_stream --url ws://127.0.0.1:8000 --rates ${RATES:-15,50,200} \
  --sessions ${SESSIONS:-1,32} --utterances ${UTTS:-3} --out $OUT/text_stream.json
kill $SP; sleep 2
[ "${TRACE:-0}" = 1 ] && python3 -m bench.load.phase_trace --summary $OUT/trace.jsonl | tee $OUT/trace.txt
grep -ciE "traceback" $OUT/serve-text.log; tail -3 $OUT/serve-text.log
