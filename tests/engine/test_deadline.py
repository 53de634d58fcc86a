"""Deadline-aware streaming (q3tts.engine.deadline) on a fake clock: the real Scheduler and policy, the device's work
replaced by stated costs. The old policy (count per step, full chunks) stalls where the new one does not; admission
respects slack; chunks go nearest deadline first; nothing starves; first chunks grow with the step."""

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from q3tts.engine.deadline import (
    FRAME_S,
    DeadlinePolicy,
    MovingAverage,
    PrefillCost,
    StepTimes,
    chunk_cut,
    chunk_size_at,
    full_chunks,
    wanted,
    whole_chunks,
)
from q3tts.engine.request import EngineRequest, RequestStatus, StreamOptions
from q3tts.engine.scheduler import FrameResult, Scheduler


def stream_req(i, frames=125, arrival=0.0, prompt=20, stream=(1, 16)):
    r = EngineRequest(request_id=f"r{i}", prepared=SimpleNamespace(layout=range(prompt), text=None),
                      stream=StreamOptions(*stream) if stream else None, arrival_time=arrival)
    r.max_frames = frames
    return r


def playing(i, slack, now=10.0, pending=0):
    """A running stream (chunks 1, 2, 4, 8, 16, 16, ...) that sent its first 5 chunks (31 frames), whose listener
    has `slack` s of audio left at `now`, with `pending` frames not vocoded (its next chunk: 16)."""
    r = stream_req(i)
    r.status, r.chunks_emitted, r.frames_vocoded = RequestStatus.RUNNING, 5, 31
    r.audio_sent_s = 31 * FRAME_S
    r.first_sent_at = now - (r.audio_sent_s - slack)
    r.frames = [0] * (31 + pending)
    return r


def policy(frame=0.01, vocode=0.002, prefill=0.005, **kw) -> DeadlinePolicy:
    p = DeadlinePolicy(**kw)
    p.times.record(prefill, 1, frame, vocode)
    return p


# ---------------------------------------------------------------------------------------------- the simulation
@dataclass
class Costs:
    """The device's work per step, in seconds (stated for the simulation, not measured)."""

    frame_base: float = 0.005  # a frame of every running row: base + per row
    frame_row: float = 0.0001
    prefill_base: float = 0.03  # the prefill of a step's N newcomers: base + per newcomer
    prefill_req: float = 0.002
    vocode_base: float = 0.002  # the vocoding of a step's chunks: base + per frame
    vocode_frame: float = 0.00004
    slow_admission: tuple[int, float] = (0, 0.0)  # (k, s): the k-th step that admits (from 1) takes s longer
    alone_max: int = 0  # waves up to this many newcomers are graph replays: prefill_alone each (the engine says so)
    prefill_alone: float = 0.0


def simulate(pol: DeadlinePolicy | None, arrivals: list[float], frames: int = 125, slots: int = 128,
             costs: Costs = Costs(), held_s: float = 0.0, declared: bool = True) -> dict:
    """Streams arriving at `arrivals` (s), each of `frames` frames, through Scheduler.schedule -> prefill -> frame
    -> update_from_output -> the plan of chunks (the policy's, or full_chunks) on a fake clock. Per stream: its
    first audio and its stall (a player that starts at the first chunk: the largest lateness of a chunk). held_s:
    audio the listener's encoder keeps back until the stream's end (the player lacks it), told to the engine in
    StreamOptions.held_back_s when `declared`."""
    sched = Scheduler(max_slots=slots, max_queue=1024, policy=pol)
    reqs = [stream_req(i, frames, t, stream=(1, 16, held_s if declared else 0.0)) for i, t in enumerate(arrivals)]
    stall = dict.fromkeys(range(len(reqs)), 0.0)
    cuts = {r.request_id: [] for r in reqs}  # per stream: the chunks its audio was cut into
    now, queued, waits, admissions, waves = 0.0, 0, [], 0, []
    while not all(r.stream_done for r in reqs):
        while queued < len(reqs) and reqs[queued].arrival_time <= now:
            sched.add(reqs[queued])
            queued += 1
        if not sched.has_work():
            now = reqs[queued].arrival_time
            continue
        out = sched.schedule(now)
        n = len(out.prefill)
        waits += [now - r.arrival_time for r in out.prefill]
        waves += [n] if n else []
        prefill_s = (0.0 if not n else costs.prefill_alone * n if n <= costs.alone_max
                     else costs.prefill_base + costs.prefill_req * n)
        admissions += n > 0
        if n and admissions == costs.slow_admission[0]:
            prefill_s += costs.slow_admission[1]
        frame_s = costs.frame_base + costs.frame_row * len(out.rows)
        now += prefill_s + frame_s
        B = len(out.rows)
        sched.update_from_output(out, [0] * n, FrameResult([0] * B, [0] * B))
        rows = [r for r in out.rows if r.stream is not None]
        plan = pol.plan_chunks(rows, now, sched.queue_depth) if pol is not None else full_chunks(rows)
        vocoded = sum(k for _, k in plan)
        vocode_s = costs.vocode_base + costs.vocode_frame * vocoded if vocoded else 0.0
        now += vocode_s
        for r, k in plan:
            cuts[r.request_id] += chunk_cut(r.stream, r.frames_vocoded, k) if k else []
            if r.first_sent_at is not None:
                i = int(r.request_id[1:])
                stall[i] = max(stall[i], (now - r.first_sent_at) - (r.audio_sent_s - held_s))
            r.sent(k, k * FRAME_S, now)
            r.stream_done = r.status.finished
        if pol is not None:
            pol.record(prefill_s, n, frame_s, vocode_s if vocoded else None, alone_max=costs.alone_max)
    ttfa = sorted(r.first_sent_at - r.arrival_time for r in reqs)
    return {"stalled": sum(s > 0.001 for s in stall.values()), "stall_max": max(stall.values()),
            "ttfa_p50": ttfa[round(0.5 * (len(ttfa) - 1))], "ttfa_p95": ttfa[round(0.95 * (len(ttfa) - 1))], "ttfa_max": ttfa[-1], "wait_max": max(waits),
            "frames": [r.num_frames for r in reqs], "cuts": list(cuts.values()), "waves": waves}


