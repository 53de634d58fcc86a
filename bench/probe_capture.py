"""The runner's frame captures in one process: a whole frame per (batch bucket, span, sampler) key, as the engine
captured it before, against the frame in two halves as it captures it now (the code predictor's half per (batch
bucket, sampler), the talker's per key); the seconds each scheme's captures take and the replay time of each
scheme's frame. CUDA only; random weights (timing only).

    python -m bench.probe_capture --ckpt /tmp/ck06 --out capture.json     # bench.ours's engine: 64 slots x 512
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.ours import frame_replay, replay_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from q3tts import TTS
    from q3tts.engine.graphs import capture, gc_paused
    tts = TTS.from_pretrained(a.ckpt, max_batch_size=a.max_batch, max_seq_len=a.max_seq_len)
    r = tts.engine.runner  # its graphs captured (the halves)
    keys = sorted(r.graph_keys(), reverse=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "slots": r.num_rows,
           "max_len": r.max_len, "keys": len(keys), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def timed_captures(fns) -> tuple[float, list[torch.cuda.CUDAGraph]]:
        """fns captured one after another into one new pool (as capture_runner shares one) -> (s, graphs)."""
        graphs, pool = [], None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for fn in fns:
            g, _ = capture(fn, pool)
            pool = g.pool()
            graphs.append(g)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, graphs

    with torch.inference_mode(), gc_paused():
        for rnd in range(2):  # alternating, twice: the first round of each may pay for allocations the second reuses
            t, whole = timed_captures([lambda k=k: r._frame(*k) for k in keys])
            res[f"whole_s_{rnd}"] = round(t, 3)
            t, halves = timed_captures([lambda k=k: r._frame_codes(*k) for k in sorted(r.code_graph_keys(),
                                                                                     reverse=True)]
                                       + [lambda k=k: r._frame_talker(*k) for k in keys])
            res[f"halves_s_{rnd}"] = round(t, 3)
            res["whole_graphs"], res["half_graphs"] = len(whole), len(halves)
            print(f"round {rnd}: {len(whole)} whole frames {res[f'whole_s_{rnd}']} s, {len(halves)} halves "
                  f"{res[f'halves_s_{rnd}']} s", flush=True)
        n = r.kv_span(64 + 125)  # bench.ours's span
        for B in (1, r.batch_buckets[-1]):
            ms = {}
            for name, g in (("whole", whole[keys.index((B, n, True))]), ("halves", frame_replay(r, B, n))):
                r.slots.position.fill_(64)  # every row at a position inside the span: each replay moves it on by one
                ms[name] = round(replay_ms(g), 4)
            res[f"replay_ms_b{B}"] = ms
            print(f"batch {B}: frame replay whole {res[f'replay_ms_b{B}']['whole']} ms, halves "
                  f"{res[f'replay_ms_b{B}']['halves']} ms", flush=True)
    out = json.dumps(res, indent=1)
    if a.out:
        open(a.out, "w").write(out)
    print(out)


if __name__ == "__main__":
    main()
