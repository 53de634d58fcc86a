#!/usr/bin/env bash
# Stalls under load in one device call (issue #33): `q3tts serve` on random real-size checkpoints, loaded by
# bench/load/load.py (aiohttp clients, a player that starts at the first byte: the stall column):
#   0.6B-CustomVoice, 128 slots: 64 and 128 closed-loop streams of 10 s (REQS requests each)
#   1.7B-CustomVoice, 128 slots: 64 streams of 10 s; Poisson arrivals at 10 and 20 req/s of 5 s utterances
#   1.7B-Base, 128 slots (BASE=1, the default; BASE=0 skips it): a stored ICL voice, made once the server is ready
#     through its own upload route (bench/load/icl_voice.py: a synthetic 5 s 24 kHz reference and its transcript),
#     then 64 streams of 10 s in that voice (CBASE; REQS requests each): audio s/s, first audio, stalls with the
#     reference codes in every prefill and decoded in front of every stream's first chunk (ICL)
# The servers start together (their compiles overlap; each holds only its weights and what its slots need,
# 128 x 1024 positions: BENCHMARKS.md's peak memory per server at as many positions sums to under an 80 GB H100,
# not yet run as three on one GPU); on a GPU under 70 GiB (nvidia-smi's memory.total) or with BASE_TOGETHER=0 the
# Base server starts once the other two have stopped. The levels run one server at a time (the others idle); the whole run stays under LIMIT s (default 540
# with BASE=1, else 420), each wait and level bounded by what is left. JSON per server in $OUT, all of it in
# $OUT/stall_matrix.json (runs["17base-closed"]: the Base level), one summary table at the end.
#   run: command: bash bench/load/stall_matrix.sh, timeout_s 600   (one H100; the deadline policy on unless Q3TTS_DEADLINE=0)
#   CPU dry run:  DEVICE=cpu OUT=/tmp/stall bash bench/load/stall_matrix.sh   (tiny checkpoints incl. a tiny Base one, tiny loads)
# Env: DEVICE, OUT, LIMIT, SLOTS, C06 ("64,128"), C17 ("64"), CBASE ("64"), BASE (1), BASE_TOGETHER (by memory),
#      RATES ("10,20"), REQS (2), SPREAD (0: the closed levels' clients start together, a burst; 1: their starts
#      spread over 1 s, the issue's protocol: load.py --spread), FRAMES (126: 10 s), POISSON_FRAMES (63: 5 s), POISSON_S (8: seconds of arrivals
#      per rate), CLIENT_CPUS ("12-15" on cuda), TRACE (0; 1: each server's engine traced by bench/load/phase_trace.py
#      into $OUT/trace-NAME.jsonl and its .steps, every level of that server in one file, the loads with --per-request;
#      a summary per server at the end, and each level's first audio split by `phase_trace --join`: to the handler,
#      the engine, back to the client).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/stall_matrix}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
mkdir -p "$OUT"
T0=$(date +%s)
BASE=${BASE:-1}
LIMIT=${LIMIT:-$([ "$BASE" = 1 ] && echo 540 || echo 420)}
DEVICE=${DEVICE:-cuda}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
LOAD=bench.load.load
if [ "$DEVICE" = cpu ]; then
  SLOTS=${SLOTS:-4} C06=${C06:-2,3} C17=${C17:-2} RATES=${RATES:-1,2} REQS=${REQS:-1} FRAMES=${FRAMES:-12}
  POISSON_FRAMES=${POISSON_FRAMES:-6} POISSON_S=${POISSON_S:-2} CLIENT_CPUS=${CLIENT_CPUS:-0-1} PROCS=2
  python3 -m q3tts.cli make-checkpoint --tiny /tmp/stall-ck-06 > "$OUT/ckpt-06.log" 2>&1 & C1=$!
  python3 -m q3tts.cli make-checkpoint --tiny /tmp/stall-ck-17 > "$OUT/ckpt-17.log" 2>&1 & C2=$!
  CBASE=${CBASE:-2} BASE_TOGETHER=${BASE_TOGETHER:-1}
  [ "$BASE" = 1 ] && { python3 -m q3tts.cli make-checkpoint --tiny /tmp/stall-ck-17base --model-type base \
    > "$OUT/ckpt-17base.log" 2>&1 & C3=$!; }
