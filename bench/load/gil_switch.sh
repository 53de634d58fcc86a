#!/usr/bin/env bash
# The GIL switch interval's effect on first audio under closed-loop load (issue 33), A/B in one server: a 0.6B
# `q3tts serve` (128 slots, max_seq_len 1024, the deadline policy on) whose interval bench/load/switch_serve.py sets by
# signal, then ROUNDS rounds alternating Python's 5 ms and SHORT_MS (default 0.5 ms), each `bench.load.load` at the
# closed-loop levels C (default 64,128; 2 requests of 10 s per client), after one warm-up level. JSON per round in
# $OUT/gil-ROUND-MS.json, one summary line per level. The server may already be starting (SERVER_PID set: this script
# only waits for it); otherwise CKPT is made if missing (switched_server.sh).
#   run: command: bash bench/load/gil_switch.sh      CPU dry run: DEVICE=cpu C=2 FRAMES=12 bash bench/load/gil_switch.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/gil_switch} Q3TTS_DEADLINE=${Q3TTS_DEADLINE:-1}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda} C=${C:-64,128} ROUNDS=${ROUNDS:-4} FRAMES=${FRAMES:-126} PORT=${PORT:-8006}
SHORT_MS=${SHORT_MS:-0.5} WAIT=${WAIT:-300} CLIENT_CPUS=${CLIENT_CPUS:-$([ "$DEVICE" = cuda ] && echo 14-15 || echo 0-1)}
export SHORT_MS
CKPT=${CKPT:-/tmp/gil-ck} MODEL=0.6B-CustomVoice
. bench/load/switched_server.sh
switched_server bench.load.switch_serve
wait_ready
load() {  # load NAME: the closed-loop levels against the server, JSON in $OUT/gil-NAME.json
  python3 -m bench.load.load --url "http://127.0.0.1:$PORT" --concurrency "$C" --requests 2 --max-new-tokens "$FRAMES" \
    --processes 2 --client-cpus "$CLIENT_CPUS" --out "$OUT/gil-$1.json" > /dev/null 2> "$OUT/gil-$1.err" ||
    { echo "load $1 failed"; tail -3 "$OUT/gil-$1.err"; }
}
load warm
for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then kill -USR2 "$SERVER_PID"; ms=5; else kill -USR1 "$SERVER_PID"; ms=$SHORT_MS; fi
  sleep 0.5
  load "$r-${ms}ms"
done
kill -USR2 "$SERVER_PID"
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "gil-*.json"))):
    for lv in json.load(open(path))["levels"]:
        t, srv = lv["ttfa_ms"], lv.get("server") or {}
        print(f"{os.path.basename(path)[4:-5]:>10} C={lv['concurrency']:<4} audio s/s {lv['audio_s_per_s']:>7} first audio "
              f"p50/p95 {t['p50']}/{t['p95']} ms, server mean {srv.get('ttfa_ms_mean')} ms, stalled "
              f"{lv['stalled_share']}, steps {srv.get('engine_steps')} {srv.get('step_ms_mean')}")
PY
