"""Command line: q3tts say | design | serve | bench.

    q3tts say "Hello there." -o hello.wav                      # default model, speaker vivian
    q3tts say "你好" --speaker dylan --language chinese -o hi.wav
    q3tts design "Hello." --instruct "A calm old man" -o x.wav  # VoiceDesign model
    q3tts serve --model Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice
"""

from __future__ import annotations

import argparse
import sys
import time
import wave

import numpy as np

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
DEFAULT_DESIGN_MODEL = "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign"


def write_wav(path: str, wav: np.ndarray, sr: int) -> None:
    """float32 [-1, 1] -> 16-bit PCM mono WAV."""
    pcm = (np.clip(wav, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(path, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sr)
        f.writeframes(pcm.tobytes())


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


def _load(a):
    from .api import TTS
    return TTS.from_pretrained(a.model, device=a.device, dtype=a.dtype)


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
        raise ValueError(f"{a.model} is a Base (voice clone) model: cloning from reference audio is not available in "
                         "the CLI yet; use a CustomVoice or VoiceDesign model")
    write_wav(a.output, wavs[0], sr)
    dur = len(wavs[0]) / sr
    print(f"wrote {a.output}: {dur:.2f} s of audio in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
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
    design = sub.add_parser("design", help="synthesize with a voice described in words (VoiceDesign model)")
    _common(design, DEFAULT_DESIGN_MODEL)
    design.add_argument("--instruct", required=True, help="the voice, in words")
    sub.add_parser("serve", help="OpenAI-compatible speech server (q3tts serve --help)")
    a = ap.parse_args(argv)
    try:
        if a.cmd in ("say", "design"):
            if a.cmd == "design":
                a.speaker = None
            return cmd_say(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"q3tts: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
