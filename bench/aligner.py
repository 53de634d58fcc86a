"""The forced aligner's cost: one utterance at a time, and 64 utterances at once (as 64 finishing streams would ask).

    python3 -m bench.make_checkpoint --model 0.6B-CustomVoice --out /tmp/ck06 && \
    python3 -m bench.aligner --utterances 64 --seconds 5 --repeats 3 --tts /tmp/ck06 --out /tmp/aligner.json
                                                       # GPU: eager vs compiled, share of synthesis, streams beside it
    python3 -m bench.aligner --size tiny --utterances 4 --seconds 2 --repeats 1 --tts DIR --streams 2   # CPU dry run

A random-weight checkpoint in the official layout (q3tts/randomckpt.py) at the real dimensions of
Qwen/Qwen3-ForcedAligner-0.6B (as third-party ports state them: its config.json is not in our reference set; weight
values do not change speed), or the tiny one of the golden fixtures. The utterances are synthetic audio (tones and
noise at 24 kHz, as the engine outputs) with a transcript of 3 words a second. Per variant (--variants: eager;
compiled = ForcedAligner(compile=True); graphs = ForcedAligner(graphs=True): padded buckets, one CUDA graph per
bucket captured on first use, 24 -> 16 kHz on the device), the median wall time over --repeats runs after a warm-up
of: one utterance and the batch of --utterances (each row alone, as the server's AlignerWorker runs them) through
align() (with the CPU preparation: checks, and soxr resampling where the variant resamples on the CPU) and through
the pass alone (checked items; eager's resampled before it); load_s includes the compiled variant's compilations,
ready_s the first calls too (graph captures: capture_s), words_vs_eager compares the batch's words with eager's. With --tts DIR (a TTS checkpoint, e.g. from
bench/make_checkpoint.py), the same call times synthesizing the batch (the aligner's share of it, whole and pass
only), the batch submitted at once to an AlignerWorker of 16 and of 64 rows a pass (the server's path: its share),
then --rounds rounds of --streams synthesis streams at once: alone; beside an AlignerWorker kept busy with the batch
(the last variant) as the server runs it (its passes waiting while the engine admits and makes first audio); beside
one that does not wait; and beside that one with the engine's steps on the default stream instead of their
higher-priority one: first audio and the stall of a player that starts at each stream's first chunk, per round and
their medians. With --stagger-ms, rounds of streams starting that far apart, alone and each with its own audio aligned
by the served worker as it ends (the server's word_timestamps: later streams start beside earlier ones' passes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from q3tts.align import ForcedAligner
from q3tts.randomckpt import write_aligner_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "q3tts" / "reference" / "tokenizer"
WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars watch quietly from far above "
         "and every listener hears each word clearly").split()


def real_config() -> dict:
    """Qwen3-ForcedAligner-0.6B's dimensions as third-party ports give them (unverified against its config.json)."""
    audio = dict(num_mel_bins=128, encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096, d_model=1024,
                 max_source_positions=1500, n_window=50, n_window_infer=800, conv_chunksize=500,
                 downsample_hidden_size=480, output_dim=1024, activation_function="gelu")
    text = dict(vocab_size=152064, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_act="silu", rms_norm_eps=1e-6,
                rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
                rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "interleaved": True})
    return dict(model_type="qwen3_asr", timestamp_token_id=151705, timestamp_segment_time=80,
                thinker_config=dict(audio_config=audio, text_config=text, audio_token_id=151676,
                                    audio_start_token_id=151669, classify_num=5000))


def tiny_config() -> dict:
    fx = json.loads((ROOT / "tests" / "golden" / "fixtures" / "aligner" / "aligner.json").read_text())
    return fx["config"]


