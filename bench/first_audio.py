"""Where the time to first audio goes (exploration, GPU): per streamed request, the engine's first step split into
admission (prompt embedding + prefill), the first frame and the first chunk's vocoder; then one prompt's embedding
and prefill timed alone.

    python -m bench.first_audio --ckpt /tmp/ck06
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.ours import TEXT
from q3tts import TTS
from q3tts.models.talker import embed_prompt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    tts = TTS.from_pretrained(a.ckpt, max_batch_size=16, max_seq_len=512)
    eng = tts.engine
    kw = dict(speaker="ryan", language="English", max_new_tokens=126, seed=0)
    rows = []
    for i in range(a.runs + 2):  # the first two warm up
        torch.cuda.synchronize()
        before = dict(eng.counters.phase_s)
        t0 = time.perf_counter()
        it = tts.generate_custom_voice_stream(TEXT, **kw)
        next(it)
        t1 = time.perf_counter()
        after = dict(eng.counters.phase_s)
        for _ in it:
            pass
        if i >= 2:
            rows.append([1000 * (t1 - t0)] + [1000 * (after[k] - before[k]) for k in ("admit", "decode", "vocode")])
    for j, name in enumerate(("first audio", "admit", "decode", "vocode")):
        print(f"{name}: p50 {statistics.median(r[j] for r in rows):.2f} ms, min {min(r[j] for r in rows):.2f}")
    pr = tts.prepare_custom_voice(TEXT, **kw)[0]
    with torch.inference_mode():
        for _ in range(3):  # the last is printed
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pre, trail = embed_prompt(tts.ckpt.talker, pr.layout, pr.speaker_embedding, pr.ref_codes)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            eng.runner.prefill_batch(0, [pre], [trail], [pr.params])
            torch.cuda.synchronize()
            t2 = time.perf_counter()
    print(f"prompt of {pre.shape[0]} tokens: embedding {1000 * (t1 - t0):.2f} ms, prefill {1000 * (t2 - t1):.2f} ms")


if __name__ == "__main__":
    main()