def spread(n, over=1.0):
    return [over * i / n for i in range(n)]


@pytest.mark.parametrize("streams", [64, 128])
def test_the_old_policy_stalls_where_deadlines_do_not(streams):
    """Streams of 10 s whose starts spread over 1 s, a frame of 128 rows well under 80 ms, but a prefill with a
    fixed part: the old policy (up to 16 newcomers per step, first chunk 1 frame then doubling) leaves most streams
    behind their listeners; by deadline none, and nobody waits long for first audio."""
    old = simulate(None, spread(streams))
    new = simulate(DeadlinePolicy(), spread(streams))
    assert old["stalled"] > streams // 4, old
    assert new["stalled"] == 0, new
    assert new["frames"] == old["frames"] == [125] * streams  # the same work done
    assert new["cuts"] == old["cuts"]  # in the same chunks: the vocoder makes the same audio
    assert old["stall_max"] > 0.1 and new["ttfa_p95"] < 0.5, (old, new)


@pytest.mark.parametrize(("streams", "stalled"), [(1, 1), (64, 32)])
def test_audio_an_encoder_keeps_back_counts_against_slack_and_the_first_send(streams, stalled):
    """A listener whose encoder keeps 112 ms back (aac keeps 80, mp3 with a bit reservoir 136) lacks them until the
    stream's end: a one-frame first send plays for 80 - 112 < 0 ms. Untold, the policy sends as for pcm and those
    listeners stall (a lone stream's first send is one frame; under load most first sends are); told
    (StreamOptions.held_back_s), its first sends and deadlines cover it and none does, for the same work in the same
    chunks."""
    untold = simulate(DeadlinePolicy(), spread(streams), held_s=0.112, declared=False)
    told = simulate(DeadlinePolicy(), spread(streams), held_s=0.112)
    assert untold["stalled"] >= stalled, untold
    assert told["stalled"] == 0, told
    assert told["frames"] == untold["frames"] and told["cuts"] == untold["cuts"]
    assert told["ttfa_p95"] < 0.5, told


def test_held_back_audio_is_not_slack():
    r = stream_req(0, stream=(1, 16, 0.112))
    r.sent(1, FRAME_S, 1.0)
    assert r.slack(1.0) == pytest.approx(FRAME_S - 0.112)  # its listener has 80 - 112 ms: behind already
    pol = policy(frame=0.01, vocode=0.002, prefill=0.005)
    # the first send must outlast the steps to its next chunk with 112 ms less: 1 frame did for pcm, 3 now
    assert pol.first_chunk_frames(stream_req(1)) == 1
    assert pol.first_chunk_frames(stream_req(2, stream=(1, 16, 0.112))) == 3
    one_step = policy(frame=0.01, cover_next_chunk=0)  # a step, two prefills, the margin and 112 ms: 154 ms
    assert one_step.first_chunk_frames(stream_req(3)) == 1
    assert one_step.first_chunk_frames(stream_req(3, stream=(1, 16, 0.112))) == 2
    # mp3 as the server encodes it (40 ms held back), steps of 3 ms: alone one frame still covers them; beside others
    # (two prefills of 10 ms) its 40 ms do not, where pcm's 80 do
    pol, mp3 = policy(frame=0.003, vocode=0.0, prefill=0.01), stream_req(4, stream=(1, 16, 0.04))
    assert pol.first_chunk_frames(mp3, contended=False) == 1
    assert pol.first_chunk_frames(mp3) == 3 and pol.first_chunk_frames(stream_req(5)) == 1
    with pytest.raises(ValueError, match="held_back_s"):
        StreamOptions(1, 16, -0.1)


def test_a_burst_beyond_what_slack_allows_is_admitted_within_the_wait_bound():
    """256 arrivals at once into 128 slots: admission by slack, and the starvation bound for the rest."""
    pol = DeadlinePolicy()
    res = simulate(pol, [0.0] * 128)
    assert res["stalled"] == 0 and res["wait_max"] < pol.max_wait_s + 0.1, res


def test_slow_steps_make_no_stream_wait_past_the_bound():
    """Steps so long (a frame of 128 rows at 70 ms) that rows are always at risk: newcomers still come in, each
    within max_wait_s of its arrival plus a step."""
    pol = DeadlinePolicy(max_wait_s=0.5)
    costs = Costs(frame_base=0.03, frame_row=0.0003)
    res = simulate(pol, spread(32, 0.2), frames=40, slots=32, costs=costs)
    assert res["wait_max"] <= pol.max_wait_s + 4 * 0.07, res


def test_a_burst_waits_less_with_first_sends_sized_for_the_next_wave():
    """64 streams at once, the prefill 5.4 ms per newcomer (no fixed part): with 1-frame first sends every young
    row's 80 ms of slack lets in a few newcomers per step; with burst_wave 16 the first sends cover the next wave's
    prefill, so waves of 16 go and first audio p95 comes sooner, still without a stall."""
    costs = Costs(frame_base=0.0068, frame_row=0.0, prefill_base=0.0, prefill_req=0.0054, vocode_base=0.004,
                  vocode_frame=0.0)
    def known(**kw) -> DeadlinePolicy:  # waves of 1 and 16 measured before (a line through 0)
        pol = DeadlinePolicy(max_wave=0, **kw)  # (max_wave 0: 16 a step, the scheduler's)
        for n in (1, 16):
            pol.times.prefill.add(n, 0.0054 * n)
        return pol

    base = simulate(known(burst_wave=0), [0.0] * 64, costs=costs)
    burst = simulate(known(burst_wave=16), [0.0] * 64, costs=costs)
    assert base["stalled"] == burst["stalled"] == 0, (base, burst)
    assert burst["ttfa_p95"] < base["ttfa_p95"] - 0.03, (base, burst)
    assert burst["cuts"] == base["cuts"]  # the same chunks: only when they go changes


# the measured shape of a wave's prefill on a GPU (BENCHMARKS.md, "What a wave of newcomers costs"), stated: up to 10
# newcomers one graph replay each, more one batched forward with a fixed part that 11 newcomers pay nearly whole
WAVES = Costs(frame_base=0.0068, frame_row=0.0, prefill_base=0.027, prefill_req=0.0012, vocode_base=0.004,
              vocode_frame=0.0, alone_max=10, prefill_alone=0.00292)


