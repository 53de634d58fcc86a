"""bench/load/phase_trace.py: the phases of a streamed-text request on a CPU engine, in order, and the summary's
percentiles and gaps."""

import json

from bench.load.phase_trace import PhaseTrace, summary
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
