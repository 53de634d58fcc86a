"""Where the time goes (exploration, GPU): kernel profile of the captured frame and its halves, vocoder
step cost (eager vs graphed) and per convolution, batched prefill cost. Prints a JSON summary and the profiler tables.

    python -m bench.probe --ckpt /tmp/ck-0.6B-CustomVoice
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.ours import graph_of, replay_ms, sync
from q3tts import kernels
from q3tts.models.talker import embed_prompt


def kernel_profile(fn, n=10, rows=25, ordered=0):
    """ordered: also list the first `ordered` kernels of one call in launch order (name, device us)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_call = len(kernels) / n
    busy_ms = sum(e.device_time for e in kernels) / 1000 / n
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=rows), flush=True)
    out = {"kernels_per_call": per_call, "kernel_busy_ms_per_call": round(busy_ms, 3)}
    if ordered:
        first = sorted(kernels, key=lambda e: e.time_range.start)[:ordered]
        out["ordered"] = [(e.name[:90], round(e.device_time, 1)) for e in first]
        print("\n".join(f"{i:4d} {d:7.1f} us  {name}" for i, (name, d) in enumerate(out["ordered"])), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sections", default="cp,prefill,vocoder")
    ap.add_argument("--gemv", default="", help="kernels section: also time the graphs under these launches of the "
                    "one-row layer GEMVs, max_block_k:block_n:num_warps,... (q3tts.kernels.GEMV_EX_LAUNCH)")
    a = ap.parse_args()
    from q3tts import TTS
    from q3tts.engine.runner import ModelRunner
    from q3tts.models.layers import fuse_projections
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    tts = TTS.from_pretrained(a.ckpt, max_batch_size=64, max_seq_len=512)
    talker = tts.ckpt.talker
    fuse_projections(talker)
    n = 256

    def new_runner(compile):
        return ModelRunner(talker, tts.ckpt.tts_pad_embed, max_slots=64, max_len=512, compile=compile)

    def cp_times(r, tag):
        with torch.inference_mode():
            out = {}
            for B in (1, 64):
                t0 = time.perf_counter()
                g = graph_of(lambda: r._frame_codes(B, True))
                out[f"cp_graph_ms_b{B}"] = round(replay_ms(g), 3)
                out[f"compile_capture_s_b{B}"] = round(time.perf_counter() - t0, 1)
                print(f"== {tag}: code predictor, batch {B} ==", flush=True)
                out[f"profile_b{B}"] = kernel_profile(g.replay)
        print(tag, out, flush=True)
        return out

    r = new_runner(True)
    secs = a.sections.split(",")
    if "kernels" in secs:  # one stream: each half's graph, its kernels in order (a CP step ~1/15, a talker layer ~1/28)
        with torch.inference_mode():
            for tag, fn, k in (("cp", lambda: r._frame_codes(1, True), 200),
                               ("talker", lambda: r._frame_talker(1, n, True), 60),
                               ("frame", lambda: r._frame(1, n, True), 0)):
                g = graph_of(fn)
                res[f"{tag}_graph_ms_b1"] = round(replay_ms(g, 200), 3)
                print(f"== {tag}, batch 1: {res[f'{tag}_graph_ms_b1']} ms ==", flush=True)
                res[f"{tag}_profile_b1"] = kernel_profile(g.replay, n=5, rows=12, ordered=k)
            shipped = dict(kernels.GEMV_EX_LAUNCH)
            for spec in filter(None, a.gemv.split(",")):  # the same compiled code: only the GEMVs' launch differs
                kernels.GEMV_EX_LAUNCH.update(zip(("max_block_k", "block_n", "num_warps"), map(int, spec.split(":"))))
                r.slots.position.zero_()  # each talker replay advances the rows' cache position
                res[f"gemv_{spec}_ms_b1"] = {tag: round(replay_ms(graph_of(fn), 100), 3) for tag, fn in (
                    ("cp", lambda: r._frame_codes(1, True)), ("talker", lambda: r._frame_talker(1, n, True)),
                    ("frame", lambda: r._frame(1, n, True)))}
                print(f"== GEMV launch {spec}: {res[f'gemv_{spec}_ms_b1']} ==", flush=True)
            kernels.GEMV_EX_LAUNCH.update(shipped)
    if "cp" in secs:
        res["cp_shipped"] = cp_times(r, "shipped")
    with torch.inference_mode():
        for B in ((1, 64) if "cp" in secs else ()):
            g = graph_of(lambda: r._frame_talker(B, n, True))
            res[f"talker_graph_ms_b{B}"] = round(replay_ms(g), 3)
            print(f"== talker step, batch {B} ==", flush=True)
            res[f"talker_profile_b{B}"] = kernel_profile(g.replay)
            g = graph_of(lambda: r._frame(B, n, True))
            res[f"frame_graph_ms_b{B}"] = round(replay_ms(g), 3)

    with torch.inference_mode():
      if "prefill" in secs:
        # prefill: one request (eager, compiled layers), as the engine does today
        pr = tts.prepare_custom_voice("Hello! This is a speed test of Qwen3 text to speech on a random-weight "
                                      "checkpoint, and every engine decodes exactly the same number of frames.",
                                      "ryan", "English")[0]
        pre, trail = embed_prompt(talker, pr.layout, pr.speaker_embedding, pr.ref_codes)
        res["prompt_len"] = pre.shape[0]
        for N in (1, 4, 16, 1, 4, 16):  # second round timed
            sync()
            t0 = time.perf_counter()
            r.prefill_batch(0, [pre] * N, [trail] * N, [pr.params] * N)
            sync()
            res[f"prefill_batch{N}_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        t0 = time.perf_counter()
        for _ in range(16):
            embed_prompt(talker, pr.layout, pr.speaker_embedding, pr.ref_codes)
        sync()
        res["embed_prompt_ms"] = round((time.perf_counter() - t0) / 16 * 1000, 3)

      if "vocoder" in secs:
        # vocoder: one decode_step, eager and graphed
        c2w = tts.ckpt.code2wav
        voc = {}
        for B, t in ((1, 16), (16, 1), (64, 1)):
            st = c2w.init_state(B, "cuda", tts.ckpt.dtype)
            codes = torch.randint(0, 2048, (B, 16, t), device="cuda")
            for _ in range(3):
                c2w.decode_step(codes, st)
            sync()
            t0 = time.perf_counter()
            for _ in range(10):
                c2w.decode_step(codes, st)
            sync()
            eager = (time.perf_counter() - t0) / 10 * 1000
            g = graph_of(lambda: c2w.decode_step(codes, st))
            voc[f"b{B}_t{t}"] = {"eager_ms": round(eager, 3), "graph_ms": round(replay_ms(g, 20), 3)}
            if (B, t) == (64, 1):
                print("== vocoder step b64 t1 (graph) ==", flush=True)
                voc["profile_b64_t1"] = kernel_profile(g.replay, n=5, rows=15)
            del g
        res["vocoder_step"] = voc
        # each convolution of one streaming step (batch 64, t = 1), alone
        shapes = []
        hooks = [m.register_forward_hook(lambda m, i, o: shapes.append((m, i[0].shape)))
                 for m in c2w.modules() if isinstance(m, torch.nn.Conv1d)]
        c2w.decode_step(torch.randint(0, 2048, (64, 16, 1), device="cuda"), c2w.init_state(64, "cuda", tts.ckpt.dtype))
        for h in hooks:
            h.remove()
        convs = []
        for m, shp in shapes:
            x = torch.randn(shp, device="cuda", dtype=tts.ckpt.dtype)
            g = graph_of(lambda: m(x))
            convs.append((round(replay_ms(g, 10) * 1000, 1), f"{m} in {tuple(shp)}"))
        res["vocoder_convs_b64_t1_us"] = sorted(convs, reverse=True)[:12]
    print(json.dumps(res, indent=1))
    if a.out:
        open(a.out, "w").write(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