@pytest.mark.parametrize("arrivals", [[0.0] * 64, [0.0] * 128, spread(64, 0.1)], ids=["64", "128", "64-over-100ms"])
def test_a_burst_goes_in_a_few_large_waves_without_a_stall(arrivals):
    """A burst on the measured shape of costs: with the defaults (max_wave 64, burst_wave 64: first sends cover the
    next wave) it goes in a few large waves, none in the gap between the replays and min_batch_wave, and its first
    audio p95 comes sooner than with waves of at most 16 sized by one newcomer's prefill; no stream stalls."""
    new = simulate(DeadlinePolicy(), arrivals, costs=WAVES)
    small = simulate(DeadlinePolicy(max_wave=0, burst_wave=0), arrivals, costs=WAVES)
    assert new["stalled"] == small["stalled"] == 0, (new, small)
    assert not any(10 < n < 16 for n in new["waves"] + small["waves"]), (new["waves"], small["waves"])
    assert max(new["waves"]) > 16 and len(new["waves"]) < len(small["waves"]), (new["waves"], small["waves"])
    assert new["ttfa_p95"] < small["ttfa_p95"] - 0.03, (new, small)
    assert new["cuts"] == small["cuts"]  # the same chunks: only when they go changes


def test_a_wave_in_the_gap_would_delay_the_burst():
    """64 streams over 50 ms on the measured shape of costs: without the gap (min_batch_wave 0) a wave of 11-15 pays
    the batched forward's fixed part for a few more newcomers; with it the burst's first audio p95 comes sooner."""
    gap = simulate(DeadlinePolicy(), spread(64, 0.05), costs=WAVES)
    no_gap = simulate(DeadlinePolicy(min_batch_wave=0), spread(64, 0.05), costs=WAVES)
    assert any(10 < n < 16 for n in no_gap["waves"]) and not any(10 < n < 16 for n in gap["waves"])
    assert gap["stalled"] == no_gap["stalled"] == 0 and gap["ttfa_p95"] < no_gap["ttfa_p95"] - 0.02, (gap, no_gap)


def test_one_slow_admission_is_capped_in_the_estimate():
    """One admitting step 300 ms long (the GIL held by a burst of arriving requests) among prefills of 5 ms: as
    measured, the estimate holds admission back for many steps (few newcomers at a time, then the wait bound);
    capped at twice the estimate it does not. The slow step itself stalls the one stream playing then, either way."""
    costs = Costs(frame_base=0.0068, frame_row=0.0, prefill_base=0.005, prefill_req=0.0, vocode_base=0.004,
                  vocode_frame=0.0, slow_admission=(2, 0.3))
    arrivals = [0.0] + [0.05] * 63  # one request first (the estimate's first sample), then a burst
    # (waves of 16 and first sends of one step without burst_wave: where the estimate holds admission back most)
    raw = simulate(DeadlinePolicy(max_wave=0, burst_wave=0, cover_next_chunk=0), arrivals, costs=costs)
    capped = simulate(DeadlinePolicy(max_wave=0, burst_wave=0, prefill_cap=2.0, cover_next_chunk=0), arrivals,
                      costs=costs)
    assert raw["stalled"] == capped["stalled"] == 1, (raw, capped)
    assert capped["ttfa_p95"] < raw["ttfa_p95"] - 0.2 and capped["ttfa_p50"] < raw["ttfa_p50"], (raw, capped)


def test_prefill_cap_bounds_a_sample_by_the_estimate():
    pol = DeadlinePolicy(prefill_cap=2.0)
    pol.record(0.010, 2, 0.01, None)  # the first sample goes in whole
    assert pol.times.prefill.estimate(2) == pytest.approx(0.010)
    pol.record(1.0, 2, 0.01, None)  # taken as 2 x 10 ms
    assert pol.times.prefill.estimate(2) == pytest.approx(0.010 + 0.1 * (0.020 - 0.010))
    raw = DeadlinePolicy()
    raw.record(0.010, 2, 0.01, None)
    raw.record(1.0, 2, 0.01, None)
    assert raw.times.prefill.estimate(2) == pytest.approx(0.010 + 0.1 * (1.0 - 0.010))


# ---------------------------------------------------------------------------------------------- the pieces
def test_moving_average_takes_the_first_sample_then_follows():
    m = MovingAverage(alpha=0.5)
    assert m.value == 0.0
    m.add(0.010)
    assert m.value == 0.010
    m.add(0.020)
    assert m.value == pytest.approx(0.015)
    t = StepTimes()
    t.record(0.03, 3, 0.012, None)  # three newcomers in 30 ms; nothing vocoded
    assert t.prefill.estimate(3) == pytest.approx(0.03) and t.frame.value == 0.012 and t.vocode.samples == 0
    # one size seen: fewer newcomers cost no less (all of it may be fixed), more in proportion
    assert t.prefill.estimate(1) == pytest.approx(0.03) and t.prefill.estimate(6) == pytest.approx(0.06)
    t.record(0.0, 0, None, 0.004)  # no newcomer, no row ran
    assert t.prefill.samples == 1 and t.frame.samples == 1 and t.step_s == pytest.approx(0.016)


def test_prefill_cost_fits_its_fixed_part():
    """Prefills of 1..8 newcomers at 30 ms + 2 ms each: the fit finds both parts, so one newcomer is not taken for
    an eighth of eight."""
    p = PrefillCost()
    assert p.estimate(4) == 0.0
    for _ in range(20):
        for n in (1, 8, 3, 5):
            p.add(n, 0.03 + 0.002 * n)
    assert p.estimate(1) == pytest.approx(0.032) and p.estimate(16) == pytest.approx(0.062)
    assert p.estimate(0) == 0.0


def regimes(alone_max=10, per=0.003, a=0.025, b=0.0005, **kw) -> DeadlinePolicy:
    """A policy whose prefill estimate learnt a runner's two regimes: up to alone_max newcomers `per` s each (graph
    replays), more a + b * N (one batched forward) (stated, not measured)."""
    pol = DeadlinePolicy(**kw)
    pol.times.prefill.alone_max = alone_max
    for n in (1, 4, 10, 2):
        pol.times.prefill.add(n, per * n)
    for n in (16, 64, 24, 40):
        pol.times.prefill.add(n, a + b * n)
    return pol


