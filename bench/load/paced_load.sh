#!/usr/bin/env bash
# The server's HTTP side at 64/128/256 streams without a GPU (bench/load/paced_server.py: the real server, the device's
# work replaced by the step times measured on an H100), loaded by bench.load.load with each client library in turn.
#   bash bench/load/paced_load.sh [out.json]      (env: PORT, CONC, PACE="--decode-ms 6.8 --vocode-ms 4.0 --prefill-ms 5")
set -euo pipefail
PORT=${PORT:-8703}
python3 -m bench.load.paced_server --port "$PORT" --slots 256 ${PACE:-} > /tmp/paced_server.log 2>&1 &
SP=$!
trap 'kill $SP 2>/dev/null' EXIT
for i in $(seq 120); do curl -sf "localhost:$PORT/ready" >/dev/null && break; kill -0 $SP || { cat /tmp/paced_server.log; exit 1; }; sleep 1; done
runs=()
for client in aiohttp httpx; do
  python3 -m bench.load.load --url "http://127.0.0.1:$PORT" --concurrency "${CONC:-64,128,256}" --max-new-tokens 126 \
    --client $client --out "/tmp/paced_$client.json" 2>/dev/null >/dev/null
  runs+=("/tmp/paced_$client.json")
done
python3 - "${1:-/dev/stdout}" "${runs[@]}" <<'PY'
import json, os, platform, sys, datetime
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
out = {"date": datetime.date.today().isoformat(), "machine": f"{cpu}, {os.cpu_count()} cores (client and server on it)",
       "command": "bash bench/load/paced_load.sh", "pace": os.environ.get("PACE") or "defaults of bench/load/paced_server.py",
       "runs": [json.load(open(p)) for p in sys.argv[2:]]}
open(sys.argv[1], "w").write(json.dumps(out, indent=1) + "\n")
PY
