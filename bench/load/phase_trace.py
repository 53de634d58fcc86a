"""Where a streaming request's first audio waits: the engine's phases per request, on the real server or the paced one.

    python -m bench.load.phase_trace trace.jsonl serve --model DIR ...   `q3tts serve` (the command line after the
                                                                          file), its engine traced
    python -m bench.load.phase_trace --summary trace.jsonl               percentiles of each phase
    python -m bench.load.phase_trace --join trace.jsonl load.json        a traced server's requests joined with the
                                                                          client's (`bench.load.load --per-request`)
    python -m bench.load.paced_server --trace trace.jsonl ...            the paced server, traced

One JSON line per streaming request at its first audio: ms from its arrival (a WebSocket utterance: its first text)
to its prompt laid out (`prompt`, streamed text only), its admission (`admit`), its first trailing text token handed to
its row (`text`: frame 0 may run), its first chunk made (`first`), and that chunk's frames; with its id (`id`) and its
arrival on the wall clock (`arrival`, s since the epoch). `--join` matches them by id with a load run's requests
(their send time and first audio byte, on the same machine's wall clock) and splits each first audio in three: from
the client's send to the request's arrival in the server's handler (`to_handler`), the engine's part until its first
chunk is made (`engine`), and from there to the client's first byte (`to_client`). The trace wraps a few of
the engine's methods (a loop over the running rows per step: a diagnostic, not for timing the engine itself).

Beside it, `<trace>.steps`: one JSON line per step that admitted newcomers, took SLOW_STEP_MS or more, or followed a
gap of SLOW_STEP_MS or more since the previous step ended (the engine's thread waiting for work or held elsewhere):
its start (s since the trace began), ms, the gap before it, newcomers, rows running after it, the engine's phases
(admit / decode / vocode ms) and its chunks (first chunks among them).
"""

from __future__ import annotations

import json
import sys
import time

PHASES = ("prompt", "admit", "text", "first")
SLOW_STEP_MS = 20.0


class PhaseTrace:
    """The engine's phases of each streaming request until its first audio, appended to `path` (the module's
    docstring); installed on an engine by wrapping its methods."""

    def __init__(self, engine, path: str):
        self.out = open(path, "a", buffering=1)
        self.at: dict[str, dict] = {}  # request id -> phase -> perf_counter
        self.wall = time.time() - time.perf_counter()  # perf_counter -> the wall clock
        set_prompt, schedule, vocode = engine._set_prompt, engine.scheduler.schedule, engine._vocode
        feed_text = engine._feed_text

        def _feed_text():
            failed = feed_text()
            now = time.perf_counter()
            for r in engine.scheduler.running.values():
                if r.prepared.text is not None and r.first_sent_at is None and (r.text_fed or r.text_done):
                    self.at.setdefault(r.request_id, {}).setdefault("text", now)
            return failed

        def _set_prompt(req, lay):
            set_prompt(req, lay)
            self.at.setdefault(req.request_id, {})["prompt"] = time.perf_counter()

        def _schedule(*a, **kw):
            out = schedule(*a, **kw)
            now = time.perf_counter()
            for r in out.prefill:
                at = self.at.setdefault(r.request_id, {})
                at["admit"] = now
                if r.prepared.text is not None and (r.text_fed or r.text_done):  # its prompt brought text beyond
                    at["text"] = now
            return out

        def _vocode(reqs):
            arrival = {r.request_id: r.arrival_time for r in reqs}
            chunks = vocode(reqs)
            now = time.perf_counter()
            for c in chunks:
                if c.frame_index == 0 and c.num_frames and c.request_id in arrival:
                    at, t0 = self.at.pop(c.request_id, {}), arrival[c.request_id]
                    ms = {k: round((v - t0) * 1000, 1) for k, v in at.items()}
                    self.out.write(json.dumps({**ms, "first": round((now - t0) * 1000, 1), "frames": c.num_frames,
                                               "id": c.request_id, "arrival": round(t0 + self.wall, 6)}) + "\n")
            return chunks

        engine._set_prompt, engine.scheduler.schedule, engine._vocode = _set_prompt, _schedule, _vocode
        engine._feed_text = _feed_text
        self._trace_steps(engine, path + ".steps")

    def _trace_steps(self, engine, path: str) -> None:
        out, step, c = open(path, "a", buffering=1), engine._step, engine.counters
        t_begin, last_end = time.perf_counter(), [None]

        def _step():
            t0 = time.perf_counter()
            phases, admitted = dict(c.phase_s), c.admitted
            chunks = step()
            t1 = time.perf_counter()
            gap = (t0 - last_end[0]) * 1000 if last_end[0] is not None else 0.0
            last_end[0] = t1
            new, ms = c.admitted - admitted, (t1 - t0) * 1000
            if new or ms >= SLOW_STEP_MS or gap >= SLOW_STEP_MS:
                out.write(json.dumps({
                    "t": round(t0 - t_begin, 4), "ms": round(ms, 2), "gap": round(gap, 2), "new": new,
                    "rows": engine.scheduler.num_running,
                    **{k: round((v - phases[k]) * 1000, 2) for k, v in c.phase_s.items()},
                    "chunks": sum(ch.num_frames > 0 for ch in chunks),
                    "firsts": sum(ch.frame_index == 0 and ch.num_frames > 0 for ch in chunks)}) + "\n")
            return chunks

        engine._step = _step