def test_prefill_cost_follows_each_regime():
    """Waves up to alone_max are learnt per newcomer, larger ones as a line with its fixed part, each from its own
    samples: 5 newcomers cost 5 replays, 11 pay the batched floor. One line over the same samples (alone_max 0, the
    old model) sees neither: it prices 10 and 11 far below what they cost and 1 far above a replay."""
    p = regimes().times.prefill
    assert p.alone.samples == p.batched.samples == 4
    assert p.estimate(1) == pytest.approx(0.003) and p.estimate(5) == pytest.approx(0.015)
    assert p.estimate(10) == pytest.approx(0.030)
    assert p.estimate(11) == pytest.approx(0.0305) and p.estimate(64) == pytest.approx(0.057)
    one = PrefillCost()
    for n, t in [(1, 0.003), (4, 0.012), (10, 0.030), (2, 0.006), (16, 0.033), (64, 0.057), (24, 0.037), (40, 0.045)]:
        one.add(n, t)
    assert one.estimate(1) > 2 * 0.003 and one.estimate(11) < 0.6 * 0.0305 and one.estimate(10) < 0.6 * 0.030
    # a regime not yet seen is estimated by the other's fit
    only_replays = PrefillCost(alone_max=10)
    only_replays.add(4, 0.012)
    assert only_replays.estimate(20) == pytest.approx(0.060)
    only_batched = PrefillCost(alone_max=10)
    for n in (16, 32):
        only_batched.add(n, 0.025 + 0.0005 * n)
    assert only_batched.estimate(2) == pytest.approx(0.026)
    assert PrefillCost(alone_max=10).estimate(3) == 0.0  # nothing measured


def test_a_wave_is_never_in_the_gap_between_replays_and_the_batched_forward():
    """For every budget and number of candidates, the wave is the largest whose estimate fits, never past alone_max
    and short of min_batch_wave: 12 ready go as 10 replays (the other 2 next step), not as one batched forward of 12
    that costs the floor; a larger wave goes once there are min_batch_wave and the budget fits it."""
    pol = regimes()
    est = pol.times.prefill.estimate
    for c in range(0, 41):
        for budget in [-1.0] + [k * 0.001 for k in range(0, 60)] + [math.inf]:
            n = pol.wave(c, 0, budget)
            fits = [m for m in range(1, c + 1) if est(m) <= budget and not 10 < m < 16]
            assert n == max(fits, default=0), (c, budget, n)
            assert not 10 < n < 16 and (n == 0 or est(n) <= budget)
    assert pol.wave(12, 0, math.inf) == 10 and pol.wave(15, 0, 0.05) == 10 and pol.wave(16, 0, 0.05) == 16
    assert pol.wave(40, 0, 0.0301) == 10 and pol.wave(40, 0, 0.034) == 18  # 10 replays, or 18 in one forward
    assert pol.wave(40, 0, 0.020) == 6  # only replays fit
    assert pol.wave(12, 12, 0.0) == 12 and pol.wave(12, 3, -1.0) == 3  # max_wait forces, even into the gap
    # no replays (CPU, paged) or no gap asked for: every size may go
    assert regimes(alone_max=0).wave(12, 0, math.inf) == 12
    assert regimes(min_batch_wave=0).wave(12, 0, math.inf) == 12


def test_the_scheduler_admits_the_policy_s_wave():
    """With the engine idle (no budget limit) 12 ready requests go as 10 replays then 2; 20 in one wave of 20 with
    max_wave 32 (16: the scheduler's max_prefills_per_step with max_wave 0); requests that waited max_wait_s go even as
    a wave in the gap."""
    now = 10.0
    pol = regimes(max_wave=0)
    s = Scheduler(max_slots=64, max_queue=64, policy=pol)
    for i in range(12):
        s.add(stream_req(i, arrival=now))
    assert len(s.schedule(now).prefill) == 10 and len(s.schedule(now).prefill) == 2
    for i in range(20):
        s.add(stream_req(100 + i, arrival=now))
    assert len(s.schedule(now).prefill) == 16
    pol.max_wave = 32
    assert len(s.schedule(now).prefill) == 4
    for i in range(20):
        s.add(stream_req(200 + i, arrival=now))
    assert len(s.schedule(now).prefill) == 20
    for i in range(12):
        s.add(stream_req(300 + i, arrival=now))
    for r in s.waiting:
        r.ready_at = now - pol.max_wait_s
    assert len(s.schedule(now).prefill) == 12


def test_first_sends_cover_the_wave_the_policy_would_admit():
    """burst_wave 16 with 12 requests waiting: the next wave is 10 replays (not 12 in the gap), so a first send
    covers their prefill."""
    pol = regimes(burst_wave=16)
    pol.times.frame.add(0.01)
    r = stream_req(0)
    # a step (10 ms) + 10 replays (30 ms) + the margin (20 ms): 60 ms -> 1 frame; 16: 10 + 33 + 20 -> 1 frame as well
    assert pol.first_chunk_frames(r, waiting=12) == math.ceil((0.01 + 0.030 + 0.02) / FRAME_S)
    pol.times.prefill.add(64, 0.2)  # a slow batched forward: 16 newcomers now cost more than 80 ms
    assert pol.first_chunk_frames(r, waiting=12) == 1
    assert pol.first_chunk_frames(r, waiting=40) == math.ceil((0.01 + pol.times.prefill.estimate(16) + 0.02) / FRAME_S)


