"""bench/load/scale_out.py's bookkeeping on hand-made records: the step test's per-step figures, the replicas Serve
added (asked, running, first request), step lengths fitted to the time left, and the tables. The Ray side runs in
the script's CPU smoke run (its header) and in tests/server/test_ray_serve.py."""

import pytest

pytest.importorskip("httpx")

from bench.load import scale_out

T0 = 1000.0  # the schedule's start (time.time())


def req(sent_s, ttfa_ms, stall_ms=0.0, replica="a", error=None):
    return {"sent": T0 + sent_s, "ttfa_s": ttfa_ms / 1000, "audio_s": 10.0, "stall_s": stall_ms / 1000, "gap_s": 0.0,
            "replica": replica, "error": error}


def row(t_s, **states):
    return {"t": T0 + t_s, "status": "HEALTHY/X", "states": states}


ROWS = [row(0.5, RUNNING=1), row(9.0, RUNNING=1), row(12.0, RUNNING=1, STARTING=1), row(18.0, RUNNING=1, STARTING=1),
        row(21.5, RUNNING=2), row(24.0, RUNNING=2, STARTING=2), row(29.0, RUNNING=3, STARTING=1),
        row(35.0, RUNNING=3, STARTING=1)]
REQUESTS = [req(1.0, 20), req(5.0, 30), req(9.9, 25),  # step 0: 0-10 s
            req(10.5, 40), req(15.0, 900, stall_ms=50), req(19.0, 60, replica="b"), req(19.5, 0, error="503: full"),
            req(22.0, 35, replica="b"), req(30.5, 45, replica="c"), req(31.0, 50, replica="a")]  # step 2: 20 s on


def test_step_summary_splits_requests_and_replicas_by_step():
    steps = scale_out.step_summary(REQUESTS, ROWS, T0, [1.0, 3.0, 5.0], [10.0, 10.0, 10.0], tolerance_s=0.001)
    assert [s["arrivals"] for s in steps] == [3, 4, 3]  # the last step also takes what was sent after its end
    assert [s["errors"] for s in steps] == [0, 1, 0]
    assert [s["replicas_running"] for s in steps] == [{"min": 1, "max": 1, "end": 1}, {"min": 1, "max": 1, "end": 1},
                                                      {"min": 2, "max": 3, "end": 3}]
    assert steps[0]["ttfa_ms"] == {"p50": 25.0, "p95": 30.0, "p99": 30.0, "max": 30.0}
    assert steps[1]["ttfa_ms"]["max"] == 900.0 and steps[1]["stalled"] == 1 and steps[1]["stall_ms"]["max"] == 50.0
    assert steps[1]["per_replica"] == {"a": 2, "b": 1} and steps[2]["per_replica"] == {"a": 1, "b": 1, "c": 1}
    assert (steps[2]["from_s"], steps[2]["to_s"], steps[2]["stalled"]) == (20.0, 30.0, 0)


def test_replica_starts_pair_each_added_replica_with_when_it_ran():
    starts = scale_out.replica_starts(ROWS, REQUESTS, T0)
    assert starts["added"] == [{"asked_s": 12.0, "running_s": 21.5, "start_s": 9.5},
                               {"asked_s": 24.0, "running_s": 29.0, "start_s": 5.0},
                               {"asked_s": 24.0, "running_s": None, "start_s": None}]  # still starting at the end
    assert starts["first_request_s"] == {"a": 1.0, "b": 19.0, "c": 30.5}


def test_step_lengths_are_shortened_alike_to_fit_or_dropped():
    assert scale_out.fit_steps([20.0, 70.0, 40.0], None) == [20.0, 70.0, 40.0]
    assert scale_out.fit_steps([20.0, 70.0, 40.0], 200.0) == [20.0, 70.0, 40.0]
    assert scale_out.fit_steps([20.0, 70.0, 40.0], 65.0) == [10.0, 35.0, 20.0]
    assert scale_out.fit_steps([20.0, 70.0, 40.0], 50.0) == []  # below 40% of the plan: no step test


def test_tables_show_the_levels_and_the_steps():
    level = {"concurrency": 64, "audio_s_per_s": 400.0, "ttfa_ms": {"p50": 200.0, "p95": 300.0},
             "stalled_share": 0.0, "stall_ms": {"p95": 0.0, "max": 0.0}, "replicas": {"a": 32, "b": 32}}
    one = dict(level, concurrency=32, audio_s_per_s=250.0, replicas={"a": 32})
    res = {"levels": [{"replicas": 2, "replica_ids": ["a", "b"], "closed": {"levels": [level]}},
                      {"replicas": 1, "replica_ids": ["a"], "closed": {"levels": [one]}}]}
    steps = scale_out.step_summary(REQUESTS, ROWS, T0, [1.0, 3.0, 5.0], [10.0, 10.0, 10.0], 0.001)
    res["autoscale"] = {"target_ongoing": 16, "config": {"upscale_delay_s": 2.0}, "rates": [1.0, 3.0, 5.0],
                        "step_s": [10.0, 10.0, 10.0], "steps": steps,
                        "replica_starts": scale_out.replica_starts(ROWS, REQUESTS, T0),
                        "summary": scale_out.autoscale_summary(ROWS, REQUESTS, T0, 0.001)}
    md = scale_out.table(res)
    assert "| 2 | 64 | 400.0 | 0.80 |" in md and "| 1 | 32 | 250.0 | 1.00 |" in md
    assert "first stalled request sent at 15.0 s; 1 of 10 requests stalled" in md
    assert "| 1 | 3.0 | 10-20 | 4 | 1 / 1 / 1 | 60.0 / 900.0 / 900.0 | 1 | 50.0 / 50.0 | [1, 2] |" in md
    assert "'asked_s': 12.0, 'running_s': 21.5, 'start_s': 9.5" in md
