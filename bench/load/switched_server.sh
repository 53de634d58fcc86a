# Sourced by bench/load/gil_switch.sh and prefill_ab.sh: their one server, a `q3tts serve` under a wrapper module that
# switches a setting by signal, and the wait until it is ready.
#   switched_server MODULE: unless SERVER_PID is set, starts `python3 -m MODULE serve` on $CKPT (made first if missing:
#     a tiny checkpoint with DEVICE=cpu, else bench.make_checkpoint --model $MODEL) with $SLOTS (128) slots,
#     max_seq_len 1024, its log in $OUT/serve.log, killed when the script exits; sets SERVER_PID
#   wait_ready [START]: until $PORT answers /ready (exit 1 if the server exits, or WAIT s pass since START: the epoch
#     second the caller's budget counts from; default now)

switched_server() {
  [ -n "${SERVER_PID:-}" ] && return 0
  if [ ! -d "$CKPT" ]; then
    if [ "$DEVICE" = cpu ]; then python3 -m q3tts.cli make-checkpoint --tiny "$CKPT" > /dev/null
    else python3 -m bench.make_checkpoint --model "$MODEL" --out "$CKPT" > /dev/null; fi || exit 1
  fi
  python3 -m "$1" serve --model "$CKPT" --device "$DEVICE" --port "$PORT" --max-concurrent "${SLOTS:-128}" \
    --max-seq-len 1024 --max-queue 1024 --voice-dir "$OUT/voices" > "$OUT/serve.log" 2>&1 &
  SERVER_PID=$!
  trap 'kill $SERVER_PID 2>/dev/null' EXIT
}

wait_ready() {
  local t0=${1:-$(date +%s)}
  until curl -sf "localhost:$PORT/ready" > /dev/null; do
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited"; tail -20 "$OUT/serve.log"; exit 1; }
    [ $(( $(date +%s) - t0 )) -lt "$WAIT" ] || { echo "server not ready within $WAIT s"; exit 1; }
    sleep 1
  done
  echo "server ready after $(( $(date +%s) - t0 )) s"
}