def test_admission_respects_the_smallest_slack():
    """Budget = min over rows that play and can run of slack - steps until a whole chunk - margin; newcomers while
    their prefill fits."""
    now = 10.0
    pol = policy(frame=0.01, vocode=0.0, prefill=0.005, margin_s=0.02)
    s = Scheduler(max_slots=64, policy=pol)
    # 16 pending: its next chunk goes this step; 10 pending: 6 more steps before it can
    assert pol.admission_budget([playing(0, slack=0.2, pending=10)], now) == pytest.approx(0.2 - 6 * 0.01 - 0.02)
    running = [playing(0, slack=0.5, pending=16), playing(1, slack=0.0605, pending=16), playing(2, slack=-1.0)]
    running[2].prepared.text, running[2].text_fed = object(), 0  # waiting for streamed text: not ours to keep
    for k, r in enumerate(running):
        r.slot = k
        s.running[k] = r
        s.free_slots.remove(k)
    assert pol.admission_budget(running, now) == pytest.approx(0.0605 - 0.01 - 0.02)
    for i in range(10):
        s.add(stream_req(10 + i, arrival=now))
    out = s.schedule(now)
    assert len(out.prefill) == 6  # 6 x 5 ms <= 30 ms < 7 x 5 ms
    running[1].audio_sent_s -= 0.04  # now at risk: 20 ms of slack < a step + the margin
    assert pol.admission_budget(running, now) < 0 and s.schedule(now).prefill == []
    late = stream_req(99, arrival=now + 0.5)
    s.add(late)
    out = s.schedule(now + pol.max_wait_s)  # those that waited long enough go, whatever the slack; not the late one
    assert [r.request_id for r in out.prefill] == [f"r{i}" for i in range(16, 20)] and late in s.waiting


def test_the_wait_bound_runs_from_when_the_prompt_was_ready():
    """A request whose arrival_time is long past (a long text's later segment, a streamed text's request whose prompt
    has just filled) waits for slack as a newcomer does: its bound runs from when a schedule() first found it ready."""
    now = 10.0
    pol = policy(frame=0.01, vocode=0.0, prefill=0.005, margin_s=0.02)
    s = Scheduler(max_slots=8, policy=pol)
    r = playing(0, slack=0.0, pending=16)  # at risk: no prefill fits
    r.slot = 0
    s.running[0], s.free_slots = r, list(range(7, 0, -1))
    seg = stream_req(1, arrival=0.0)
    s.add(seg)
    assert pol.admission_budget([r], now) < 0
    assert s.schedule(now).prefill == [] and seg.ready_at == now
    assert s.schedule(now + pol.max_wait_s / 2).prefill == []
    assert s.schedule(now + pol.max_wait_s).prefill == [seg]


def test_a_row_stalled_on_its_text_sends_its_whole_chunks_at_once():
    """A row not yet playing whose streamed text has not come sends the whole chunks it has (holding them back for a
    bigger first chunk gains nothing while it cannot run)."""
    pol = policy(frame=0.05)  # long steps: a first chunk of several frames
    r = stream_req(0)
    r.status, r.frames = RequestStatus.RUNNING, [0]  # one frame: its first whole chunk (StreamOptions(1, 16))
    assert pol.first_chunk_frames(r, contended=True) > 1
    assert pol.plan_chunks([r, stream_req(1)], 10.0) == []  # it can run: it waits for a bigger first chunk
    r.prepared.text, r.text_fed = SimpleNamespace(), 0  # now waiting for streamed text
    assert not r.can_run and pol.plan_chunks([r, stream_req(1)], 10.0) == [(r, 1)]


def test_the_first_newcomer_goes_whenever_no_row_is_at_risk():
    """Before any prefill was measured, one newcomer goes while no row is at risk (budget >= 0); once a prefill is
    known to take longer than the slack allows, newcomers wait (until max_wait_s)."""
    now = 10.0
    pol = policy(frame=0.01, vocode=0.0, prefill=0.0)
    pol.times.prefill, pol.max_wave = PrefillCost(), 0  # nothing measured; the scheduler's one a step
    s = Scheduler(max_slots=8, max_prefills_per_step=1, policy=pol)
    r = playing(0, slack=0.05, pending=16)  # budget 50 - 10 - 20 = 20 ms
    r.slot = 0
    s.running[0], s.free_slots = r, list(range(7, 0, -1))
    for i in (1, 2):
        s.add(stream_req(i, arrival=now))
    assert [x.request_id for x in s.schedule(now).prefill] == ["r1"]
    pol.times.record(0.2, 1, None, None)  # a prefill takes 200 ms
    assert s.schedule(now).prefill == []
    assert [x.request_id for x in s.schedule(now + pol.max_wait_s).prefill] == ["r2"]


def test_offline_rows_and_rows_not_yet_playing_constrain_nothing():
    pol = policy()
    offline, fresh = stream_req(0, stream=None), stream_req(1)
    offline.status = fresh.status = RequestStatus.RUNNING
    assert pol.admission_budget([offline, fresh], 10.0) == math.inf


def test_chunks_go_nearest_deadline_first_within_the_budget():
    """Rows with little slack go now with what they have; full chunks of rows with slack go by deadline while the
    step's frame budget lasts; the rest wait for a later step."""
    now = 10.0
    pol = policy(frame=0.01, vocode=0.002, min_vocode_frames=48)  # horizon 2 x 12 ms + 5 ms + 20 ms
    urgent = playing(0, slack=0.03, pending=16)  # under the horizon: goes whatever the budget
    late = playing(1, slack=2.0, pending=16)
    soon = playing(2, slack=0.5, pending=16)
    mid = playing(3, slack=1.0, pending=16)
    short = playing(4, slack=0.01, pending=15)  # no whole chunk yet: nothing to send, however late
    plan = pol.plan_chunks([late, short, mid, urgent, soon], now)
    # 48 frames: urgent's 16, then soon's and mid's; late's 16 would pass the budget
    assert [(r.request_id, n) for r, n in plan] == [("r0", 16), ("r2", 16), ("r3", 16)]
    two = playing(5, slack=0.01, pending=40)  # left waiting: its two whole chunks go together, not the 8 after
    assert [(r.request_id, n) for r, n in pol.plan_chunks([two], now)] == [("r5", 32)]
    fresh = stream_req(5)
    fresh.frames, fresh.status = [0], RequestStatus.RUNNING
    done = playing(6, slack=1.0, pending=2)
    done.status = RequestStatus.FINISHED_STOPPED
    cancelled = playing(7, slack=1.0, pending=5)
    cancelled.status = RequestStatus.FINISHED_ABORTED
    plan = pol.plan_chunks([late, fresh, cancelled, done], now)
    # the finished ones first (remainder; nothing for the cancelled), then the first chunk, then late (budget left)
    assert [(r.request_id, n) for r, n in plan] == [("r7", 0), ("r6", 2), ("r5", 1), ("r1", 16)]


