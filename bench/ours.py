"""Benchmark q3tts on a checkpoint (random weights at real dimensions; EOS impossible, so every run
decodes exactly the frames asked for). One JSON on stdout / --out.

    python -m bench.ours --ckpt /tmp/ck06 --frames 125 --repeats 3
    Q3TTS_BATCH_INVARIANT=1 python -m bench.ours --ckpt /tmp/ck06 --frames 125 --repeats 3 --batch 16,64  # the
        batch-invariant mode's cost: run it beside the same command without the variable, on one machine

Measures, all with CUDA synchronisation around host clocks and a warm-up first:
- single stream, non-streaming API end to end (prompt + prefill + frames + vocoder): real-time factor
- per-frame time of the captured whole-frame graph, and of its two halves (code predictor / talker step)
- vocoder time for the whole utterance (upstream-equal offline decode)
- streaming: time to first audio (first_chunk_frames=1) p50/p95, streaming real-time factor
- batch B (e.g. 16) requests decoded together: aggregate audio seconds per second
- peak GPU memory
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

import torch

from bench.peers import DEFAULT_TEXT as TEXT  # the very text the peers speak


def sync():
    torch.cuda.synchronize()


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def graph_of(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def frame_replay(runner, B: int, n: int, capped: bool = True) -> types.SimpleNamespace:
    """The engine's captured frame (its two halves, as decode_frame replays them) as one object with replay()."""
    graphs = runner.frame_graphs(B, n, capped)
    return types.SimpleNamespace(replay=lambda: [g.replay() for g in graphs])


def replay_ms(g, n=50):
    for _ in range(5):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    sync()
    return start.elapsed_time(end) / n


