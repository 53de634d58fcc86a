"""Command line: q3tts say | design | clone | serve | bench.

    q3tts say "Hello there." -o hello.wav                      # default model, speaker vivian
    q3tts say "你好" --speaker dylan --language chinese -o hi.wav
    q3tts design "Hello." --instruct "A calm old man" -o x.wav  # VoiceDesign model
    q3tts clone --ref-audio me.wav --ref-text "what I said" --save me.safetensors   # Base model
    q3tts say "Cloned." --model Qwen/Qwen3-TTS-12Hz-0.6B-Base --voice me.safetensors -o c.wav
    q3tts serve --model Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice
"""

from __future__ import annotations

import argparse
import sys
import time

from .audio import write_wav

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
DEFAULT_DESIGN_MODEL = "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign"


def _gen_kwargs(a) -> dict:
    kw = {"seed": a.seed, "max_new_tokens": a.max_new_tokens, "temperature": a.temperature}
    if a.greedy:
        kw.update(do_sample=False, subtalker_dosample=False)
    return kw


def _common(p: argparse.ArgumentParser, default_model: str) -> None:
    p.add_argument("text", help="the words to speak")
    p.add_argument("-o", "--output", default="out.wav", help="output WAV file (default out.wav)")
    p.add_argument("--model", default=default_model, help=f"hub id or local directory (default {default_model})")
    p.add_argument("--language", default="Auto", help="Auto (default) or a language name, e.g. English, Chinese")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on generated frames + 1 (12.5 frames/s)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (no sampling)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bfloat16 / float16 / float32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--non-streaming-mode", choices=["true", "false"], default=None,
                   help="text placement in the prompt (official meaning); default as the official API")
    p.add_argument("--quantization", default=None, help="weight-only: int8 / int4 (CPU), int8 / fp8 (CUDA); "
                   "default none (exact; quantized output is close, not token-exact)")


def _load(a):
    from .api import TTS
    # one utterance: CUDA graphs yes, a minute of torch.compile no
    return TTS.from_pretrained(a.model, device=a.device, dtype=a.dtype, max_batch_size=1, compile=False,
                           quantization=a.quantization)