else
  SLOTS=${SLOTS:-128} C06=${C06:-64,128} C17=${C17:-64} RATES=${RATES:-10,20} REQS=${REQS:-2} FRAMES=${FRAMES:-126}
  POISSON_FRAMES=${POISSON_FRAMES:-63} POISSON_S=${POISSON_S:-8} CLIENT_CPUS=${CLIENT_CPUS:-12-15}
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  PROCS=2
  python3 -m bench.make_checkpoint --model 0.6B-CustomVoice --out /tmp/stall-ck-06 > "$OUT/ckpt-06.log" 2>&1 & C1=$!
  python3 -m bench.make_checkpoint --model 1.7B-CustomVoice --out /tmp/stall-ck-17 > "$OUT/ckpt-17.log" 2>&1 & C2=$!
  CBASE=${CBASE:-64}
  # together only where all three servers fit: memory.total in MiB
  BASE_TOGETHER=${BASE_TOGETHER:-$(awk -F', ' '{print ($NF+0 >= 70 * 1024) ? 1 : 0; exit}' "$OUT/gpu.txt")}
  [ "$BASE" = 1 ] && { python3 -m bench.make_checkpoint --model 1.7B-Base --out /tmp/stall-ck-17base \
    > "$OUT/ckpt-17base.log" 2>&1 & C3=$!; }
fi
export BASE BASE_TOGETHER
wait $C1 && wait $C2 && { [ "$BASE" != 1 ] || wait $C3; } || { tail -5 "$OUT"/ckpt-*.log; exit 1; }
echo "checkpoints after $(( $(date +%s) - T0 )) s"

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
serve() {  # serve NAME PORT: a server on /tmp/stall-ck-NAME, its log in $OUT/serve-NAME.log
  local cmd=(-m q3tts.cli)
  [ "${TRACE:-0}" = 1 ] && { rm -f "$OUT/trace-$1.jsonl" "$OUT/trace-$1.jsonl.steps"; cmd=(-m bench.load.phase_trace "$OUT/trace-$1.jsonl"); }
  python3 "${cmd[@]}" serve --model "/tmp/stall-ck-$1" --device "$DEVICE" --port "$2" --max-concurrent "$SLOTS" \
    --max-seq-len 1024 --max-queue 1024 --voice-dir "/tmp/stall-voices-$1" > "$OUT/serve-$1.log" 2>&1 &
  PIDS+=($!)
}
ready() {  # ready NAME PORT: wait for /ready while time is left
  while [ "$(left)" -gt 0 ]; do
    curl -sf "localhost:$2/ready" > /dev/null && { echo "$1 ready after $(( $(date +%s) - T0 )) s"; return 0; }
    sleep 1
  done
  echo "$1 not ready within ${LIMIT} s"; tail -20 "$OUT/serve-$1.log"; return 1
}
load() {  # load NAME PORT ARGS...: one bench/load/load.py run against a server, JSON in $OUT/load-NAME.json
  local name=$1 port=$2; shift 2
  [ "$(left)" -gt 5 ] || { echo "no time left for $name"; return 1; }
  timeout "$(left)" python3 -m $LOAD --url "http://127.0.0.1:$port" --processes "$PROCS" \
    ${CLIENT_CPUS:+--client-cpus "$CLIENT_CPUS"} --out "$OUT/load-$name.json" "$@" \
    $([ "${TRACE:-0}" = 1 ] && echo --per-request) > /dev/null 2> "$OUT/load-$name.err"
  echo "load $name: exit $? after $(( $(date +%s) - T0 )) s"
}
base_voice() {  # the stored ICL voice "icl" on the Base server (a fresh voice directory: the name is free)
  [ "$(left)" -gt 5 ] || { echo "no time left for the ICL voice"; return 1; }
  timeout "$(left)" python3 -m bench.load.icl_voice --url http://127.0.0.1:8018 --name icl --wav "$OUT/ref.wav" \
    > "$OUT/voice.json" 2> "$OUT/voice.err" && echo "ICL voice stored after $(( $(date +%s) - T0 )) s" ||
    { echo "no ICL voice: $(tail -1 "$OUT/voice.err")"; return 1; }
}
rm -rf /tmp/stall-voices-17base
serve 06 8006
serve 17 8017
[ "$BASE" = 1 ] && [ "$BASE_TOGETHER" = 1 ] && serve 17base 8018
# all ready before any load: a server still compiling and capturing shares the GPU with the one under load
ready 0.6B 8006; R06=$?
ready 1.7B 8017; R17=$?
RB=1
[ "$BASE" = 1 ] && [ "$BASE_TOGETHER" = 1 ] && { ready 1.7B-Base 8018 && base_voice; RB=$?; }
[ $R06 = 0 ] && load 06-closed 8006 --concurrency "$C06" --spread "${SPREAD:-0}" --requests "$REQS" --max-new-tokens "$FRAMES"
[ $R17 = 0 ] && {
  load 17-closed 8017 --concurrency "$C17" --spread "${SPREAD:-0}" --requests "$REQS" --max-new-tokens "$FRAMES"
  load 17-poisson 8017 --rate "$RATES" --duration "$POISSON_S" --max-new-tokens "$POISSON_FRAMES" --no-warmup \
    --per-request
}
for port in 8006 8017; do curl -s "localhost:$port/metrics" > "$OUT/metrics-$port.txt"; done
if [ "$BASE" = 1 ] && [ "$BASE_TOGETHER" != 1 ]; then  # the GPU too small for three: the Base server on its own
  cleanup
  PIDS=()
  serve 17base 8018
  ready 1.7B-Base 8018 && base_voice; RB=$?
