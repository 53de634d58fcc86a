"""Measure the peer engines on one checkpoint, one text and a fixed number of frames.

    python -m bench.peers --ckpt DIR --frames 125 --repeats 3 --out results.json

Peers (each runs in its own subprocess: `python -m bench.peers --peer NAME ...`, so a crash, a CUDA
error or the allocator state of one cannot touch another):

- `official`: the official implementation, Transformers-5 build `qwen-tts-hf` (`qwen_tts.Qwen3TTSModel`,
  `generate_custom_voice`, non-streaming: the package has no streaming output).
- `faster`: `faster-qwen3-tts==0.5.4` (`FasterQwen3TTS`, CUDA graphs for talker step and code
  predictor), `generate_custom_voice` and `generate_custom_voice_streaming` with chunk_size 1, 2, 8.

Same for all: bf16, attn_implementation 'sdpa' (flash-attn is not installed), generation defaults of
the checkpoint (sampling, top-k 50, temperature 0.9, repetition penalty 1.05, sub-talker likewise),
speaker/language/text from the command line, non_streaming_mode=True (both packages' default for
CustomVoice). The checkpoint (bench/make_checkpoint.py) has `eos_zero`: EOS can never be sampled, so the
frame count is set by max_new_tokens alone. Frame counting differs: the official talker emits
max_new_tokens - 1 frames (the prefill step yields no codes), faster-qwen3-tts emits max_new_tokens;
the harness asks each for exactly --frames and checks the audio length (1920 samples per frame).

Metrics per configuration: a warm-up call first (faster-qwen3-tts captures its graphs there), then
--repeats timed calls, torch.cuda.synchronize() before every clock read; wall = call to returned
waveform (vocoder included); median over repeats of wall, real-time factor (audio s / wall s),
ms per frame (wall / frames), time to first audio (streaming: first yielded chunk; non-streaming:
wall); peak GPU memory (torch.cuda.max_memory_allocated/reserved over the timed calls); vocoder time
(speech_tokenizer.decode, timed in place) and, for faster-qwen3-tts, its own prefill / decode-loop
timing. Output: one JSON dict (stdout and --out).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

SAMPLES_PER_FRAME = 1920
SAMPLE_RATE = 24000
PEERS = ("official", "faster")
DEFAULT_TEXT = ("Hello! This is a speed test of Qwen3 text to speech on a random-weight checkpoint, "
                "and every engine decodes exactly the same number of frames.")

# Every change the harness makes to a peer at run time, recorded with the results.
PATCHES = {
    "qwen_tts_default_rope_mimi": (
        "qwen-tts-hf 0.1.1.post1 registers its own `_default_rope_parameters` as "
        "transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS['default']; transformers 5.17 "
        "PreTrainedModel._init_weights looks rope functions up in {module defaults, **ROPE_INIT_FUNCTIONS}, "
        "so the speech tokenizer's Mimi encoder rotary embedding gets the qwen function, which reads "
        "`config.rope_theta`, absent from a 5.x MimiConfig (it has `rope_parameters`) -> AttributeError "
        "\"'MimiConfig' object has no attribute 'rope_theta'\" while loading the speech tokenizer. Patch: the "
        "registered function (and qwen_tts._transformers_compat._default_rope_parameters) falls back to "
        "config.rope_parameters['rope_theta'] when config.rope_theta is missing, with Mimi's own formula "
        "(1 / theta^(arange(0, head_dim, 2) / head_dim)); configs with rope_theta take the unchanged original "
        "path. Only the Mimi encoder's inv_freq is affected; it is not used by CustomVoice generation."),
}


# ----------------------------------------------------------------------------------------- helpers
def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _now() -> float:
    _sync()
    return time.perf_counter()


def _reset_peak() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> dict:
    import torch
    if not torch.cuda.is_available():
        return {}
    g = 2.0 ** 30
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / g, 3),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / g, 3)}


def _mem_now() -> dict:
    import torch
    if not torch.cuda.is_available():
        return {}
    return {"allocated_gib": round(torch.cuda.memory_allocated() / 2.0 ** 30, 3)}


def _ensure_torchaudio() -> bool:
    """qwen_tts.core imports torchaudio.compliance.kaldi (25 Hz tokenizer only). Stub it if it cannot load."""
    try:
        import torchaudio.compliance.kaldi  # noqa: F401
        return False
    except Exception:  # pragma: no cover - only where torchaudio does not match torch
        for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
        sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]
        return True


def patch_qwen_tts() -> list[str]:
    """Import qwen_tts (qwen-tts-hf) and apply PATCHES; returns the names of the patches applied."""
    applied = []
    if _ensure_torchaudio():
        applied.append("torchaudio_stub (torchaudio did not import; used only by the 25 Hz tokenizer)")
    import qwen_tts  # noqa: F401  (registers ROPE_INIT_FUNCTIONS['default'])
    import torch
    from qwen_tts import _transformers_compat as compat
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    orig = compat._default_rope_parameters
    if getattr(orig, "_q3tts_bench_patched", False):
        return applied

    def default_rope_parameters(config, device=None, seq_len=None, layer_type=None):
        try:
            config.rope_theta
        except AttributeError:
            rp = config.rope_parameters
            if layer_type is not None and isinstance(rp.get(layer_type), dict):
                rp = rp[layer_type]
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            dim = int(head_dim * rp.get("partial_rotary_factor", 1.0))
            exps = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
            return 1.0 / (rp["rope_theta"] ** exps), 1.0
        return orig(config, device=device, seq_len=seq_len, layer_type=layer_type)

    default_rope_parameters._q3tts_bench_patched = True
    compat._default_rope_parameters = default_rope_parameters
    if ROPE_INIT_FUNCTIONS.get("default") is orig:
        ROPE_INIT_FUNCTIONS["default"] = default_rope_parameters
        applied.append("qwen_tts_default_rope_mimi")
    return applied


class DecodeTimer:
    """Wrap speech_tokenizer.decode of one instance to time the vocoder in place."""

    def __init__(self, speech_tokenizer):
        self.times: list[float] = []
        orig = speech_tokenizer.decode

        def decode(*args, **kwargs):
            t0 = _now()
            out = orig(*args, **kwargs)
            self.times.append(_now() - t0)
            return out

        speech_tokenizer.decode = decode

    def take(self) -> float:
        s, self.times = sum(self.times), []
        return s


def _samples(wavs) -> int:
    return int(sum(len(w.reshape(-1)) for w in wavs))


def summarise(runs: list[dict], frames: int) -> dict:
    """runs: dicts with wall_s, samples, ttfa_s (opt), vocoder_s (opt), extra keys (medians taken)."""
    wall = [r["wall_s"] for r in runs]
    med = statistics.median(wall)
    got = [r["samples"] / SAMPLES_PER_FRAME for r in runs]
    audio_s = statistics.median(r["samples"] for r in runs) / SAMPLE_RATE
    out = {
        "frames_requested": frames,
        "frames_out": got,
        "frames_ok": all(abs(g - frames) < 1e-6 for g in got),
        "audio_s": round(audio_s, 4),
        "wall_s_median": round(med, 4),
        "wall_s_all": [round(w, 4) for w in wall],
        "rtf_median": round(statistics.median(r["samples"] / SAMPLE_RATE / r["wall_s"] for r in runs), 3),
        "ms_per_frame_median": round(1000 * med / frames, 3),
    }
    for key in ("ttfa_s", "vocoder_s", "prefill_s", "decode_loop_s"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            name = key[:-2] + "_ms_median"
            out[name] = round(1000 * statistics.median(vals), 3)
    if "decode_loop_ms_median" in out:
        out["decode_loop_ms_per_frame"] = round(out["decode_loop_ms_median"] / frames, 3)
    return out


def measure(call, frames: int, repeats: int, seed: int) -> dict:
    """call() -> dict(samples=..., ttfa_s=..., ...) ; one warm-up call, then `repeats` timed calls."""
    import torch
    torch.manual_seed(seed)
    t0 = _now()
    warm = call()
    warm_s = _now() - t0
    _reset_peak()
    runs = []
    for i in range(repeats):
        torch.manual_seed(seed + 1 + i)
        t0 = _now()
        r = call(t0)
        r["wall_s"] = _now() - t0
        runs.append(r)
    res = summarise(runs, frames)
    res["warmup_s"] = round(warm_s, 3)
    res["warmup_frames_out"] = warm["samples"] / SAMPLES_PER_FRAME
    res.update(_peak())
    return res


# ----------------------------------------------------------------------------------------- peers
def _gen_kwargs(a) -> dict:
    return dict(text=a.text, speaker=a.speaker, language=a.language)


def run_official(a) -> dict:
    import torch
    info: dict = {"patches": patch_qwen_tts()}
    from importlib.metadata import version

    from qwen_tts import Qwen3TTSModel
    info["package"] = f"qwen-tts-hf=={version('qwen-tts-hf')}"
    t0 = _now()
    tts = Qwen3TTSModel.from_pretrained(a.ckpt, device_map=a.device, dtype=torch.bfloat16,
                                        attn_implementation=a.attn)
    info["load_s"] = round(_now() - t0, 3)
    info["after_load"] = _mem_now()
    info["speech_tokenizer_dtype"] = str(tts.model.speech_tokenizer.model.dtype)
    timer = DecodeTimer(tts.model.speech_tokenizer)
    # The official talker emits max_new_tokens - 1 frames (the prefill forward yields no codes).
    info["max_new_tokens"] = a.frames + 1

    def call(t0=None):
        timer.take()
        wavs, sr = tts.generate_custom_voice(**_gen_kwargs(a), non_streaming_mode=True,
                                             max_new_tokens=a.frames + 1)
        assert sr == SAMPLE_RATE, sr
        return {"samples": _samples(wavs), "vocoder_s": timer.take()}

    res = measure(call, a.frames, a.repeats, a.seed)
    res["ttfa_ms_median"] = res["wall_s_median"] * 1000  # no streaming output: first audio = whole audio
    info["configs"] = {"nonstream": res}
    return info


def run_faster(a) -> dict:
    import torch
    info: dict = {"patches": patch_qwen_tts()}  # it loads the model through qwen_tts.Qwen3TTSModel
    from importlib.metadata import version

    import faster_qwen3_tts.generate as fgen
    from faster_qwen3_tts import FasterQwen3TTS
    info["package"] = f"faster-qwen3-tts=={version('faster-qwen3-tts')}"
    t0 = _now()
    model = FasterQwen3TTS.from_pretrained(a.ckpt, device=a.device, dtype=torch.bfloat16,
                                           attn_implementation=a.attn, max_seq_len=a.max_seq_len)
    info["load_s"] = round(_now() - t0, 3)
    info["after_load"] = _mem_now()
    timer = DecodeTimer(model.model.model.speech_tokenizer)
    # faster-qwen3-tts emits max_new_tokens frames (one per decode-loop iteration).
    info["max_new_tokens"] = a.frames

    # Its own timing dict (prefill / decode loop, vocoder excluded), captured by wrapping fast_generate
    # (generate_custom_voice imports it from the module at call time).
    last_timing: dict = {}
    orig_fast_generate = fgen.fast_generate

    def fast_generate(*args, **kwargs):
        codes, timing = orig_fast_generate(*args, **kwargs)
        last_timing.clear()
        last_timing.update(timing)
        return codes, timing

    fgen.fast_generate = fast_generate

    def call_nonstream(t0=None):
        timer.take()
        wavs, sr = model.generate_custom_voice(**_gen_kwargs(a), non_streaming_mode=True,
                                               max_new_tokens=a.frames)
        assert sr == SAMPLE_RATE, sr
        return {"samples": _samples(wavs), "vocoder_s": timer.take(),
                "prefill_s": last_timing.get("prefill_ms", 0) / 1000, "decode_loop_s": last_timing.get("decode_s")}

    def call_stream(chunk):
        def call(t0=None):
            timer.take()
            start = t0 if t0 is not None else _now()
            n, ttfa, chunks = 0, None, 0
            for audio, sr, _timing in model.generate_custom_voice_streaming(
                    **_gen_kwargs(a), non_streaming_mode=True, max_new_tokens=a.frames, chunk_size=chunk):
                assert sr == SAMPLE_RATE, sr
                if ttfa is None and len(audio):
                    ttfa = _now() - start
                n += len(audio.reshape(-1))
                chunks += 1
            return {"samples": n, "ttfa_s": ttfa, "vocoder_s": timer.take(), "chunks": chunks}
        return call

    configs = {}
    configs["nonstream"] = measure(call_nonstream, a.frames, a.repeats, a.seed)
    configs["nonstream"]["ttfa_ms_median"] = configs["nonstream"]["wall_s_median"] * 1000
    for c in a.chunk_sizes:
        try:
            configs[f"stream_chunk{c}"] = measure(call_stream(c), a.frames, a.repeats, a.seed)
        except Exception as e:  # keep the other configurations
            configs[f"stream_chunk{c}"] = {"error": repr(e), "traceback": traceback.format_exc()[-3000:]}
    info["configs"] = configs
    return info


RUNNERS = {"official": run_official, "faster": run_faster}


# ----------------------------------------------------------------------------------------- driver
def environment() -> dict:
    env = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch
        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(gpu=torch.cuda.get_device_name(0), gpu_memory_gib=round(p.total_memory / 2.0 ** 30, 1),
                       cuda=torch.version.cuda, sm_count=p.multi_processor_count)
        import transformers
        env["transformers"] = transformers.__version__
    except Exception as e:  # pragma: no cover
        env["error"] = repr(e)
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        pass
    return env


def child(a) -> None:
    t0 = time.perf_counter()
    try:
        res = RUNNERS[a.peer](a)
        res["ok"] = True
    except Exception as e:
        res = {"ok": False, "error": repr(e), "traceback": traceback.format_exc()[-6000:]}
    res["total_s"] = round(time.perf_counter() - t0, 1)
    Path(a.json_out).write_text(json.dumps(res, indent=2))


def _child_args(a, peer: str, json_out: str) -> list[str]:
    args = [sys.executable, "-m", "bench.peers", "--peer", peer, "--json-out", json_out, "--ckpt", a.ckpt,
            "--text", a.text, "--speaker", a.speaker, "--language", a.language, "--frames", str(a.frames),
            "--repeats", str(a.repeats), "--seed", str(a.seed), "--device", a.device, "--attn", a.attn,
            "--max-seq-len", str(a.max_seq_len), "--chunk-sizes", ",".join(map(str, a.chunk_sizes))]
    return args


def parent(a) -> dict:
    ckpt_info = Path(a.ckpt) / "bench_checkpoint.json"
    result = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "environment": environment(),
        "checkpoint": json.loads(ckpt_info.read_text()) if ckpt_info.exists() else {"dir": a.ckpt},
        "text": a.text, "speaker": a.speaker, "language": a.language,
        "frames": a.frames, "audio_s_expected": a.frames * SAMPLES_PER_FRAME / SAMPLE_RATE,
        "repeats": a.repeats, "dtype": "bfloat16", "attn_implementation": a.attn,
        "sampling": "checkpoint generation_config defaults (do_sample, top_k 50, temperature 0.9, "
                    "repetition_penalty 1.05; sub-talker do_sample, top_k 50, temperature 0.9); EOS impossible "
                    "(eos_zero)",
        "patch_descriptions": PATCHES,
        "peers": {},
    }
    root = Path(__file__).resolve().parents[1]
    for peer in a.peers:
        with tempfile.TemporaryDirectory() as td:
            out = os.path.join(td, f"{peer}.json")
            t0 = time.perf_counter()
            try:
                p = subprocess.run(_child_args(a, peer, out), cwd=root, capture_output=True, text=True,
                                   timeout=a.timeout)
                rc, log = p.returncode, (p.stdout + p.stderr)
            except subprocess.TimeoutExpired as e:
                rc, log = "timeout", ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                                      else (e.stdout or "")) + ((e.stderr or b"").decode(errors="replace")
                                                               if isinstance(e.stderr, bytes) else (e.stderr or ""))
            res = json.loads(Path(out).read_text()) if os.path.exists(out) else {"ok": False}
            res["returncode"] = rc
            res["wall_total_s"] = round(time.perf_counter() - t0, 1)
            if not res.get("ok"):
                res["log_tail"] = log[-4000:]
            result["peers"][peer] = res
            print(f"[bench.peers] {peer}: ok={res.get('ok')} rc={rc} {res['wall_total_s']} s", file=sys.stderr)
    return result


def table(result: dict) -> str:
    rows = [f"{'peer/config':28s} {'frames':>6s} {'wall s':>8s} {'RTF':>7s} {'ms/frame':>9s} {'TTFA ms':>9s} "
            f"{'voc ms':>8s} {'peak GiB':>8s}"]
    for peer, res in result["peers"].items():
        if not res.get("ok"):
            rows.append(f"{peer:28s} FAILED: {res.get('error', res.get('returncode'))}")
            continue
        for cfg, r in res["configs"].items():
            if "error" in r:
                rows.append(f"{peer + '/' + cfg:28s} FAILED: {r['error'][:80]}")
                continue
            rows.append(f"{peer + '/' + cfg:28s} {r['frames_out'][0]:6.0f} {r['wall_s_median']:8.3f} "
                        f"{r['rtf_median']:7.3f} {r['ms_per_frame_median']:9.2f} {r.get('ttfa_ms_median', 0):9.1f} "
                        f"{r.get('vocoder_ms_median', 0):8.1f} {r.get('peak_allocated_gib', 0):8.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint dir (bench/make_checkpoint.py)")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--speaker", default="ryan")
    ap.add_argument("--language", default="english")
    ap.add_argument("--frames", type=int, default=125, help="frames per call (12.5 frames = 1 s of audio)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--max-seq-len", type=int, default=2048, help="faster-qwen3-tts static KV length")
    ap.add_argument("--chunk-sizes", default="1,2,8", help="faster-qwen3-tts streaming chunk sizes ('' for none)")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma list of " + ", ".join(PEERS))
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per peer subprocess")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--peer", choices=PEERS, help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--json-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.chunk_sizes = [int(c) for c in a.chunk_sizes.split(",") if c.strip()]
    a.peers = [p for p in a.peers.split(",") if p]
    if a.peer:
        child(a)
        return
    result = parent(a)
    text = json.dumps(result, indent=2)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    print(text)
    print(table(result), file=sys.stderr)


if __name__ == "__main__":
    main()
