"""The issue's load on a fake clock: the real Scheduler and DeadlinePolicy, the device's and the host's work as stated
costs, to ask which cost or knob moves first audio at 128 streams before spending device time on it.

    python -m bench.load.policy_sim                                   the costs fitted to a traced 0.6B server (below)
    python -m bench.load.policy_sim --clients 64,128 --vocode-frame-ms 0.04 --gap-ms 0 --policy max_wait_s=0.1
    python -m bench.load.policy_sim --call-base-ms 1.6 --call-row-frame-ms 0.022 --call-row-ms 0.015 --pad-final 0
                                                                      the vocoder as its calls (fitted to
                                                                      bench.probe_vocoder's graphs on an H200), a final
                                                                      chunk cut like the others

C clients, their starts spread over S s, each sending R streaming requests of F frames in a row, the next DELTA s after
its last chunk (the issue's protocol, bench.load.load --spread). A step: schedule -> prefill (a fixed host part, then
per newcomer up to the runner's alone_max, else a wave graph's base + per newcomer) -> one frame of every row ->
the policy's chunks (base + per frame; or, with --call-base-ms, the StreamingVocoder's calls, each base + per row-frame
of its rows bucket + per row past the first) -> the policy's record, as Engine._step; before it the engine's thread waits
`gap` per request that arrived or finished since the last step (the event loop holding the GIL for their HTTP work).
Per request: first audio from its arrival, and its stall (a player that starts at its first chunk). A model, not a
measurement: BENCHMARKS.md gives its fit to the traced server and what it predicted.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from types import SimpleNamespace

from q3tts.engine import vocoder
from q3tts.engine.deadline import FRAME_S, DeadlinePolicy, chunk_cut
from q3tts.engine.request import EngineRequest, StreamOptions
from q3tts.engine.scheduler import FrameResult, Scheduler


@dataclass
class Costs:
    """Seconds; the defaults fitted to the twenty-second session's trace of a 0.6B server at 128 streams (H100)."""

    frame_base: float = 0.005  # one frame of every running row: base + per row
    frame_row: float = 0.00002
    vocode_base: float = 0.003  # a step's chunks: base + per frame
    vocode_frame: float = 0.00008
    admit_fixed: float = 0.003  # an admitting step's host work besides the prefill
    alone: float = 0.0035  # per newcomer, up to alone_max (prefill graph replays)
    alone_max: int = 10
    batch_base: float = 0.003  # more newcomers: one wave graph (padded to 16, 32, 64 rows), bench.admit's idle engine
    batch_req: float = 0.00015
    gap: float = 0.001  # the engine's thread held back per request arrived or finished since the last step
    delta: float = 0.015  # a request's last chunk -> its client's next request in the handler
    # > 0: a step's chunks cost the vocoder's calls instead of vocode_base + vocode_frame per frame: each call of R rows
    # (bucket Rb) x t frames call_base + call_row_frame * Rb * t + call_row * (Rb - 1); bench.probe_vocoder's graphs
    call_base: float = 0.0
    call_row_frame: float = 0.0
    call_row: float = 0.0
    pad_final: int = 1  # 1: a stream's final chunk padded up to whole pieces (vocoder.final_pieces); 0: cut like the rest


def vocode_s(plan: list, costs: Costs, call_rows: dict[int, int], max_piece: int = 16) -> float:
    """A step's vocoding of plan [(request, frames)] (frames > 0; a finished request's are its last)."""
    frames = sum(n for _, n in plan)
    if not frames:
        return 0.0
    if costs.call_base <= 0:
        return costs.vocode_base + costs.vocode_frame * frames
    cuts = [vocoder.cut(chunk_cut(r.stream, r.frames_vocoded, n), bool(costs.pad_final) and r.status.finished,
                        max_piece) for r, n in plan]
    total = 0.0
    for size, items in vocoder.calls(cuts, call_rows):
        rb = 1 << (len(items) - 1).bit_length()  # the rows bucket a graph replays
        total += costs.call_base + costs.call_row_frame * rb * size + costs.call_row * (rb - 1)
    return total


