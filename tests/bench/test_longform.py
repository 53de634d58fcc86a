"""bench/longform.py's smoke mode runs on CPU: the parallel and sequential runs make the expected audio."""

import json

from bench import longform


def test_tiny_smoke_run(tmp_path):
    out = tmp_path / "longform.json"
    assert longform.main(["--tiny", "--minutes", "0.2", "--words", "10", "--pause-ms", "40", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["segments"] >= 2 and r["device"] == "cpu"
    for key in ("parallel", "sequential"):
        assert r[key]["segments"] == r["segments"] and r[key]["audio_s"] == r["expected_audio_s"]
        assert r[key]["wall_s"] > 0 and r[key]["first_audio_s"] is not None
    assert r["speedup"] > 0