def set_inductor(spec: str) -> dict:
    """'a.b=True,c=3' -> torch._inductor.config.a.b = True, .c = 3 (values parsed as Python literals)."""
    import ast

    import torch._inductor.config as cfg
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        v = ast.literal_eval(value)
        if name not in cfg.get_config_copy():
            raise SystemExit(f"unknown Inductor setting {name!r} in torch {torch.__version__}")
        *parents, leaf = name.split(".")
        obj = cfg
        for part in parents:
            obj = getattr(obj, part)
        setattr(obj, leaf, v)
        out[name] = v
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--frames", type=int, default=125)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", default="16", help="batch sizes, comma-separated (e.g. 16,64)")
    ap.add_argument("--ttfa-runs", type=int, default=20)
    ap.add_argument("--speaker", default="ryan")
    ap.add_argument("--quantization", default=None, help="int8 / fp8 (weight-only; default none: bf16)")
    ap.add_argument("--inductor", default="", help="Inductor settings to try before anything compiles, comma-separated "
                    "name=value (e.g. triton.enable_pdl=True,combo_kernels=True): an A/B of the compiler's options")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from q3tts import TTS
    inductor = set_inductor(a.inductor)
    N = a.frames
    res = {"engine": "q3tts", "compile": os.environ.get("Q3TTS_COMPILE", "default(on)"), "frames": N, "audio_s": N * 0.08, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    res["quantization"] = a.quantization or "none"
    from q3tts import invariant
    res["batch_invariant"] = invariant.enabled()  # Q3TTS_BATCH_INVARIANT=1: the mode's cost (README)
    if inductor:
        res["inductor"] = inductor
    batches = [int(b) for b in str(a.batch).split(",")]
    t_load, tts = timed(lambda: TTS.from_pretrained(a.ckpt, max_batch_size=max(batches), max_seq_len=512,
                                                        quantization=a.quantization))
    res["load_s"] = round(t_load, 2)
    t_cap, _ = timed(lambda: tts.engine)
    res["graph_capture_s"] = round(t_cap, 2)
    res["num_graphs"] = tts.engine.runner.num_frame_graphs
    kw = dict(speaker=a.speaker, language="English", max_new_tokens=N + 1, seed=0)

    # single stream, end to end through the public API
    tts.generate_custom_voice(TEXT, **kw)  # warm-up
    runs = []
    for i in range(a.repeats):
        t, (wavs, sr) = timed(lambda: tts.generate_custom_voice(TEXT, **kw))
        assert len(wavs[0]) == N * 1920, len(wavs[0])
        runs.append(t)
    t = statistics.median(runs)
    res["single"] = dict(wall_s=round(t, 4), rtf=round(N * 0.08 / t, 2), ms_per_frame_e2e=round(1000 * t / N, 3))

    # vocoder alone on the same codes (upstream-equal offline decode)
    pr = tts.prepare_custom_voice(TEXT, **kw)
    codes = tts.generate_codes(pr)
    tv = statistics.median(timed(lambda: tts.decode(codes))[0] for _ in range(3))
    res["single"]["vocoder_s"] = round(tv, 4)

    # the captured frame and its halves, batch 1 (a request parked in row 0 at a realistic position)
    r = tts.engine.runner
    n = r.kv_span(64 + N)
    # default sampling (top_k 50) uses the capped-sampler graphs: the engine's own, each half alone, then both
    codes_graph, talker_graph = r.frame_graphs(1, n, True)
    res["frame_ms"] = {"whole_frame_graph": round(replay_ms(frame_replay(r, 1, n)), 3),
                       "code_predictor_graph": round(replay_ms(codes_graph), 3),
                       "talker_step_graph": round(replay_ms(talker_graph), 3)}
    r.slots.position.zero_()
    r.slots.position_cpu = [0] * r.num_rows

    # streaming: time to first audio and streaming RTF
    ttfa = []
    for i in range(a.ttfa_runs + 1):
        sync()
        t0 = time.perf_counter()
        it = tts.generate_custom_voice_stream(TEXT, **kw)  # default schedule: 1, 2, 4, 8, 16, 16, ... frames
        first = next(it)  # its audio is on the host: the engine made it and copied it before handing it over
        # (no device sync here: the engine's thread has gone on to launch the next frame, which a sync would wait for)
        t_first = time.perf_counter() - t0
        total = len(first.audio) + sum(len(c.audio) for c in it)
        sync()
        t_all = time.perf_counter() - t0
        if i > 0:
            ttfa.append(t_first)
            assert total == N * 1920
            res.setdefault("_stream_walls", []).append(t_all)
    walls = res.pop("_stream_walls")
    q = statistics.quantiles(ttfa, n=20)
    res["streaming"] = dict(first_chunk_frames=1, chunk_frames=16, ttfa_ms_p50=round(1000 * statistics.median(ttfa), 2),
                            ttfa_ms_p95=round(1000 * q[18], 2), rtf=round(N * 0.08 / statistics.median(walls), 2))
    res["streaming"]["rtf_vs_non_streaming"] = round(res["streaming"]["rtf"] / res["single"]["rtf"], 3)

    # batch: B requests together
    for B in batches:
        if B <= 1:
            continue
        texts = [TEXT] * B
        tts.generate_custom_voice(texts, **kw)
        t = statistics.median(timed(lambda: tts.generate_custom_voice(texts, **kw))[0] for _ in range(a.repeats))
        res[f"batch{B}"] = dict(batch=B, wall_s=round(t, 3), aggregate_audio_s_per_s=round(B * N * 0.08 / t, 1),
                                per_stream_rtf=round(N * 0.08 / t, 2))
        with torch.inference_mode():
            Bp = next(b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b >= B)
            res["frame_ms"][f"whole_frame_graph_b{Bp}"] = round(replay_ms(frame_replay(r, Bp, n)), 3)
        r.slots.position.zero_()
    res["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out = json.dumps(res, indent=1)
    if a.out:
        open(a.out, "w").write(out)
    print(out)
    print(f"q3tts: single rtf {res['single']['rtf']} ({res['frame_ms']['whole_frame_graph']} ms/frame graph), "
          f"ttfa p50 {res['streaming']['ttfa_ms_p50']} ms, streaming rtf {res['streaming']['rtf']}, " + ", ".join(
              f"batch {b}: {res[f'batch{b}']['aggregate_audio_s_per_s']} audio s/s" for b in batches if b > 1),
          file=sys.stderr)


if __name__ == "__main__":
    main()
