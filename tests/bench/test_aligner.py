"""bench/aligner.py runs end to end on the tiny checkpoint and reports what it claims (CPU smoke run)."""

import json

import pytest

from bench import aligner as bench


def test_tiny_run_reports_its_figures(tmp_path):
    out = tmp_path / "aligner.json"
    assert bench.main(["--size", "tiny", "--device", "cpu", "--utterances", "3", "--seconds", "1.5", "--repeats", "1",
                       "--variants", "eager", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["utterances"] == 3 and r["device"] == "cpu" and r["dtype"] == "float32" and "compiled" not in r
    e = r["eager"]
    assert e["one_utterance_ms"] > 0 and e["batch_ms"] > 0 and e["batch_pass_ms"] > 0 and e["batch_prep_ms"] > 0
    assert abs(e["batch_ms_per_utterance"] - e["batch_ms"] / 3) < 0.01
    assert abs(e["aligner_ms_per_audio_second"] - e["batch_ms"] / 4.5) < 0.01


def test_graphs_variant_runs_beside_eager_with_its_words(tmp_path):
    """The padded variant (graphs): its figures, and the batch's words compared with eager's (equal on CPU, fp32)."""
    out = tmp_path / "aligner.json"
    assert bench.main(["--size", "tiny", "--device", "cpu", "--utterances", "3", "--seconds", "1.5", "--repeats", "1",
                       "--variants", "eager,graphs", "--out", str(out)]) == 0
    g = json.loads(out.read_text())["graphs"]
    assert g["batch_ms"] > 0 and g["batch_pass_ms"] > 0 and g["ready_s"] >= g["load_s"]
    assert g["graphs_captured"] == 0 and g["resampled_on_device"] is False  # CPU: uncaptured, soxr on the CPU
    assert g["words_vs_eager"] == {"rows_equal": 3, "rows": 3, "max_time_diff_ms": 0.0}


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--size", "tiny", "--device", "cpu", "--variants", "eager,cuda_graphs"])
