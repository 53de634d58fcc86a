#!/usr/bin/env bash
# One device call: start-up time of the engine as `q3tts serve` builds it (compile + CUDA graphs + warm-up request)
# on a fresh machine: cold (empty compile and Triton caches), warm (a restart on the caches the cold start left) and
# artifact (empty caches + the compiled artifact the cold start saved: `q3tts serve --load-artifact FILE`).
#   run: command: bash bench/startup.sh        (within 500 s for serve's defaults on an H100: LIMIT=480; ARTIFACT=0
#                                               skips the artifact start, RUNS=2 for two sets, QUANT=none,fp8;
#                                               PROFILE=1: per-key times, compile times, recompile reasons;
#                                               COLD_THREADS=N: the cold start (the artifact's builder) at N torch
#                                               threads, the others at the machine's)
#                                               BYTECODE=0: the installed modules as the machine has them; by
#                                               default compiled to bytecode first, as the README's Dockerfile
#                                               builds an image (each start's JSON says so: torch_bytecode)
#   CPU dry run: DEVICE=cpu TINY=1 bash bench/startup.sh   (a tiny checkpoint; the same steps and JSON)
#   CKPT=DIR: a checkpoint of $MODEL made before (bench.make_checkpoint), not made again
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
DEVICE=${DEVICE:-cuda}
M=${MODEL:-0.6B-CustomVoice}
if [ -n "${TINY:-}" ]; then
    M=tiny CK=/tmp/ck-tiny
    python3 -m q3tts.cli make-checkpoint --tiny "$CK" > /dev/null
    SIZES="--max-slots ${SLOTS:-1} --max-seq-len ${SEQ:-256}"
elif [ -n "${CKPT:-}" ]; then  # a checkpoint made before (random real-size weights of $MODEL)
    CK=$CKPT
    SIZES=${SLOTS:+--max-slots $SLOTS}
else
    CK=/tmp/ck-$M
    python3 -m bench.make_checkpoint --model "$M" --out "$CK" > /dev/null
    SIZES=${SLOTS:+--max-slots $SLOTS}
fi
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
    GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr 'A-Z' 'a-z')
else
    GPU=cpu
fi
J="$OUT/startup-$GPU-$M.json"
if [ "${BYTECODE:-1}" = 1 ]; then  # else on a machine without .pyc files and with PYTHONDONTWRITEBYTECODE set every
    # start compiles torch's Python from source (seconds of each), which a built image does once
    python3 -c "import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"
fi
timeout ${LIMIT:-480} python3 -m bench.startup --ckpt "$CK" --device "$DEVICE" --quantization "${QUANT:-none}" \
    --runs "${RUNS:-1}" ${PROFILE:+--profile} $( [ "${ARTIFACT:-1}" = 1 ] && echo --artifact ) $SIZES \
    ${COLD_THREADS:+--cold-threads $COLD_THREADS} \
    --out "$J" > /dev/null
echo "startup: exit $?"
python3 - "$J" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no result: {e}")
print(f"{r.get('device')} torch {r.get('torch')}")
for x in r["runs"]:
    c = x["counts"]
    print(f"{x['quantization']:<6} {x['cache']:<8} ready {x['ready_s']:6.1f} s at {x.get('threads')} threads "
          f"(import {x['import_s']:.1f}, load "
          f"{x['load_s']:.1f}, engine {x['engine_s']:.1f}, warm-up {x['warmup_s']:.1f}); graphs from cache "
          f"{c['fx_hit']}, compiled {c['fx_miss']}; Dynamo: traced {c.get('traced')}, entries installed "
          f"{c.get('dynamo_hit')}, {x.get('dynamo_s', 0):.1f} s" + (f"; artifact {x['artifact_bytes'] / 2**20:.1f} MiB"
                                                        if x.get("artifact_bytes") else "")
          + ("" if x.get("artifact_loaded") in (None, True) else "; ARTIFACT NOT USED"))
PY