fi
[ "$RB" = 0 ] && {
  load 17base-closed 8018 --voice icl --concurrency "$CBASE" --spread "${SPREAD:-0}" --requests "$REQS" --max-new-tokens "$FRAMES"
  curl -s "localhost:8018/metrics" > "$OUT/metrics-8018.txt"
}
cleanup
PIDS=()
if [ "${TRACE:-0}" = 1 ]; then
  for f in "$OUT"/trace-*.jsonl; do
    [ -s "$f" ] || continue
    echo "trace $(basename "$f"): $(wc -l < "$f") first audios, $(wc -l < "$f.steps") steps logged"
    python3 -m bench.load.phase_trace --summary "$f" | grep -E "admit|first"
    name=$(basename "$f" .jsonl); name=${name#trace-}
    for l in "$OUT"/load-"$name"-*.json; do
      [ -s "$l" ] && { echo "  $(basename "$l" .json):"; python3 -m bench.load.phase_trace --join "$f" "$l"; }
    done
  done
fi

python3 - "$OUT" "$DEVICE" "$(( $(date +%s) - T0 ))" <<'PY'
import json, os, subprocess, sys
from q3tts.engine.deadline import wanted
out, device, wall = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = {}
for name in ("06-closed", "17-closed", "17-poisson", "17base-closed"):
    path = os.path.join(out, f"load-{name}.json")
    if os.path.exists(path):
        runs[name] = json.load(open(path))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
voice = os.path.join(out, "voice.json")
base = {"on": os.environ["BASE"] == "1",  # the Base level: when its server started, its stored voice
        "started": "with the others" if os.environ.get("BASE_TOGETHER") == "1" else "after the others",
        "voice": json.load(open(voice)) if os.path.exists(voice) and os.path.getsize(voice) else None}
gpu = open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(os.path.join(out, "gpu.txt")) else "cpu"
doc = {"command": "bash bench/load/stall_matrix.sh", "device": device, "gpu": gpu, "commit": commit,
       "deadline_policy": wanted(os.environ, device), "wall_s": wall,
       "base": base, "runs": runs}
json.dump(doc, open(os.path.join(out, "stall_matrix.json"), "w"), indent=1)
head = ("model", "level", "reqs", "err", "audio s/s", "ttfa p50/p95/p99 ms", "stalled", "stall p95/max ms",
        "compiled")
rows = []
for name, run in runs.items():
    for lv in run["levels"]:
        level = (f"C={lv['concurrency']}" + (f" over {lv['spread_s']:g} s" if lv.get("spread_s") else "")
                 if lv["mode"] == "closed" else f"{lv['rate']:g} req/s")
        level += ", ICL voice" if run["model"].get("tts_model_type") == "base" else ""
        t, s = lv["ttfa_ms"], lv["stall_ms"]
        rows.append((os.path.basename(run["model"]["id"].rstrip("/")), level, lv["requests"], lv["errors"],
                     lv["audio_s_per_s"], f"{t['p50']}/{t['p95']}/{t['p99']}",
                     f"{100 * lv['stalled_share']:.1f}%" if lv["stalled_share"] is not None else "-",
                     f"{s['p95']}/{s['max']}", (lv.get("server") or {}).get("compiled_graphs", "-")))
slowest = []  # open-loop levels: their slowest first audio, and when in the level each request was sent
for name, run in runs.items():
    for lv in run["levels"]:
        if lv["mode"] == "closed" or not lv.get("per_request"):
            continue
        top = sorted((r for r in lv["per_request"] if r.get("ttfa_s") is not None), key=lambda r: -r["ttfa_s"])[:3]
        slowest.append(f"{lv['rate']:g} req/s, slowest first audio: " + ", ".join(
            f"{1000 * r['ttfa_s']:.0f} ms (sent at {r['sent'] - lv['t0']:.2f} s)" for r in top))
w = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
print(f"stall matrix ({gpu}, {commit}, deadline policy {'on' if doc['deadline_policy'] else 'off'}, {wall} s)")
for r in (head, *rows):
    print("  ".join(str(x).rjust(n) for x, n in zip(r, w)))
for line in slowest:
    print(line)
PY
