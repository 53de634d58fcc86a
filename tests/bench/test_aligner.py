"""bench/aligner.py runs end to end on the tiny checkpoint and reports what it claims (CPU smoke run)."""

import json

from bench import aligner as bench


def test_tiny_run_reports_its_figures(tmp_path):
    out = tmp_path / "aligner.json"
    assert bench.main(["--size", "tiny", "--device", "cpu", "--utterances", "3", "--seconds", "1.5", "--repeats", "1",
                       "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["utterances"] == 3 and r["device"] == "cpu" and r["dtype"] == "float32"
    assert r["one_utterance_ms"] > 0 and r["batch_ms"] > 0
    assert abs(r["batch_ms_per_utterance"] - r["batch_ms"] / 3) < 0.01
    assert abs(r["aligner_ms_per_audio_second"] - r["batch_ms"] / 4.5) < 0.01