def simulate(policy: DeadlinePolicy, clients: int, spread_s: float = 1.0, requests: int = 2, frames: int = 126,
             slots: int = 128, costs: Costs = Costs()) -> dict:
    """-> first audio p50/p95/p99 (ms), the share of requests that stalled and the largest stall (ms), the admission
    wait's p95 (ms), the audio s/s over the run."""
    sched = Scheduler(max_slots=slots, max_queue=clients * requests, policy=policy)
    call_rows = vocoder.call_rows(slots, 16, 64)  # the engine's StreamingVocoder's defaults
    due = [(spread_s * w / clients, w, 0) for w in range(clients)]  # (send time, client, its k-th request)
    live, done, waits = {}, [], []  # request id -> [client, k, stall]; (first audio, stall) per finished request
    now, held, n_ids = 0.0, 0, 0
    while due or live:
        due.sort()
        while due and due[0][0] <= now:
            t, w, k = due.pop(0)
            r = EngineRequest(request_id=f"r{n_ids}", prepared=SimpleNamespace(layout=range(20), text=None),
                              stream=StreamOptions(), arrival_time=t)
            r.max_frames, n_ids, held = frames, n_ids + 1, held + 1
            live[r.request_id] = [w, k, 0.0]
            sched.add(r)
        if not sched.has_work():
            now = due[0][0]
            continue
        now += costs.gap * held
        held = 0
        out = sched.schedule(now)
        n = len(out.prefill)
        waits += [now - r.arrival_time for r in out.prefill]
        prefill = 0.0 if not n else costs.admit_fixed + (
            costs.alone * n if n <= costs.alone_max else costs.batch_base + costs.batch_req * n)
        frame = costs.frame_base + costs.frame_row * len(out.rows)
        now += prefill + frame
        sched.update_from_output(out, [0] * n, FrameResult([0] * len(out.rows), [0] * len(out.rows)))
        plan = policy.plan_chunks([r for r in out.rows if r.stream is not None], now, sched.queue_depth)
        vocoded = sum(k for _, k in plan)
        vocode = vocode_s([(r, k) for r, k in plan if k > 0], costs, call_rows)
        now += vocode
        for r, k in plan:
            meta = live[r.request_id]
            if r.first_sent_at is not None:
                meta[2] = max(meta[2], (now - r.first_sent_at) - r.audio_sent_s)
            r.sent(k, k * FRAME_S, now)
            if r.status.finished:
                r.stream_done, held = True, held + 1
                done.append((r.first_sent_at - r.arrival_time, meta[2]))
                del live[r.request_id]
                if meta[1] + 1 < requests:
                    due.append((now + costs.delta, meta[0], meta[1] + 1))
        policy.record(prefill, n, frame, vocode if vocoded else None, alone_max=costs.alone_max)
    ttfa, waits = sorted(t for t, _ in done), sorted(waits)

    def q(xs, p):
        return round(1000 * xs[min(len(xs) - 1, int(p * len(xs)))], 1)

    return {"clients": clients, "ttfa_ms": {"p50": q(ttfa, 0.5), "p95": q(ttfa, 0.95), "p99": q(ttfa, 0.99)},
            "stalled_share": round(sum(s > 1e-3 for _, s in done) / len(done), 3),
            "stall_max_ms": round(1000 * max(s for _, s in done), 1), "admission_wait_p95_ms": q(waits, 0.95),
            "audio_s_per_s": round(len(done) * frames * FRAME_S / now, 1)}


def parse_policy(text: str) -> dict:
    """"field=value,..." as bench.load.policy_serve reads it: DeadlinePolicy's knobs and alone_max (the runner's regime:
    here the cost model's, as --alone-max)."""
    from bench.load.policy_serve import parse
    return parse(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="64,128")
    ap.add_argument("--spread", type=float, default=1.0, help="s over which the clients' starts spread")
    ap.add_argument("--requests", type=int, default=2, help="per client, one after the other")
    ap.add_argument("--frames", type=int, default=126)
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--policy", type=parse_policy, default={}, help="DeadlinePolicy knobs: field=value,...")
    for f in fields(Costs):  # --frame-base-ms ... (--alone-max a count)
        unit = "" if f.name in ("alone_max", "pad_final") else "-ms"
        ap.add_argument(f"--{f.name.replace('_', '-')}{unit}", dest=f.name, type=type(f.default), default=None)
    a = ap.parse_args(argv)
    costs = Costs(**{f.name: (v if f.name in ("alone_max", "pad_final") else v / 1000)
                     for f in fields(Costs) if (v := getattr(a, f.name)) is not None})
    knobs = dict(a.policy)
    if "alone_max" in knobs:
        costs.alone_max = knobs.pop("alone_max")
    for c in (int(x) for x in a.clients.split(",")):
        res = simulate(DeadlinePolicy(**knobs), c, a.spread, a.requests, a.frames, a.slots, costs)
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
