"""bench/load/phase_trace.py: the phases of a streamed-text request on a CPU engine, in order, the summary's
percentiles and gaps, and a load run's requests joined with the traced server's by id."""

import json

from bench.load.phase_trace import PhaseTrace, join, summary
from q3tts.engine.engine import Engine
from q3tts.engine.request import StreamOptions
from tests.golden import fixtures as fx


def test_a_streamed_text_request_s_phases_come_in_order(tmp_path):
    tts = fx.tts("cv06")
    eng = Engine(tts.ckpt, max_slots=2, max_seq_len=256)
    path = tmp_path / "trace.jsonl"
    PhaseTrace(eng, str(path))
    p = tts.prepare_custom_voice(text=None, speaker="vivian", language="English", non_streaming_mode=False,
                                 max_new_tokens=6)[0]
    req = eng.add_request(p, StreamOptions(1, 4))
    for piece in ["Hello", " there,", " a streamed", " text", "."]:
        p.text.append(piece)
        eng.step()
    p.text.close()
    while not req.status.finished:
        eng.step()
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert 0 <= line["prompt"] <= line["admit"] <= line["text"] <= line["first"] and line["frames"] == 1
    # the steps beside it: the admitting step is there, with its newcomer, its row and its phases
    steps = [json.loads(x) for x in (tmp_path / "trace.jsonl.steps").read_text().splitlines()]
    admitting = [s for s in steps if s["new"]]
    assert len(admitting) == 1 and admitting[0]["new"] == 1 and admitting[0]["rows"] == 1
    assert all(s["admit"] + s["decode"] + s["vocode"] <= s["ms"] + 0.05 for s in steps)  # rounding of each to 0.01


def test_summary_gives_each_phase_and_gap(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"prompt": 10.0 * i, "admit": 10.0 * i + 1, "first": 10.0 * i + 5, "frames": 1 + i % 2} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summary(str(path))
    assert s["prompt"] == {"n": 20, "p50": 100.0, "p95": 190.0, "max": 190.0}
    assert s["admit->first"] == {"n": 20, "p50": 4.0, "p95": 4.0, "max": 4.0} and s["text"] == {"n": 0}
    assert s["first_frames"] == {1: 10, 2: 10}


def test_join_finds_every_request_of_a_load_run_and_splits_its_first_audio(tmp_path):
    """The paced server traced, a closed-loop run with --per-request: each request is found in the trace by the id the
    server answers with (X-Request-Id), and its first audio splits into the client's way to the handler, the engine's
    part and the way back, each within the first audio the client measured."""
    import pytest
    pytest.importorskip("aiohttp")
    from bench.load import load
    from bench.load.paced_server import paced_app
    from tests.server.live import serve

    trace, out = tmp_path / "trace.jsonl", tmp_path / "load.json"
    live = serve(paced_app(slots=4, decode_ms=1.0, vocode_ms=1.0, prefill_ms=1.0, trace=str(trace)), "uvicorn-traced")
    try:
        assert load.main(["--url", live.base_url, "--concurrency", "3", "--requests", "2", "--max-new-tokens", "6",
                          "--per-request", "--no-warmup", "--out", str(out)]) == 0
    finally:
        live.stop()
    (level,) = json.loads(out.read_text())["levels"]
    ids = [r["request_id"] for r in level["per_request"]]
    assert len(set(ids)) == 6 and all(ids)
    parts = join(str(trace), str(out))["C=3"]
    assert parts["requests"] == 6 and {parts[k]["n"] for k in ("to_handler", "engine", "to_client")} == {6}
    longest = level["ttfa_ms"]["max"]
    # the wall clock's reading of perf_counter may be off by a fraction of a millisecond: -1 ms
    assert -1 <= parts["to_handler"]["p50"] <= parts["to_handler"]["max"] < longest
    assert 0 < parts["engine"]["p50"] <= parts["engine"]["max"] < longest
    assert -1 <= parts["to_client"]["p50"] <= parts["to_client"]["max"] < longest