def summary(path: str) -> dict:
    """Per phase and per gap between a request's consecutive phases: n, p50 / p95 / max ms over the trace's requests;
    and the first chunks' sizes."""
    rows = [json.loads(line) for line in open(path)]
    out = {k: _pct([r[k] for r in rows if k in r]) for k in PHASES}
    gaps: dict[str, list[float]] = {}  # between each request's consecutive phases
    for r in rows:
        present = [k for k in PHASES if k in r]
        for a, b in zip(present, present[1:]):
            gaps.setdefault(f"{a}->{b}", []).append(round(r[b] - r[a], 1))
    out.update({k: _pct(v) for k, v in gaps.items()})
    frames = [r["frames"] for r in rows]
    out["first_frames"] = {f: frames.count(f) for f in sorted(set(frames))}
    return out


def join(trace_path: str, load_path: str) -> dict:
    """Per level of a load run (`bench.load.load --per-request`) against the traced server: its requests found in the
    trace, and p50 / p95 / max ms of each part of their first audio (the module's docstring)."""
    traced = {}
    for line in open(trace_path):
        r = json.loads(line)
        if "id" in r:
            traced[r["id"]] = r
    out = {}
    for lv in json.load(open(load_path))["levels"]:
        name = f"C={lv['concurrency']}" if lv["mode"] == "closed" else f"{lv['rate']} req/s"
        parts: dict[str, list[float]] = {"to_handler": [], "engine": [], "to_client": []}
        for q in lv.get("per_request") or []:
            t = traced.get(q.get("request_id"))
            if t is None or q.get("ttfa_s") is None:
                continue
            made = t["arrival"] + t["first"] / 1000  # the first chunk made, wall clock
            parts["to_handler"].append(round(1000 * (t["arrival"] - q["sent"]), 1))
            parts["engine"].append(t["first"])
            parts["to_client"].append(round(1000 * (q["sent"] + q["ttfa_s"] - made), 1))
        out[name] = {"requests": len(lv.get("per_request") or []), **{k: _pct(v) for k, v in parts.items()}}
    return out


def _pct(v: list[float]) -> dict:
    v = sorted(v)
    return {"n": len(v), **({"p50": v[len(v) // 2], "p95": v[min(len(v) - 1, int(0.95 * len(v)))], "max": v[-1]}
                            if v else {})}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--join"] and len(argv) == 3:
        for level, parts in join(argv[1], argv[2]).items():
            print(f"{level:>14}: {parts}")
        return 0
    if argv[:1] == ["--summary"] and len(argv) == 2:
        for k, v in summary(argv[1]).items():
            print(f"{k:>14}: {v}")
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    from q3tts.cli import main as q3tts_main
    from q3tts.engine.engine import Engine

    path, init = argv[0], Engine.__init__

    def traced(self, *a, **kw):
        init(self, *a, **kw)
        PhaseTrace(self, path)

    Engine.__init__ = traced
    return q3tts_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
