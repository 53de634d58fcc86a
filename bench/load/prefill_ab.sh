#!/usr/bin/env bash
# A setting's effect on first audio (issue 33), A/B/C in one server whose wrapper MODULE switches it by signal: a
# `q3tts serve` (128 slots, max_seq_len 1024, the deadline policy on) on MODEL (default 1.7B-CustomVoice), then ROUNDS
# rounds, each running every setting of SETTINGS ("name:SIGNAL ...") in turn, the order rotated per round. Default:
# bench/load/prefill_serve.py's admission regimes (eager: the batched forward past 10 newcomers; waves10 / waves4: wave
# graphs, up to 10 / 4 newcomers alone); MODULE=bench.load.deliver_serve SETTINGS="per_chunk:USR1 batched:USR2": the
# hand-over of chunks to the event loop (bench/load/deliver_serve.py); MODULE=bench.load.turn_serve
# SETTINGS="free:USR1 turn:USR2": the host turn off or on (bench/load/turn_serve.py); MODULE=bench.load.policy_serve
# SETTINGS="a:USR1 b:USR2 c:WINCH default:HUP" with POLICY_USR1 / POLICY_USR2 / POLICY_WINCH ("field=value,..." or
# "off"): the deadline policy's knobs, or no policy (bench/load/policy_serve.py). Per setting one warm-up burst (the
# policy's cost fits), a closed-loop level of C streams (C may be a list: a level each; REQS requests of 10 s each;
# their starts spread over SPREAD s, 0: a burst) and a Poisson level of RATE req/s of 5 s utterances for POISSON_S s
# (0: none). JSON per (round, setting, level) in $OUT, one summary line per level, then the medians per setting. GATE=FILE: the loads wait until FILE exists (the server
# compiles meanwhile, e.g. beside a test suite).
# The last setting listed is sent again at the end (list the server's default last).
#   run: command: bash bench/load/prefill_ab.sh      CPU dry run: DEVICE=cpu C=2 RATE=2 POISSON_S=2 FRAMES=12 bash bench/load/prefill_ab.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/prefill_ab} Q3TTS_DEADLINE=${Q3TTS_DEADLINE:-1}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda} C=${C:-64} SPREAD=${SPREAD:-0} REQS=${REQS:-2} RATE=${RATE:-20} POISSON_S=${POISSON_S:-8} ROUNDS=${ROUNDS:-3} FRAMES=${FRAMES:-126}
PORT=${PORT:-8017} WAIT=${WAIT:-300} MODEL=${MODEL:-1.7B-CustomVoice} LIMIT=${LIMIT:-100000}
CLIENT_CPUS=${CLIENT_CPUS:-$([ "$DEVICE" = cuda ] && echo 14-15 || echo 0-1)}
CKPT=${CKPT:-/tmp/prefill-ab-ck} MODULE=${MODULE:-bench.load.prefill_serve} SETTINGS=${SETTINGS:-eager:USR1 waves4:HUP waves10:USR2}
T0=$(date +%s)  # LIMIT counts from here, the server's start included
. bench/load/switched_server.sh
switched_server "$MODULE"
wait_ready "$T0"
[ -z "${GATE:-}" ] || until [ -e "$GATE" ]; do sleep 1; done  # GATE: a file whose existence starts the loads
load() {  # load NAME ARGS...: one bench.load.load run, JSON in $OUT/ab-NAME.json
  local name=$1; shift
  [ $(( LIMIT - ($(date +%s) - T0) )) -gt 20 ] || { echo "no time left for $name"; return 1; }
  python3 -m bench.load.load --url "http://127.0.0.1:$PORT" --processes 2 --client-cpus "$CLIENT_CPUS" \
    --out "$OUT/ab-$name.json" "$@" > /dev/null 2> "$OUT/ab-$name.err" || { echo "load $name failed"; tail -3 "$OUT/ab-$name.err"; }
}
switch() {  # switch SIGNAL: send it (again each second, up to 60 s) until the wrapper logs its " setting " line: on the
  # GPU machines a ready server's first signals went unhandled for a while (none of five in 5 s), later ones at once
  local before tries i
  before=$(grep -c " setting " "$OUT/serve.log")
  for tries in $(seq 60); do
    kill -"$1" "$SERVER_PID"
    for i in $(seq 20); do
      [ "$(grep -c " setting " "$OUT/serve.log")" -gt "$before" ] && { [ "$tries" = 1 ] || echo "SIG$1 confirmed at try $tries"; return 0; }
      sleep 0.05
    done
  done
  echo "SIG$1 not confirmed in the server's log in 60 tries"
  return 1
}
declare -A SIG=()
ORDER=()
for pair in $SETTINGS; do ORDER+=("${pair%%:*}"); SIG[${pair%%:*}]=${pair#*:}; done
N=${#ORDER[@]}
for r in $(seq "$ROUNDS"); do
  for i in $(seq 0 $(( N - 1 ))); do
    s=${ORDER[$(( (i + r - 1) % N ))]}
    switch "${SIG[$s]}" || echo "setting $s may not apply"
    sleep 0.3
    load "warm-$r-$s" --concurrency "$C" --requests 1 --max-new-tokens 24 --no-server-metrics
    load "$r-$s-closed" --concurrency "$C" --spread "$SPREAD" --requests "$REQS" --max-new-tokens "$FRAMES"
    [ "$POISSON_S" = 0 ] ||
      load "$r-$s-poisson" --rate "$RATE" --duration "$POISSON_S" --max-new-tokens $(( (FRAMES + 1) / 2 )) --no-warmup
  done
done
switch "${SIG[${ORDER[$(( N - 1 ))]}]}"  # back to the default
python3 - "$OUT" <<'PY'
import collections, glob, json, os, statistics, sys
per = collections.defaultdict(list)
for path in sorted(glob.glob(os.path.join(sys.argv[1], "ab-[0-9]*.json"))):
    name = os.path.basename(path)[3:-5]
    setting, kind = name.split("-")[1:]
    for lv in json.load(open(path))["levels"]:
        t, srv = lv["ttfa_ms"], lv.get("server") or {}
        level = f"{kind}-{lv.get('concurrency') or lv.get('rate')}"  # a closed level per C, a Poisson one per rate
        per[(setting, level)].append((t["p50"], t["p95"], t["p99"]))
        print(f"{name:>18} {level:>11} audio s/s {lv['audio_s_per_s']:>7} first audio p50/p95/p99 {t['p50']}/{t['p95']}/{t['p99']} ms, "
              f"server mean {srv.get('ttfa_ms_mean')} ms, admission wait {srv.get('admission_wait_ms_mean')} ms, "
              f"stalled {lv['stalled_share']} (longest {lv['stall_ms']['max']} ms, first at {lv['first_stall_at_ms']['max']} ms "
              f"at most), errors {lv['errors']}")
for (setting, level), v in sorted(per.items()):
    med = [round(statistics.median(x), 1) for x in zip(*v)]
    print(f"median of {len(v)}: {setting:>9} {level:>11} first audio p50/p95/p99 {med[0]}/{med[1]}/{med[2]} ms")
PY