def test_a_chunk_over_the_budget_alone_still_goes():
    pol = policy(min_vocode_frames=8)
    big = playing(0, slack=3.0, pending=20)
    assert [(r.request_id, n) for r, n in pol.plan_chunks([big], 10.0)] == [("r0", 16)]


def test_first_chunk_grows_with_the_step_and_respects_the_request():
    """The one-step rule (cover_next_chunk=0): a first send covers a step, two prefills and the margin."""
    one_step = functools.partial(policy, cover_next_chunk=0)
    r = stream_req(0, stream=(1, 16))
    assert one_step(frame=0.01, vocode=0.002, prefill=0.005).first_chunk_frames(r) == 1  # 42 ms: one frame
    assert one_step(frame=0.07, vocode=0.01, prefill=0.01).first_chunk_frames(r) == 2  # 120 ms
    assert one_step(frame=0.3, vocode=0.05, prefill=0.1).first_chunk_frames(r) == 8  # 570 ms
    assert one_step(frame=3.0).first_chunk_frames(r) == 16  # at most the largest chunk
    assert one_step(frame=0.07, vocode=0.01, prefill=0.01).first_chunk_frames(r, contended=False) == 2  # 100 ms
    assert one_step(frame=0.05, vocode=0.0, prefill=0.1).first_chunk_frames(r, contended=False) == 1  # alone: 70 ms
    # without the prefill term, a step and the margin: 160 ms -> 2 frames, not 3
    assert one_step(frame=0.13, vocode=0.0, prefill=0.03, first_chunk_prefills=0).first_chunk_frames(r) == 2
    assert one_step(frame=0.13, vocode=0.0, prefill=0.03).first_chunk_frames(r) == 3  # 210 ms
    # burst_wave with requests waiting: a step, the next wave's prefill (here 5 newcomers x 10 ms) and the margin
    burst = one_step(frame=0.01, vocode=0.0, prefill=0.01, burst_wave=8)
    assert burst.first_chunk_frames(r, waiting=5) == 1 and burst.first_chunk_frames(r, waiting=0) == 1  # 80 ms
    assert burst.first_chunk_frames(r, waiting=40) == 2  # 8 newcomers: 110 ms
    asked = stream_req(1, stream=(3, 16))
    assert one_step(frame=0.01).first_chunk_frames(asked) == 3  # never fewer than asked for
    # the first send waits for whole chunks that reach it: 2 frames needed -> chunks 1 + 2
    pol, now = one_step(frame=0.07, vocode=0.01, prefill=0.01), 10.0
    fresh = stream_req(2)
    fresh.status, fresh.frames = RequestStatus.RUNNING, [0] * 2
    other = playing(3, slack=5.0)
    assert pol.plan_chunks([fresh, other], now) == []
    fresh.frames.append(0)
    assert [(x.request_id, n) for x, n in pol.plan_chunks([fresh, other], now)] == [("r2", 3)]


def test_first_send_outlasts_the_steps_to_its_next_chunk():
    """The default rule: a first send is the whole chunks whose audio outlasts the steps until the next chunk is whole
    (as admission_budget counts them), the prefills and the margin, so a young row leaves the next newcomers room."""
    r = stream_req(0, stream=(1, 16))
    # a step of 12 ms: 1 frame (80 ms) outlasts the 2 steps to the 2-frame chunk + 2 prefills of 5 ms + 20 ms margin
    assert policy(frame=0.01, vocode=0.002, prefill=0.005).first_chunk_frames(r) == 1
    # a step of 30 ms: 1 frame < 2 x 30 + 10 + 20 ms; chunks 1 + 2 (240 ms) >= the 4 steps to the 4-frame chunk + 30
    slow = policy(frame=0.025, vocode=0.005, prefill=0.005)
    assert slow.first_chunk_frames(r) == 3
    assert policy(frame=0.025, vocode=0.005, prefill=0.005, cover_next_chunk=0).first_chunk_frames(r) == 1  # one step
    # an engine making audio no faster than it plays (80 ms steps): never ahead, so at most the largest chunk
    assert policy(frame=0.07, vocode=0.01, prefill=0.01).first_chunk_frames(r) == 16
    # with requests waiting, the next wave's prefill: 5 newcomers x 10 ms outlast 1 frame's 2 steps, not 3 frames' 4
    burst = policy(frame=0.01, vocode=0.0, prefill=0.01, burst_wave=8)
    assert burst.first_chunk_frames(r, waiting=5) == 3 and burst.first_chunk_frames(r, waiting=0) == 1
    asked = stream_req(1, stream=(3, 16))
    assert policy(frame=0.01).first_chunk_frames(asked) == 3  # never fewer than asked for (then 6 frames: 6 steps)
    # the first send waits for those whole chunks: 3 frames here, the step 30 ms
    now, fresh, other = 10.0, stream_req(2), playing(3, slack=5.0)
    fresh.status, fresh.frames = RequestStatus.RUNNING, [0] * 2
    assert slow.plan_chunks([fresh, other], now) == []
    fresh.frames.append(0)
    assert [(x.request_id, n) for x, n in slow.plan_chunks([fresh, other], now)] == [("r2", 3)]


def test_chunk_cut_is_the_stream_options_schedule():
    s = StreamOptions(1, 16)
    assert [chunk_size_at(s, b) for b in (0, 1, 3, 7, 15, 31, 47)] == [1, 2, 4, 8, 16, 16, 16]
    assert whole_chunks(s, 0, 10) == [1, 2, 4] and whole_chunks(s, 31, 15) == []
    assert chunk_cut(s, 0, 10) == [1, 2, 4, 3] and chunk_cut(s, 3, 12) == [4, 8]
    s = StreamOptions(3, 5)
    assert whole_chunks(s, 0, 20) == [3, 5, 5, 5] and chunk_cut(s, 3, 7) == [5, 2]


def test_slack_is_audio_sent_less_time_since_the_first_chunk():
    r = stream_req(0)
    assert r.slack(5.0) is None
    r.sent(0, 0.0, 1.0)  # an empty chunk does not start the clock
    assert r.first_sent_at is None
    r.sent(2, 0.16, 1.0)
    r.sent(4, 0.32, 1.1)
    assert r.first_sent_at == 1.0 and r.frames_vocoded == 6 and r.chunks_emitted == 3
    assert r.slack(1.3) == pytest.approx(0.48 - 0.3)