def cmd_say(a) -> int:
    tts = _load(a)
    t0 = time.perf_counter()
    kw = _gen_kwargs(a)
    if a.non_streaming_mode is not None:
        kw["non_streaming_mode"] = a.non_streaming_mode == "true"
    if tts.tts_model_type == "custom_voice":
        wavs, sr = tts.generate_custom_voice(a.text, speaker=a.speaker, language=a.language, instruct=a.instruct, **kw)
    elif tts.tts_model_type == "voice_design":
        if not a.instruct:
            raise ValueError("this is a VoiceDesign model: describe the voice with --instruct")
        wavs, sr = tts.generate_voice_design(a.text, instruct=a.instruct, language=a.language, **kw)
    else:
        if not a.voice:
            raise ValueError(f"{a.model} is a Base (voice clone) model: pass --voice voice.safetensors "
                             "(make one with `q3tts clone`)")
        wavs, sr = tts.generate_voice_clone(a.text, language=a.language, voice_clone_prompt=[tts.load_voice(a.voice)], **kw)
    write_wav(a.output, wavs[0], sr)
    dur = len(wavs[0]) / sr
    print(f"wrote {a.output}: {dur:.2f} s of audio in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 0


def cmd_clone(a) -> int:
    from .voice import VoiceCloner, voice_summary
    ref_text = a.ref_text
    if a.ref_text_file:
        ref_text = open(a.ref_text_file, encoding="utf-8").read().strip()
    cloner = VoiceCloner.from_pretrained(a.model, device=a.device or "cpu")
    voice = cloner.create_voice(a.ref_audio, ref_text, x_vector_only_mode=a.x_vector_only, name=a.name,
                                append_silence=not a.no_append_silence)
    voice.save(a.save)
    print(f"saved {a.save}: {voice_summary(voice)}", file=sys.stderr)
    return 0


def cmd_bench(a) -> int:
    """Random-weight checkpoint at the real dimensions -> our benchmark (+ the peers) -> one JSON."""
    import json
    import os
    import subprocess
    import tempfile
    try:
        from bench.make_checkpoint import make
    except ImportError:
        raise ValueError("q3tts bench runs from a source checkout (it needs the repository's bench/ folder)")
    import torch
    if not torch.cuda.is_available():
        raise ValueError("q3tts bench needs a CUDA GPU")
    tmp = tempfile.mkdtemp(prefix="q3tts-bench-")
    ckpt = os.path.join(tmp, a.model)
    make(a.model, ckpt)
    gpu = torch.cuda.get_device_name().replace(" ", "-").lower()
    out = a.out or f"bench/results/{gpu}-{time.strftime('%Y-%m-%d')}-{a.model}.json"
    run = lambda *cmd: subprocess.run([sys.executable, "-m", *cmd], check=True)  # noqa: E731
    run("bench.ours", "--ckpt", ckpt, "--frames", str(a.frames), "--repeats", str(a.repeats), "--batch", str(a.batch),
        "--out", os.path.join(tmp, "ours.json"))
    result = {"command": " ".join(sys.argv), "model": a.model, "q3tts": json.load(open(os.path.join(tmp, "ours.json")))}
    if a.peers:
        run("bench.peers", "--ckpt", ckpt, "--frames", str(a.frames), "--repeats", str(a.repeats),
            "--out", os.path.join(tmp, "peers.json"))
        result["peers"] = json.load(open(os.path.join(tmp, "peers.json")))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_serve(argv: list[str]) -> int:
    from .server.app import main
    return main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return cmd_serve(argv[1:])
    ap = argparse.ArgumentParser(prog="q3tts", description="Qwen3-TTS inference: synthesize speech, serve an API.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    say = sub.add_parser("say", help="synthesize text to a WAV file")
    _common(say, DEFAULT_MODEL)
    say.add_argument("--speaker", default="vivian", help="CustomVoice speaker (default vivian)")
    say.add_argument("--instruct", default=None, help="style instruction (1.7B CustomVoice, VoiceDesign)")
    say.add_argument("--voice", default=None, help="voice file from `q3tts clone` (Base models)")
    design = sub.add_parser("design", help="synthesize with a voice described in words (VoiceDesign model)")
    _common(design, DEFAULT_DESIGN_MODEL)
    design.add_argument("--instruct", required=True, help="the voice, in words")
    clone = sub.add_parser("clone", help="make a reusable voice file from reference audio (Base model)")
    clone.add_argument("--model", default="Qwen/Qwen3-TTS-12Hz-0.6B-Base", help="a Base model (hub id or directory)")
    clone.add_argument("--ref-audio", required=True, help="reference recording (wav, flac, ogg, mp3), 1-60 s")
    clone.add_argument("--ref-text", default=None, help="its transcript (needed unless --x-vector-only)")
    clone.add_argument("--ref-text-file", default=None, help="read the transcript from a file")
    clone.add_argument("--x-vector-only", action="store_true", help="speaker embedding only (no ICL reference codes)")
    clone.add_argument("--no-append-silence", action="store_true", help="do not pad the reference with 0.5 s of silence")
    clone.add_argument("--name", default=None)
    clone.add_argument("--device", default=None)
    clone.add_argument("--save", required=True, help="output voice file (.safetensors)")
    sub.add_parser("serve", help="OpenAI-compatible speech server (q3tts serve --help)")
    bench = sub.add_parser("bench", help="GPU benchmark on a random-weight checkpoint at the real dimensions")
    bench.add_argument("--model", default="0.6B-CustomVoice", choices=["0.6B-CustomVoice", "1.7B-CustomVoice"])
    bench.add_argument("--frames", type=int, default=125, help="frames decoded per run (125 = 10 s of audio)")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--batch", type=int, default=16)
    bench.add_argument("--peers", action="store_true", help="also run the official package and faster-qwen3-tts")
    bench.add_argument("--out", default=None, help="result JSON (default bench/results/<gpu>-<date>-<model>.json)")
    a = ap.parse_args(argv)
    try:
        if a.cmd in ("say", "design"):
            if a.cmd == "design":
                a.speaker, a.voice = None, None
            return cmd_say(a)
        if a.cmd == "clone":
            return cmd_clone(a)
        if a.cmd == "bench":
            return cmd_bench(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"q3tts: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
