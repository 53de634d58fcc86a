"""One engine step's streamed-text feed: every row's new tokens in one call (ModelRunner.append_text) against one call
per row (the engine's feed before it: embed_text per row, a blocking copy of its rows, its own writes). Per step: the
host time the engine's thread spends in the feed (what delays the step) and the time until the device has it all.

    python -m bench.probe_text_feed --ckpt /tmp/ckpt06 --rows 64 --tokens 2     (CUDA; --device cpu: a smoke run)

Both variants write the same cells (tests/engine/test_runner.py). The engine steps with a busy asyncio thread beside
it: each GIL hand-off of a per-row call may wait for it, which this probe (one thread) does not show.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from q3tts.engine.runner import ModelRunner
from q3tts.models.loaders import load_checkpoint


def per_row(runner: ModelRunner, feeds) -> None:
    """The feed as the engine did it before the batched call: per row one embed_text and its writes."""
    with torch.inference_mode():
        for slot, start, ids in feeds:
            text = runner.talker.embed_text(torch.tensor(ids))
            runner.slots.trailing[slot, start:start + len(ids)] = text.to(runner.dtype)
            runner.slots.trailing_len[slot] = start + len(ids)


def timed(fn, feeds, repeats: int, sync) -> dict:
    host, done = [], []
    for i in range(repeats + 3):
        sync()
        t0 = time.perf_counter()
        fn(feeds)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        if i >= 3:  # warm-up calls left out
            host.append(t1 - t0)
            done.append(t2 - t0)
    med = lambda v: round(sorted(v)[len(v) // 2] * 1000, 3)  # noqa: E731
    return {"host_ms": med(host), "done_ms": med(done)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=64, help="rows fed in one step")
    ap.add_argument("--tokens", type=int, default=2, help="new text tokens per row")
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args(argv)
    ckpt = load_checkpoint(a.ckpt, device=a.device)
    runner = ModelRunner(ckpt.talker, ckpt.tts_pad_embed, max_slots=a.rows, max_len=256, use_cuda_graphs=False,
                         compile=False)
    feeds = [(r, 8, [1000 + 7 * r + j for j in range(a.tokens)]) for r in range(a.rows)]
    sync = torch.cuda.synchronize if ckpt.device.type == "cuda" else (lambda: None)
    out = {"rows": a.rows, "tokens": a.tokens, "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "per_row": timed(lambda f: per_row(runner, f), feeds, a.repeats, sync),
           "batched": timed(runner.append_text, feeds, a.repeats, sync)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