# ---------------------------------------------------------------------------------------------- on the engine
class FixedTimes(StepTimes):
    """Step times set once by the test: the engine's measurements of this machine are ignored."""

    def record(self, *args) -> None:
        pass


class RecordedTimes(StepTimes):
    """StepTimes that keep every step's record (prefill_s, admitted, frame_s, vocode_s, text_s)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def record(self, *args) -> None:
        self.records.append(args)
        super().record(*args)


def _stream_all(deadline: bool, slow_step_s: float = 0.0) -> dict:
    import numpy as np
    import torch

    from q3tts.engine.engine import Engine
    from tests.engine.steps import run_to_completion
    from tests.golden import fixtures as fx

    tts = fx.tts("cv06")
    eng = Engine(tts.ckpt, max_slots=3, max_seq_len=256, deadline=deadline)
    if deadline:  # steps taken to be long whatever this machine does: first sends grow, every row is urgent
        eng.policy.times = FixedTimes()
        StepTimes.record(eng.policy.times, slow_step_s, 1, slow_step_s, None)
    texts = [("Deadlines keep every stream ahead.", "vivian", 0), ("A second one, sampled.", "ryan", 7),
             ("Third.", "dylan", 3), ("A fourth waits for a slot.", "serena", 1)]
    reqs = [eng.add_request(tts.prepare_custom_voice(t, v, "English", seed=s, max_new_tokens=20)[0], StreamOptions(1, 4))
            for t, v, s in texts]
    chunks = run_to_completion(eng, reqs)
    by = {r.request_id: [c for c in chunks if c.request_id == r.request_id] for r in reqs}
    return {rid: (np.concatenate([c.audio for c in cs]), [c.num_frames for c in cs],
                  torch.stack(next(r for r in reqs if r.request_id == rid).frames))
            for rid, cs in by.items()}


def test_the_engine_streams_the_same_codes_and_bits_with_deadlines():
    """The same requests through the engine with the old plan and with deadlines on steps taken as long: the first
    sends and the grouping differ, the codes and every audio sample do not (whole chunks, each cut on its own)."""
    import numpy as np
    import torch

    old, new = _stream_all(False), _stream_all(True, slow_step_s=0.2)
    assert old.keys() == new.keys()
    for rid in old:
        assert torch.equal(old[rid][2], new[rid][2]), rid
        np.testing.assert_array_equal(old[rid][0], new[rid][0])
    assert any(new[rid][1] != old[rid][1] for rid in old)  # grouped otherwise: 1 + 2 frames first, as one chunk
    assert all(new[rid][1][0] >= 3 or sum(new[rid][1]) < 3 for rid in new)


def test_the_engine_tells_the_policy_its_runner_s_prefill_regimes(monkeypatch):
    """Every step's record carries the runner's prefill_alone_max: on this CPU runner (no prefill graphs) every wave
    is batched; a runner that replays up to 10 (as a CUDA one) has its waves of 2 learnt as replays."""
    from q3tts.engine.engine import Engine
    from tests.golden import fixtures as fx

    tts = fx.tts("cv06")
    eng = Engine(tts.ckpt, max_slots=4, max_seq_len=256, deadline=True)
    p = eng.policy.times.prefill
    assert eng.runner.prefill_alone_max() == 0
    for _ in range(2):
        eng.add_request(tts.prepare_custom_voice("One.", "vivian", "English", max_new_tokens=3)[0])
    eng.step()
    assert (p.alone_max, p.alone.samples, p.batched.samples) == (0, 0, 1)
    monkeypatch.setattr(eng.runner, "prefill_alone_max", lambda graphs=True: 10)
    for _ in range(2):
        eng.add_request(tts.prepare_custom_voice("Two.", "ryan", "English", max_new_tokens=3)[0])
    eng.step()
    assert (p.alone_max, p.alone.samples, p.batched.samples) == (10, 1, 1)


def test_the_text_feed_is_a_cost_of_every_step_not_of_the_newcomers(monkeypatch):
    """A step that hands a running row its streamed text and admits a newcomer: the feed's time (slow here, as a
    runner's copies can be) is recorded as the step's text time (in step_s: the horizon, the budgets), not as the
    newcomer's prefill (the wave estimates: one slow feed would hold admission back)."""
    import time

    from q3tts.engine.engine import Engine
    from tests.golden import fixtures as fx

    tts = fx.tts("cv06")
    eng = Engine(tts.ckpt, max_slots=4, max_seq_len=256, deadline=True)
    feed = eng.runner.append_text
    monkeypatch.setattr(eng.runner, "append_text", lambda feeds: (time.sleep(0.05 * any(ids for *_, ids in feeds)),
                                                                   feed(feeds)))
    eng.policy.times = times = RecordedTimes()
    streamed = tts.prepare_custom_voice(text=None, speaker="vivian", language="English", non_streaming_mode=False,
                                        max_new_tokens=20)[0]
    eng.add_request(streamed)  # offline: no deadline of its own holds the newcomer back
    streamed.text.append("Hello there, this ")
    eng.step()  # its prompt laid out, admitted
    assert eng.scheduler.num_running == 1
    streamed.text.append("is more text to say, ")
    eng.add_request(tts.prepare_custom_voice("A newcomer.", "ryan", "English", max_new_tokens=5)[0], StreamOptions(1, 4))
    eng.step()  # the streamed row's new text (50 ms) and the newcomer's prefill
    prefill_s, admitted, _, _, text_s = times.records[-1]
    assert admitted == 1 and text_s >= 0.05 and prefill_s < 0.05
    assert times.text.value > 0 and times.step_s > times.frame.value + times.vocode.value


