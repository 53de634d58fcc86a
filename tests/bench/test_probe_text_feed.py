"""bench/probe_text_feed.py on the CPU: both feeds of a step timed, and they leave the same cells written."""

import torch

from bench import probe_text_feed
from tests.golden import fixtures as fx


def test_the_probe_times_both_feeds(capsys):
    out = probe_text_feed.main(["--ckpt", str(fx.checkpoint("cv06")), "--device", "cpu", "--rows", "4",
                                "--repeats", "2"])
    assert out["rows"] == 4 and out["device"] == "cpu"
    assert all(out[k]["done_ms"] >= out[k]["host_ms"] > 0 for k in ("per_row", "batched"))
    assert '"batched"' in capsys.readouterr().out


def test_the_probe_s_per_row_feed_writes_the_cells_of_the_batched_one():
    tts = fx.tts("cv06")
    runner = probe_text_feed.ModelRunner(tts.ckpt.talker, tts.ckpt.tts_pad_embed, max_slots=3, max_len=64,
                                         use_cuda_graphs=False, compile=False)
    feeds = [(0, 2, [11, 12]), (2, 0, [13])]
    probe_text_feed.per_row(runner, feeds)
    want = runner.slots.trailing.clone(), runner.slots.trailing_len.clone()
    runner.slots.trailing.zero_()
    runner.slots.trailing_len.zero_()
    runner.append_text(feeds)
    assert torch.equal(runner.slots.trailing != 0, want[0] != 0) and torch.equal(runner.slots.trailing_len, want[1])
