"""bench/admit.py runs end to end on a tiny checkpoint and reports a figure per wave size (CPU smoke run)."""

import json

from bench import admit as bench
from tests.golden import fixtures as fx


def test_tiny_run_reports_each_wave(capsys):
    assert bench.main(["--ckpt", str(fx.checkpoint("cv06")), "--device", "cpu", "--waves", "1,3", "--slots", "4",
                       "--max-seq-len", "256", "--runs", "1", "--warmup", "0", "--profile", "2", "--behind", "1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["device"] == "cpu" and r["slots"] == 4 and r["wave_embedding"] == "embed_prompts"
    assert set(r["waves"]) == {"1", "3"}
    for w in r["waves"].values():
        assert w["admit_ms"] > 0 and w["embed_ms"] > 0 and w["embed_host_ms"] > 0 and w["prompt_tokens"] > 0
    assert r["profile"]["N"] == 2 and r["profile"]["events"]["aten::addmm"] == 2  # one projection: two linears
    steps = r["steps"]  # --behind 1: whole steps admitting each wave behind one running stream
    assert steps["behind"] == 1 and set(steps["waves"]) == {"1", "3"}
    for w in steps["waves"].values():
        assert w["steps"] + w["admitted_other"] == 1 and w["plain_step_ms"] > 0
        assert w["steps"] == 0 or w["step_ms"] >= w["admit_phase_ms"] > 0
