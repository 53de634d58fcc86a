"""bench/load/soak.py against a live tiny-checkpoint server for a minute (CPU): twice its capacity, 20% of streams
dropped mid-stream, 5% cancelled before their first audio, bursts. Nothing fails, nothing leaks.

Q3TTS_SOAK_S sets the duration (default 60 s)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .live import start_server

ROOT = Path(__file__).resolve().parents[2]
SLOTS, QUEUE = 2, 8  # 2 x 2 steady clients + bursts of 2: at most 4 wait, so the queue never overflows
DURATION_S = float(os.environ.get("Q3TTS_SOAK_S", "60"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server("cv06", tmp_path_factory.mktemp("voices-soak"), max_concurrent=SLOTS, max_queue=QUEUE)
    yield s
    s.stop()


def test_soak_at_twice_capacity(server, tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "bench.load.soak", "--url", server.base_url, "--duration", str(DURATION_S),
           "--load", "2", "--disconnect", "0.2", "--cancel", "0.05", "--burst-every", str(DURATION_S / 4),
           "--burst-size", "2", "--min-frames", "4", "--max-frames", "40", "--warmup", str(DURATION_S / 6),
           "--poll", "0.5", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=DURATION_S + 120)
    print(p.stderr)  # the table (visible with -s / -rA)
    r = json.loads(out.read_text())
    assert p.returncode == 0 and r["ok"], r["checks"]
    # it really ran at load, with every kind of request
    assert r["max_active_slots"] == SLOTS and r["requests"] >= 20
    assert r["outcomes"].get("completed", 0) > 0 and r["outcomes"].get("disconnected", 0) > 0
    assert r["num_5xx"] == 0 and r["leaked_slots"] == 0 and r["ttfa_p95_s"] is not None
    # every dropped stream freed its slot and vocoder row once the clients were gone
    eng = server.app.state.engine.engine
    assert len(eng.vocoder.free_rows) == SLOTS and sorted(eng.scheduler.free_slots) == list(range(SLOTS))
    # memory: the server runs in this test process, whose RSS holds everything pytest loaded before; a
    # leak of one 2-frame chunk of audio per request (~30 kB) over the minute's requests would pass
    # unnoticed, so the bound (64 MB, soak's default) catches leaks of whole requests' state, not bytes
    assert r["rss_growth_mb"] is not None and r["rss_growth_mb"] <= 64
