"""bench/load/load.py's figures against a server whose output is known: bench/load/paced_server.py's real server,
whose paced engine makes exactly max_new_tokens - 1 frames (of a fixed noise) per request (its code 1 is never EOS),
one frame per decode-ms. With either client library, closed or open loop, in one process or several, every byte the server sends
is counted; a server slower than real time shows the stalls its pace implies, a faster one none."""

import json

import pytest

pytest.importorskip("aiohttp")

from bench.load import load
from bench.load.paced_server import paced_app
from tests.server.live import SPF, SR, serve

FRAME_S = SPF / SR  # 80 ms of audio per frame
FRAME_BYTES = 2 * SPF


@pytest.fixture(scope="module")
def paced():
    live = serve(paced_app(slots=4, decode_ms=1.0, vocode_ms=1.0, prefill_ms=1.0), "uvicorn-paced")
    yield live
    live.stop()


def run(tmp_path, *args) -> dict:
    out = tmp_path / "load.json"
    assert load.main([*args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_load_counts_every_byte_the_server_sends(paced, client, tmp_path):
    result = run(tmp_path, "--url", paced.base_url, "--concurrency", "3", "--requests", "2", "--max-new-tokens", "11",
                 "--client", client)
    assert result["client"] == client
    (level,) = result["levels"]
    assert level["mode"] == "closed" and level["requests"] == 6 and level["errors"] == 0, level["error_samples"]
    seconds = 10 * FRAME_S  # 10 frames
    assert level["mean_audio_s_per_request"] == round(seconds, 3) and level["audio_s"] == round(6 * seconds, 3)
    ttfa = level["ttfa_ms"]
    assert 0 < ttfa["p50"] <= ttfa["p95"] <= ttfa["p99"] <= ttfa["max"] <= 1000 * level["wall_s"]
    assert level["replicas"] == {"null": 6}
    if client == "aiohttp":  # the client's own wait until each request's headers were written, and first audio after
        send, after = level["client_send_ms"], level["ttfa_from_send_ms"]
        assert 0 <= send["p50"] <= send["max"] < ttfa["max"]
        assert 0 < after["p50"] <= ttfa["p50"] and after["max"] <= ttfa["max"]
    else:
        assert level["client_send_ms"] is None and level["ttfa_from_send_ms"] is None
    server = level["server"]  # the /metrics deltas cover this level's 6 requests and no other
    assert server["engine_steps"] >= 10 and server["ttfa_ms_mean"] > 0
    # frames every ~1 ms against 80 ms of audio each: no stream ever waits
    assert level["stalled_share"] == 0 and level["stall_ms"]["max"] <= 1.0


def test_poisson_mode_sends_the_seeded_schedule_over_two_processes(paced, tmp_path):
    rate, duration, seed = 12.0, 1.5, 7
    n = len(load.poisson_arrivals(rate, duration, seed))
    assert n > 0
    result = run(tmp_path, "--url", paced.base_url, "--rate", str(rate), "--duration", str(duration), "--seed",
                 str(seed), "--processes", "2", "--max-new-tokens", "11", "--no-warmup")
    (level,) = result["levels"]
    assert (level["mode"], level["rate"], level["seed"], level["processes"]) == ("poisson", rate, seed, 2)
    assert level["requests"] == n and level["errors"] == 0, level["error_samples"]
    assert level["audio_s"] == round(n * 10 * FRAME_S, 3)
    # both processes ran and reported each of their requests' send lag; the arrivals span about `duration`
    assert len(level["client_cpus"]) == 2 and level["send_lag_ms"]["max"] >= 0
    assert level["wall_s"] >= load.poisson_arrivals(rate, duration, seed)[-1]
    assert level["stalled_share"] == 0


def test_rate_steps_are_one_schedule_with_each_request_listed(paced, tmp_path):
    rates, step, seed = [8.0, 16.0], 0.75, 3
    arrivals = load.step_arrivals(rates, step, seed)
    result = run(tmp_path, "--url", paced.base_url, "--rate", "8,16", "--rate-steps", "--duration", str(step),
                 "--seed", str(seed), "--per-request", "--max-new-tokens", "6", "--no-warmup")
    (level,) = result["levels"]
    assert level["mode"] == "poisson-steps" and level["rate"] == rates
    assert level["requests"] == len(arrivals) and level["errors"] == 0
    reqs = level["per_request"]
    assert len(reqs) == len(arrivals) and [r["sent"] for r in reqs] == sorted(r["sent"] for r in reqs)
    # sent on the schedule: the spacing between sends follows the arrivals' (within the client's lag)
    assert reqs[-1]["sent"] - reqs[0]["sent"] == pytest.approx(arrivals[-1] - arrivals[0], abs=0.25)
    assert all(r["audio_s"] == pytest.approx(5 * FRAME_S) and r["error"] is None for r in reqs)


def test_closed_loop_over_processes_merges_every_client(paced, tmp_path):
    result = run(tmp_path, "--url", paced.base_url, "--concurrency", "3", "--requests", "1", "--processes", "2",
                 "--max-new-tokens", "6", "--no-warmup")
    (level,) = result["levels"]
    assert level["requests"] == 3 and level["errors"] == 0 and level["audio_s"] == round(3 * 5 * FRAME_S, 3)


def test_spread_starts_the_clients_evenly_over_the_given_seconds(paced, tmp_path):
    """--spread 0.6 over 4 clients in 2 processes: client w's request goes out 0.15 * w s after the level's start,
    so the sends are 0.15 s apart in order (a burst, the default, sends them together). The tolerance, half that
    spacing, fails a burst and covers the processes' start after their barrier and an event loop's wake-up
    (milliseconds each, tens on a loaded machine)."""
    result = run(tmp_path, "--url", paced.base_url, "--concurrency", "4", "--requests", "1", "--processes", "2",
                 "--spread", "0.6", "--per-request", "--max-new-tokens", "6", "--no-warmup")
    (level,) = result["levels"]
    assert level["spread_s"] == 0.6 and level["requests"] == 4 and level["errors"] == 0
    sent = [r["sent"] for r in level["per_request"]]
    assert [b - a for a, b in zip(sent, sent[1:])] == pytest.approx([0.15] * 3, abs=0.075)
    assert sent[0] - level["t0"] == pytest.approx(0.0, abs=0.075)


@pytest.mark.parametrize("spread", ["-1", "inf", "nan"])
def test_spread_must_be_finite_seconds(spread, capsys):
    with pytest.raises(SystemExit):
        load.main(["--concurrency", "2", "--spread", spread])
    assert "--spread must be a number of seconds >= 0" in capsys.readouterr().err


def test_a_server_slower_than_real_time_stalls_by_its_pace(tmp_path, monkeypatch):
    """150 ms per frame of 80 ms: frame k+1 leaves at least 150 ms after frame k, so by the last frame (N of them)
    the player that started at the first byte has waited at least (N - 1) x (150 - 80) ms in all; no more than
    the time from the first byte to the last, (N - 1) x 150 ms plus the server's overhead. (The fixed chunk plan: the
    deadline policy, when on, grows the first chunk by the step and stalls less than this pace.)"""
    monkeypatch.setenv("Q3TTS_DEADLINE", "0")
    d, frames = 0.150, 6
    live = serve(paced_app(slots=4, decode_ms=1000 * d, vocode_ms=0.0, prefill_ms=0.0), "uvicorn-paced-slow")
    try:
        result = run(tmp_path, "--url", live.base_url, "--concurrency", "2", "--requests", "1",
                     "--max-new-tokens", str(frames + 1), "--no-warmup", "--no-server-metrics")
    finally:
        live.stop()
    (level,) = result["levels"]
    assert level["requests"] == 2 and level["errors"] == 0
    assert level["mean_audio_s_per_request"] == round(frames * FRAME_S, 3)
    assert level["stalled_share"] == 1.0
    lo, hi = 1000 * (frames - 1) * (d - FRAME_S), 1000 * (frames - 1) * d
    stall, gap = level["stall_ms"], level["stall_gap_ms"]
    assert lo - 50 <= stall["p50"] <= stall["max"] <= hi + 500, (lo, hi, stall)
    # at most N - 1 pauses, so the longest is at least the total's share; never more than the total
    assert stall["p50"] / (frames - 1) - 1 <= gap["max"] <= stall["max"] + 0.1


def test_a_compressed_format_is_timed_over_the_frames_asked_for(paced, tmp_path):
    """--format mp3: every request's bytes stand for its max_new_tokens - 1 frames (the paced engine makes all of
    them), so the audio seconds are exact and the first byte is timed as for pcm."""
    result = run(tmp_path, "--url", paced.base_url, "--concurrency", "2", "--requests", "1", "--max-new-tokens", "11",
                 "--format", "mp3", "--no-server-metrics")
    (level,) = result["levels"]
    assert result["body"]["response_format"] == "mp3" and level["errors"] == 0, level["error_samples"]
    assert level["mean_audio_s_per_request"] == round(10 * FRAME_S, 3)
    assert 0 < level["ttfa_ms"]["p50"] <= level["ttfa_ms"]["max"] <= 1000 * level["wall_s"]


# --------------------------------------------------------------------------- the parts, exactly
def test_player_pauses_when_the_audio_runs_out():
    p = load.Player()
    p.feed(10.0, FRAME_BYTES)  # first byte: 80 ms to play, dry at 10.08
    p.feed(10.05, FRAME_BYTES)  # in time: dry at 10.16
    assert p.stall_s == 0 and p.gap_s == 0 and p.first_stall_at_s is None
    p.feed(10.26, 2 * FRAME_BYTES)  # 100 ms late: a pause after 2 frames played; dry at 10.42
    assert p.first_stall_at_s == pytest.approx(2 * FRAME_S)
    p.feed(10.42, FRAME_BYTES)  # exactly in time
    p.feed(10.52, FRAME_BYTES)  # 20 ms late
    assert p.stall_s == pytest.approx(0.12) and p.gap_s == pytest.approx(0.10)
    assert p.nbytes == 6 * FRAME_BYTES and p.first == 10.0
    # the total is the buffer a never-pausing player needs: max lateness against the audio before each read
    reads = [(10.0, 1), (10.05, 1), (10.26, 2), (10.42, 1), (10.52, 1)]
    before = [sum(n for _, n in reads[:i]) * FRAME_S for i in range(len(reads))]
    assert p.stall_s == pytest.approx(max(t - 10.0 - b for (t, _), b in zip(reads, before)))


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a = load.poisson_arrivals(50.0, 200.0, seed=1)
    assert a == load.poisson_arrivals(50.0, 200.0, seed=1) != load.poisson_arrivals(50.0, 200.0, seed=2)
    assert a == sorted(a) and 0 < a[0] and a[-1] < 200.0
    assert abs(len(a) - 10000) < 4 * 100  # Poisson count: mean 10000, sd 100
    with pytest.raises(ValueError, match="rate and duration must be > 0"):
        load.poisson_arrivals(0, 1, 0)


def test_step_arrivals_join_the_steps_without_a_gap():
    a = load.step_arrivals([5.0, 50.0], 10.0, seed=4)
    first, second = load.poisson_arrivals(5.0, 10.0, 4), load.poisson_arrivals(50.0, 10.0, 5)
    assert a == first + [10.0 + t for t in second] and a == sorted(a)
    b = load.step_arrivals([5.0, 50.0, 20.0], [10.0, 4.0, 6.0], seed=4)  # a length per step
    lengths = [load.poisson_arrivals(r, d, 4 + k) for k, (r, d) in enumerate([(5.0, 10.0), (50.0, 4.0), (20.0, 6.0)])]
    assert b == lengths[0] + [10.0 + t for t in lengths[1]] + [14.0 + t for t in lengths[2]]
    with pytest.raises(ValueError, match="2 rates need as many step lengths, got 3"):
        load.step_arrivals([5.0, 50.0], [1.0, 2.0, 3.0], seed=0)


def test_several_durations_need_rate_steps_and_one_per_rate(capsys):
    for args in (["--rate", "1,2", "--duration", "3,4"], ["--rate", "1,2", "--rate-steps", "--duration", "3,4,5"]):
        with pytest.raises(SystemExit):
            load.main(args)
        assert "several --duration values need --rate-steps and one per --rate value" in capsys.readouterr().err


def test_client_cpus_are_shared_out():
    assert load.parse_cpus("12-15") == [12, 13, 14, 15] and load.parse_cpus("0,2,4-5") == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="expected a list like 12-15"):
        load.parse_cpus("a-b")
    cpus = list(range(12, 22))  # 10 CPUs over 4 processes: 3, 3, 2, 2, each its own
    shares = [load.cpu_share(cpus, p, 4) for p in range(4)]
    assert shares == [[12, 13, 14], [15, 16, 17], [18, 19], [20, 21]]
    assert [load.cpu_share([0, 1], p, 3) for p in range(3)] == [[0], [1], [0]]