def test_a_streamed_text_waiting_for_its_first_words_does_not_grow_first_sends():
    """A request queued before its prompt is ready (a WebSocket utterance from its first piece) is no newcomer the
    running streams make room for: beside it, a stream's first send is its first chunk, as alone (first sends cover
    the next wave's prefill only for requests ready to be admitted)."""
    from q3tts.engine.engine import Engine
    from tests.golden import fixtures as fx

    tts = fx.tts("cv06")
    eng = Engine(tts.ckpt, max_slots=4, max_seq_len=256, deadline=True)
    eng.policy.times = FixedTimes()
    StepTimes.record(eng.policy.times, 0.2, 1, 0.001, 0.001)  # a prefill of 0.2 s: covering it takes 3 frames
    quiet = tts.prepare_custom_voice(text=None, speaker="vivian", language="English", non_streaming_mode=False)[0]
    eng.add_request(quiet, StreamOptions(1, 4))  # its text never comes
    r = eng.add_request(tts.prepare_custom_voice("Speak now.", "ryan", "English", max_new_tokens=20)[0],
                        StreamOptions(1, 4))
    first = []
    for _ in range(20):
        first = [c.num_frames for c in eng.step() if c.request_id == r.request_id and c.num_frames]
        if first:
            break
    assert (eng.scheduler.queue_depth, eng.scheduler.num_ready) == (1, 0)
    assert first == [1]


def test_q3tts_deadline_sets_the_policy_and_unset_it_is_on_for_cuda_only():
    """$Q3TTS_DEADLINE unset or empty: on for a CUDA engine, off on a CPU; ON / OFF words in either case on any
    device; anything else an error naming both lists."""
    assert wanted({}, "cuda") and wanted({"Q3TTS_DEADLINE": " "}, "cuda")
    assert not wanted({}, "cpu") and not wanted({"Q3TTS_DEADLINE": ""}, "cpu")
    assert wanted({"Q3TTS_DEADLINE": "Yes"}, "cpu") and wanted({"Q3TTS_DEADLINE": "1"}, "cpu")
    assert not wanted({"Q3TTS_DEADLINE": "0"}, "cuda") and not wanted({"Q3TTS_DEADLINE": "OFF"}, "cuda")
    with pytest.raises(ValueError, match=r"Q3TTS_DEADLINE='maybe'.*1, on, true, yes .*0, off, false, no"):
        wanted({"Q3TTS_DEADLINE": "maybe"}, "cuda")


def test_an_engine_reads_q3tts_deadline_and_a_bad_setting_fails_before_it_is_built(monkeypatch):
    """Engine() on this CPU: no policy unless $Q3TTS_DEADLINE or deadline=True asks; deadline=False wins over the
    variable; a bad $Q3TTS_DEADLINE or knob fails before the runner exists (nothing is compiled or captured for a
    server that cannot start)."""
    from q3tts.engine import engine as engine_mod
    from tests.golden import fixtures as fx

    tts = fx.tts("cv06")
    assert engine_mod.Engine(tts.ckpt, max_slots=2, max_seq_len=128).policy is None
    assert engine_mod.Engine(tts.ckpt, max_slots=2, max_seq_len=128, deadline=True).policy is not None
    monkeypatch.setenv("Q3TTS_DEADLINE", "on")
    assert engine_mod.Engine(tts.ckpt, max_slots=2, max_seq_len=128).policy is not None
    assert engine_mod.Engine(tts.ckpt, max_slots=2, max_seq_len=128, deadline=False).policy is None
    monkeypatch.setattr(engine_mod, "ModelRunner", None)  # building one would fail otherwise
    for name, raw in [("Q3TTS_DEADLINE", "sometimes"), ("Q3TTS_DEADLINE_MAX_WAIT_MS", "soon")]:
        monkeypatch.setenv("Q3TTS_DEADLINE", "1")
        monkeypatch.setenv(name, raw)
        with pytest.raises(ValueError, match=rf"{name}='{raw}'"):
            engine_mod.Engine(tts.ckpt, max_slots=2, max_seq_len=128)
        monkeypatch.delenv(name)


def test_the_deadline_policy_reads_its_knobs_from_the_environment():
    """$Q3TTS_DEADLINE_<NAME> sets DeadlinePolicy's fields (ms to s); none set: the defaults; a bad value: an error
    naming the variable and what it accepts."""
    default = DeadlinePolicy()
    pol = DeadlinePolicy.from_env({"Q3TTS_DEADLINE_MAX_WAIT_MS": "150", "Q3TTS_DEADLINE_MARGIN_MS": "10",
                           "Q3TTS_DEADLINE_BURST_WAVE": "16", "Q3TTS_DEADLINE_PREFILL_CAP": "2",
                           "Q3TTS_DEADLINE_FIRST_CHUNK_PREFILLS": "0", "Q3TTS_DEADLINE_MIN_VOCODE_FRAMES": "32",
                           "Q3TTS_DEADLINE_MIN_BATCH_WAVE": "24", "Q3TTS_DEADLINE_MAX_WAVE": "64",
                           "Q3TTS_DEADLINE_COVER_NEXT_CHUNK": "0"})
    assert (pol.max_wait_s, pol.margin_s, pol.burst_wave, pol.prefill_cap, pol.first_chunk_prefills,
            pol.min_vocode_frames, pol.min_batch_wave, pol.max_wave, pol.cover_next_chunk) == (
        pytest.approx(0.15), pytest.approx(0.01), 16, 2.0, 0.0, 32, 24, 64, 0)
    same = DeadlinePolicy.from_env({"Q3TTS_DEADLINE_MAX_WAIT_MS": ""})
    assert (same.max_wait_s, same.margin_s, same.burst_wave, same.prefill_cap, same.first_chunk_prefills) == (
        default.max_wait_s, default.margin_s, default.burst_wave, default.prefill_cap, default.first_chunk_prefills)
    for name, raw, accepted in [("BURST_WAVE", "1.5", "an integer >= 0"), ("MAX_WAIT_MS", "-1", "a number >= 0"),
                                ("PREFILL_CAP", "0.5", "a number >= 1"), ("MARGIN_MS", "nan", "a number >= 0"),
                                ("MIN_VOCODE_FRAMES", "lots", "an integer >= 1"),
                                ("MIN_BATCH_WAVE", "-1", "an integer >= 0"), ("MAX_WAVE", "8.5", "an integer >= 0")]:
        with pytest.raises(ValueError, match=rf"Q3TTS_DEADLINE_{name}=.*{raw}.*expected {accepted}"):
            DeadlinePolicy.from_env({f"Q3TTS_DEADLINE_{name}": raw})
