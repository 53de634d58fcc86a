"""bench/aligner_precision.py runs on the tiny checkpoint and reports what it claims (CPU smoke run)."""

import json

from bench import aligner_precision as bench


def test_tiny_run_compares_the_passes(tmp_path):
    out = tmp_path / "precision.json"
    assert bench.main(["--size", "tiny", "--rows", "2", "--seconds", "1.5", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    for on_device in (True, False):
        v = r["float32"][f"padded_resample_on_device_{on_device}"]
        # fp32: the padded pass is the eager one (features equal with soxr, within the resampler's error without)
        assert v["vs_eager"]["rows_equal"] == 2 and v["vs_eager"]["slots_differ"] == 0 and v["flips"] == []
        assert v["vs_eager"]["logits_max_abs_diff"] < 1e-4 and v["slots"] == 2 * 2 * r["words_per_row"]
        assert (v["vs_eager"]["mel_max_abs_diff"] == 0) == (not on_device)
        b = r["bfloat16"][f"padded_resample_on_device_{on_device}"]
        bf16_error = r["bfloat16"]["eager_vs_fp32_eager"]["logits_max_abs_diff"]
        assert b["vs_fp32_eager"]["rows"] == 2 and b["vs_eager"]["logits_max_abs_diff"] <= 2 * bf16_error
        for f in b["flips"]:  # a class changes only past its top-2 gap
            assert f["gap"] <= f["move"] <= 2 * f["logits_diff"]
    assert bf16_error > 0