def make_checkpoint(size: str, out: Path, dtype: torch.dtype) -> Path:
    from q3tts.models.aligner import Thinker, parse_aligner_config
    cfg = real_config() if size == "real" else tiny_config()
    with torch.device("meta"):  # names and shapes from our module (the golden test loads the official layout)
        thinker = Thinker(parse_aligner_config(cfg))
    shapes = {f"thinker.{k}": (list(v.shape), "float32") for k, v in thinker.state_dict().items()}
    write_aligner_checkpoint(out, cfg, shapes, TOKENIZER, {"feature_extractor_type": "WhisperFeatureExtractor"},
                             seed=0, dtype=dtype)
    return out


def utterance(seconds: float, sr: int, seed: int) -> tuple[np.ndarray, str]:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    wav = sum(0.1 * np.sin(2 * np.pi * f * t) for f in rng.uniform(100, 3000, 4)) + 0.02 * rng.standard_normal(t.size)
    words = [WORDS[(seed + i) % len(WORDS)] for i in range(max(1, int(3 * seconds)))]
    return wav.astype(np.float32), " ".join(words).capitalize() + "."


def timed(fn, repeats: int, device: torch.device) -> tuple[float, float]:
    """(median seconds of fn() over repeats, seconds of the warm-up call before them)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


def measure_aligner(aligner: ForcedAligner, wavs: list, texts: list[str], sr: int, repeats: int,
                    device: torch.device) -> tuple[dict, list]:
    """One utterance alone and the whole batch (each row alone, as the AlignerWorker runs them), each through
    align() (CPU preparation included: checks, and soxr resampling where the variant does it on the CPU) and through
    the pass alone (checked items: eager's are resampled before, graphs resamples on the device inside its pass).
    -> (the figures, the batch's words)."""
    one, first = timed(lambda: aligner.align(wavs[0], sr, texts[0], "English"), repeats, device)
    batch, batch_first = timed(lambda: aligner.align(wavs, sr, texts, "English", rows_alone=True), repeats, device)
    padded = aligner._padded is not None
    t0 = time.perf_counter()
    items = [aligner._item(w, sr, t, "English", i, ready=not padded) for i, (w, t) in enumerate(zip(wavs, texts))]
    prep = time.perf_counter() - t0
    one_pass, _ = timed(lambda: aligner._run(items[:1]), repeats, device)
    batch_pass, _ = timed(lambda: aligner._run(items, rows_alone=True), repeats, device)
    words = aligner.align(wavs, sr, texts, "English", rows_alone=True)
    ms = lambda x: round(x * 1000, 2)  # noqa: E731
    r = dict(first_call_s=round(first, 2), batch_first_call_s=round(batch_first, 2), one_utterance_ms=ms(one),
             one_utterance_pass_ms=ms(one_pass), batch_ms=ms(batch), batch_prep_ms=ms(prep),
             batch_pass_ms=ms(batch_pass), batch_ms_per_utterance=round(batch * 1000 / len(wavs), 3))
    if device.type == "cuda":  # the waveforms already on the device, as generate_*(word_timestamps=True) hands them
        dev = [torch.from_numpy(w).to(device) for w in wavs]
        r["batch_on_device_ms"] = ms(timed(lambda: aligner.align(dev, sr, texts, "English", rows_alone=True),
                                           repeats, device)[0])
    if padded:
        r.update(graphs_captured=len(aligner._padded.graphs), capture_s=round(aligner._padded.capture_s, 2),
                 resampled_on_device=any(f is not None for f in aligner._padded.resamplers.values()))
    return r, words


def worker_batches(aligner: ForcedAligner, wavs: list, texts: list[str], sr: int, repeats: int,
                   max_batch: int) -> dict:
    """The whole batch given to an AlignerWorker of max_batch rows a pass (as the server's streams ask, each checked
    and staged at submit): the median time the submissions take on the caller's thread, and from the worker's
    release (every utterance queued, held until then) until every utterance has its words: its passes alone."""
    from q3tts.align import AlignerWorker
    go = threading.Event()
    worker = AlignerWorker(aligner, max_batch=max_batch, busy=lambda: not go.is_set(), max_defer_s=3600.0)
    try:
        def run() -> tuple[float, float]:
            go.clear()
            t0 = time.perf_counter()
            futs = [worker.submit(w, sr, t, "English") for w, t in zip(wavs, texts)]
            t1 = time.perf_counter()
            go.set()
            for f in futs:
                f.result()
            return t1 - t0, time.perf_counter() - t1
        run()  # the buckets' graphs of this batching captured
        times = [run() for _ in range(repeats)]
    finally:
        go.set()
        worker.close()
    return dict(max_batch=max_batch, submit_ms=round(statistics.median(t for t, _ in times) * 1000, 2),
                ms=round(statistics.median(t for _, t in times) * 1000, 2))


def same_words(a: list[list], b: list[list]) -> dict:
    """Rows whose words and times are equal, and the largest time difference (ms) where they differ."""
    diff = [max((abs(x.start_s - y.start_s) + abs(x.end_s - y.end_s) for x, y in zip(ra, rb)), default=0.0)
            if len(ra) == len(rb) else float("inf") for ra, rb in zip(a, b)]
    return dict(rows_equal=sum(ra == rb for ra, rb in zip(a, b)), rows=len(a),
                max_time_diff_ms=round(max(diff, default=0.0) * 1000, 1))


def streams_beside(tts, worker, texts: list[str], wavs: list, sr: int, num_streams: int, frames: int,
                   own=None, stagger_s: float = 0.0) -> dict:
    """num_streams synthesis streams (a player per stream starting at its first chunk), the i-th starting i x
    stagger_s in, with the aligner worker kept busy aligning wavs meanwhile (worker given) or idle: first audio and
    the players' stall. own (an AlignerWorker): each stream's own audio is aligned once it ends, as the server does
    for a request with word_timestamps (the stream ends when its words come)."""
    from concurrent.futures import ThreadPoolExecutor
    speaker = (tts.get_supported_speakers() or [None])[0]
    done = threading.Event()

    from bench.load.load import SR, Player

    def one(i: int) -> tuple[float, float]:
        time.sleep(i * stagger_s)
        t0 = time.perf_counter()
        first, player, pcm = None, Player(), []  # the load client's listener: plays from the first chunk, pauses when dry
        text = texts[i % len(texts)]
        for c in tts.generate_custom_voice_stream(text, speaker=speaker, language="English",
                                                  do_sample=False, subtalker_dosample=False, max_new_tokens=frames,
                                                  first_chunk_frames=1, chunk_frames=8):
            assert c.sample_rate == SR, c.sample_rate
            now = time.perf_counter()
            first = now - t0 if first is None else first
            player.feed(now, 2 * c.audio.shape[-1])  # (bytes of s16 PCM)
            pcm.append(c.audio)
        if own is not None:
            own.submit(np.concatenate(pcm), SR, text, "English").result()
            aligned[0] += 1
        return first, player.stall_s

    aligned = [0]

    def keep_aligning():
        while not done.is_set():
            futs = [worker.submit(w, sr, t, "English") for w, t in zip(wavs, texts)]
            for f in futs:
                f.result()
                aligned[0] += 1

    bg = threading.Thread(target=keep_aligning, daemon=True) if worker is not None else None
    if bg:
        bg.start()
        time.sleep(0.05)  # the aligner is running when the streams start
    with ThreadPoolExecutor(num_streams) as ex:
        res = list(ex.map(one, range(num_streams)))
    done.set()
    if bg:
        bg.join()
    firsts = sorted(f for f, _ in res)
    return dict(streams=num_streams, stagger_ms=round(stagger_s * 1000, 1),
                first_audio_p50_ms=round(firsts[len(firsts) // 2] * 1000, 1),
                first_audio_max_ms=round(firsts[-1] * 1000, 1),
                stall_max_ms=round(max(s for _, s in res) * 1000, 1),
                stall_total_ms=round(sum(s for _, s in res) * 1000, 1), utterances_aligned_meanwhile=aligned[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=("real", "tiny"), default="real")
    ap.add_argument("--checkpoint", default=None, help="an aligner directory (default: a random one of --size)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--utterances", type=int, default=64, help="the batch: utterances aligned at once")
    ap.add_argument("--seconds", type=float, default=5.0, help="audio per utterance")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default="eager,graphs",
                    help="aligner variants to time, comma-separated: eager, compiled (ForcedAligner compile=True), "
                         "graphs (ForcedAligner graphs=True: padded buckets, one CUDA graph per bucket, resampling "
                         "on the device)")
    ap.add_argument("--tts", default=None, help="also time synthesizing the batch with this TTS checkpoint")
    ap.add_argument("--synth-repeats", type=int, default=5,
                    help="with --tts: synthesis runs of the batch timed (their median is the shares' denominator)")
    ap.add_argument("--streams", type=int, default=16,
                    help="with --tts: synthesis streams timed alone and beside a busy aligner worker (0: skip)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="with --streams: rounds of streams alone, beside the aligner, and beside it without the "
                         "engine's stream priority")
    ap.add_argument("--compare-batch", type=int, default=0,
                    help="with --streams: also rounds beside a served worker of this many rows a pass (the served "
                         "worker has q3tts.align.WORKER_MAX_BATCH)")
    ap.add_argument("--stagger-ms", type=float, default=0.0,
                    help="with --streams: also rounds of streams starting this far apart, alone and each with its "
                         "own audio aligned as it ends by a served worker (the server's word_timestamps), "
                         "interleaved")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    a = ap.parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not variants or set(variants) - {"eager", "compiled", "graphs"}:
        ap.error(f"--variants: accepted eager, compiled, graphs; got {a.variants!r}")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ckpt = Path(a.checkpoint) if a.checkpoint else make_checkpoint(
        a.size, Path(tempfile.mkdtemp(prefix="q3tts-aligner-bench-")), dtype)
    sr = 24000
    items = [utterance(a.seconds, sr, i) for i in range(a.utterances)]
    wavs, texts = [w for w, _ in items], [t for _, t in items]
    audio_s = a.seconds * a.utterances
    result = dict(bench="aligner", size=a.size if not a.checkpoint else str(ckpt), device=str(device),
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  dtype=str(dtype).removeprefix("torch."), seconds_per_utterance=a.seconds,
                  words_per_utterance=len(texts[0].split()), utterances=a.utterances, repeats=a.repeats)
    aligners, words = {}, {}
    for v in variants:
        t0 = time.perf_counter()
        try:
            aligners[v] = ForcedAligner.from_pretrained(ckpt, device=device, dtype=dtype, compile=v == "compiled",
                                                        graphs=v == "graphs")
            load = time.perf_counter() - t0  # compiled: the warm-up's compilations included
            r, words[v] = measure_aligner(aligners[v], wavs, texts, sr, a.repeats, device)
        except Exception as e:  # noqa: BLE001 - one device run: a failing variant is reported, the others still run
            aligners.pop(v, None)
            result[v] = dict(error=f"{type(e).__name__}: {e}"[:2000])
            print(json.dumps({v: result[v]}), flush=True)
            continue
        # ready: loaded, and the first one-utterance and batch calls done (compilations, graph captures)
        r = dict(load_s=round(load, 2), ready_s=round(load + r["first_call_s"] + r["batch_first_call_s"], 2), **r)
        r["aligner_ms_per_audio_second"] = round(r["batch_ms"] / audio_s, 3)
        if v != "eager" and "eager" in words:
            r["words_vs_eager"] = same_words(words[v], words["eager"])
        result[v] = r
        print(json.dumps({v: r}), flush=True)  # each variant as it is done (a cut-off run keeps what it measured)
    if a.tts:
        from q3tts import TTS
        from q3tts.align import AlignerWorker
        tts = TTS.from_pretrained(a.tts, device=device, max_batch_size=a.utterances)
        speaker = (tts.get_supported_speakers() or [None])[0]
        frames = int(a.seconds * 12.5) + 1
        kw = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=frames)
        last = list(aligners)[-1] if aligners else None  # the last variant that ran

        def synthesize() -> float:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            tts.generate_custom_voice(texts, speaker=[speaker] * len(texts), **kw)
            return time.perf_counter() - t0  # (the audio is on the host when it returns: synchronized)
        synthesize()
        runs = [synthesize() for _ in range(a.synth_repeats)]  # (a batch's runs spread: BENCHMARKS.md)
        result["synthesis_ms"] = round(statistics.median(runs) * 1000, 1)
        result["synthesis_runs_ms"] = [round(t * 1000, 1) for t in runs]
        for v in aligners:
            r = result[v]
            r["share_of_synthesis"] = round(r["batch_ms"] / result["synthesis_ms"], 4)
            r["pass_share_of_synthesis"] = round(r["batch_pass_ms"] / result["synthesis_ms"], 4)
            if "batch_on_device_ms" in r:
                r["on_device_share_of_synthesis"] = round(r["batch_on_device_ms"] / result["synthesis_ms"], 4)
        print(json.dumps({k: result[k] for k in result if k.startswith("synthesis")}), flush=True)
        if last is not None:
            for mb in (16, 64):
                w = worker_batches(aligners[last], wavs, texts, sr, a.repeats, mb)
                w["share_of_synthesis"] = round(w["ms"] / result["synthesis_ms"], 4)
                result.setdefault("worker", []).append(w)
                print(json.dumps({"worker": w}), flush=True)
        if a.streams and last is not None:
            # rounds of: alone; beside the busy aligner as the server runs it (the engine's steps on their stream of
            # higher priority, the worker's passes waiting while the engine is not settled); without that wait; and
            # without either (steps on the default stream): run to run spread shows
            from q3tts.engine.async_engine import step_stream
            driver = tts.driver
            prio = step_stream(device)  # as the server sets it beside an aligner
            served = AlignerWorker(aligners[last], busy=lambda: not tts.engine.settled)
            plain = AlignerWorker(aligners[last])
            workers = {"alone": None, "beside": served, "beside_undeferred": plain, "beside_default_priority": plain}
            if a.compare_batch:
                workers[f"beside_batch{a.compare_batch}"] = AlignerWorker(
                    aligners[last], max_batch=a.compare_batch, busy=lambda: not tts.engine.settled)
            rounds = {name: [] for name in workers}
            stagger = a.stagger_ms / 1000
            if stagger:
                rounds.update(staggered_alone=[], staggered_own_words=[])
            try:
                streams_beside(tts, None, texts, wavs, sr, a.streams, frames)  # warm-up (first streams of the TTS)
                for _ in range(a.rounds):
                    for name, worker in workers.items():
                        driver.step_stream = None if name == "beside_default_priority" else prio
                        rounds[name].append(streams_beside(tts, worker, texts, wavs, sr, a.streams, frames))
                    driver.step_stream = prio
                    if stagger:
                        rounds["staggered_alone"].append(streams_beside(tts, None, texts, wavs, sr, a.streams, frames,
                                                                        stagger_s=stagger))
                        rounds["staggered_own_words"].append(streams_beside(
                            tts, None, texts, wavs, sr, a.streams, frames, own=served, stagger_s=stagger))
            finally:
                driver.step_stream = None
                for w in {id(w): w for w in workers.values() if w is not None}.values():
                    w.close()
            for name, rs in rounds.items():
                result[f"streams_{name}"] = dict(
                    rounds=rs, **{f"median_{k}": statistics.median(r[k] for r in rs)
                                  for k in ("first_audio_p50_ms", "first_audio_max_ms", "stall_max_ms")})
                print(json.dumps({name: result[f"streams_{name}"]}), flush=True)
    line = json.dumps(result)
    print(line)
    if a.out:
        Path(a.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
