"""bench.load.policy_sim: every request of the closed loop is served; host work the engine waits for shows in first
audio; the command line's costs are milliseconds."""

import json

from bench.load import policy_sim as ps
from q3tts.engine.deadline import DeadlinePolicy


def test_every_request_is_served_and_host_gaps_delay_first_audio():
    free = ps.Costs(admit_fixed=0.0, gap=0.0)
    quick = ps.simulate(DeadlinePolicy(), 32, requests=2, frames=40, costs=free)
    slow = ps.simulate(DeadlinePolicy(), 32, requests=2, frames=40, costs=ps.Costs(admit_fixed=0.0, gap=0.01))
    # 32 clients x 2 requests x 40 frames of 80 ms; a step of 32 rows (~15 ms) is far under a frame: no stall
    assert quick["stalled_share"] == 0.0 and quick["ttfa_ms"]["p95"] < 80, quick
    # 10 ms per arrival and finish before a step: a burst's arrivals alone hold its first step back by ~0.3 s
    assert slow["ttfa_ms"]["p95"] > quick["ttfa_ms"]["p95"] + 100, (quick, slow)
    assert 0 < quick["audio_s_per_s"] and quick["clients"] == 32


def test_the_command_line_takes_milliseconds_and_policy_knobs(capsys):
    assert ps.main(["--clients", "8", "--frames", "20", "--gap-ms", "10", "--alone-max", "4",
                    "--policy", "max_wait_s=0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the fake clock is deterministic: the same run as stated in seconds
    assert out == ps.simulate(DeadlinePolicy(max_wait_s=0.05), 8, frames=20, costs=ps.Costs(gap=0.01, alone_max=4))
    assert out != ps.simulate(DeadlinePolicy(max_wait_s=0.05), 8, frames=20, costs=ps.Costs(alone_max=4))
    ps.main(["--clients", "8", "--frames", "20", "--gap-ms", "10", "--policy", "max_wait_s=0.05,alone_max=4"])
    assert json.loads(capsys.readouterr().out) == out  # policy_serve's alone_max: the runner's regime in the costs
