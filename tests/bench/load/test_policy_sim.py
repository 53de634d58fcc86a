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


def test_the_vocoder_as_its_calls_and_a_final_chunk_padded_into_one():
    from types import SimpleNamespace

    from q3tts.engine.request import EngineRequest, RequestStatus, StreamOptions
    from q3tts.engine.vocoder import call_rows
    running, done = (EngineRequest(request_id=i, prepared=SimpleNamespace(layout=range(20), text=None),
                                   stream=StreamOptions()) for i in "ab")
    running.frames_vocoded = done.frames_vocoded = 15  # past the chunks of 1, 2, 4, 8 frames: chunks of 16 now
    done.status = RequestStatus.FINISHED_STOPPED
    plan, rows = [(running, 16), (done, 13)], call_rows(8, 16, 64)
    costs = ps.Costs(call_base=1.0, call_row_frame=0.01, call_row=0.1)
    # padded: one call, 2 rows x 16 frames; cut: 16 and 8 (two calls of one row), then 4, then 1
    assert ps.vocode_s(plan, costs, rows) == 1.0 + 0.01 * 2 * 16 + 0.1
    cut = ps.Costs(call_base=1.0, call_row_frame=0.01, call_row=0.1, pad_final=0)
    assert abs(ps.vocode_s(plan, cut, rows) - (4 * 1.0 + 0.01 * (16 + 8 + 4 + 1))) < 1e-12
    assert ps.vocode_s(plan, ps.Costs(), rows) == ps.Costs().vocode_base + ps.Costs().vocode_frame * 29  # per frame
    # the closed loop: 126 tokens end each stream in a final chunk of 14 frames: padded, fewer calls, more audio
    calls = dict(call_base=0.00155, call_row_frame=0.000024, call_row=0.000012)
    padded = ps.simulate(DeadlinePolicy(), 32, costs=ps.Costs(**calls))
    unpadded = ps.simulate(DeadlinePolicy(), 32, costs=ps.Costs(**calls, pad_final=0))
    assert padded["audio_s_per_s"] > unpadded["audio_s_per_s"], (padded, unpadded)
