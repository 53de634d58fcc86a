"""Command line: q3tts say | design | clone | voices | serve | wyoming | warmup | bench | make-checkpoint.

    q3tts make-checkpoint --tiny tiny && q3tts say "Hello" --model tiny -o hello.wav   # offline, to try it

    q3tts say "Hello there." -o hello.wav                      # default model, speaker vivian
    q3tts say "你好" --speaker dylan --language chinese -o hi.wav
    q3tts design "Hello." --instruct "A calm old man" -o x.wav  # VoiceDesign model
    q3tts clone --ref-audio me.wav --ref-text "what I said" --save me.safetensors   # Base model
    q3tts say "Cloned." --model Qwen/Qwen3-TTS-12Hz-0.6B-Base --voice me.safetensors -o c.wav
    q3tts say --text-file story.txt --play -o story.wav        # hear it while it is made
    echo "From a pipe." | q3tts say -o pipe.wav
    q3tts voices list                                           # a running server's stored voices
    q3tts voices add me --ref-audio me.wav --ref-text "what I said"
    q3tts serve --model Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice

say / design stream: the WAV file grows chunk by chunk (valid at every moment), a progress line on a terminal
shows audio seconds, real-time factor and time left when --max-new-tokens bounds the length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .cli_media import Player, Progress, WavWriter

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
DEFAULT_DESIGN_MODEL = "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign"


def _gen_kwargs(a) -> dict:
    kw = {"seed": a.seed, "max_new_tokens": a.max_new_tokens, "temperature": a.temperature}
    if a.greedy:
        kw.update(do_sample=False, subtalker_dosample=False)
    if a.non_streaming_mode is not None:
        kw["non_streaming_mode"] = a.non_streaming_mode == "true"
    return kw


def _common(p: argparse.ArgumentParser, default_model: str) -> None:
    p.add_argument("text", nargs="?", default=None,
                   help="the words to speak; '-' (or nothing, with text piped in) reads standard input")
    p.add_argument("--text-file", default=None, help="read the text from this file (UTF-8)")
    p.add_argument("-o", "--output", default="out.wav",
                   help="output WAV file (default out.wav), written as the audio is made: an interrupted run keeps "
                        "what was made")
    p.add_argument("--play", action="store_true", help="also play the audio as it is made (needs: pip install "
                                                       "'q3tts[play]', and a sound device)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line (it is drawn only on a terminal)")
    p.add_argument("--model", default=default_model, help=f"hub id or local directory (default {default_model})")
    p.add_argument("--language", default="Auto", help="Auto (default) or a language name, e.g. English, Chinese")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on generated frames + 1 (12.5 frames/s); with it the progress line shows time left")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (no sampling)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bfloat16 / float16 / float32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--non-streaming-mode", choices=["true", "false"], default=None,
                   help="text placement in the prompt (official meaning); default as the official API")
    p.add_argument("--split", choices=["none", "sentence", "clause"], default=None,
                   help="speak the text as segments decoded in parallel and joined in order (default: sentence when "
                        "the text has more than one sentence); none: one request")
    p.add_argument("--pause-ms", type=int, default=None, help="with --split: silence between two segments (ms)")
    p.add_argument("--quantization", default=None, help="int8 / int4 (weight-only) or int8dyn (int8 weights and "
                   "activations) on CPU, int8 / fp8 (weight-only) on CUDA; default none (exact; quantized output is "
                   "close, not token-exact)")


def _read_text(a) -> str:
    """The text from --text-file, '-' / piped standard input, or the argument."""
    if a.text_file and a.text:
        raise ValueError("give the text either as an argument or with --text-file, not both")
    if a.text_file:
        text = sys.stdin.read() if a.text_file == "-" else Path(a.text_file).read_text(encoding="utf-8")
    elif a.text == "-" or (a.text is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
    elif a.text is None:
        raise ValueError("no text: give it as an argument, with --text-file FILE, or on standard input ('-')")
    else:
        text = a.text
    text = text.strip()
    if not text:
        raise ValueError("the text is empty")
    return text


def _check_device(device: str | None) -> None:
    if device and device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: this PyTorch has no CUDA GPU to use (a CPU build, or no GPU "
                             "visible); use --device cpu, or install PyTorch's CUDA build")


def _load(a, max_batch_size: int | None = 1):
    from .api import TTS
    _check_device(a.device)
    # one utterance: CUDA graphs yes, a minute of torch.compile no (split: as many slots as the memory holds)
    return TTS.from_pretrained(a.model, device=a.device, dtype=a.dtype, max_batch_size=max_batch_size, compile=False,
                               quantization=getattr(a, "quantization", None))


def _split_kwargs(a, text: str) -> dict:
    """--split / --pause-ms as generate kwargs; by default sentences when the text has more than one."""
    from .inputs.split import split_text
    split = a.split or ("sentence" if len(split_text(text, "sentence", a.language)) > 1 else "none")
    if split == "none":
        return {}
    return {"split_granularity": split, "pause_ms": a.pause_ms}


def _voice(tts, a):
    """--voice: a voice file, or the name / id of a voice stored in --voice-dir."""
    if os.path.exists(a.voice) or not a.voice_dir:
        return tts.load_voice(a.voice)
    from .server.voices import VoiceStore
    store = VoiceStore(a.voice_dir, tts.cfg)
    rec = store.find(a.voice)
    if rec is None:
        names = ", ".join(r.name for r in store.list()) or "(none)"
        raise ValueError(f"no voice file {a.voice!r} and no voice of that name in {a.voice_dir} (stored: {names})")
    return store.voice(rec)


def _stream(tts, a, text: str, split: dict):
    """The AudioChunk stream for this model type (first chunk of one frame: low latency for --play)."""
    kw = dict(_gen_kwargs(a), first_chunk_frames=1, chunk_frames=16, **split)
    kind = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}[tts.tts_model_type]
    if a.cmd == "design" and tts.tts_model_type != "voice_design":
        raise ValueError(f"q3tts design needs a VoiceDesign model (e.g. --model {DEFAULT_DESIGN_MODEL}); {a.model} is "
                         f"a {kind} model: use q3tts say")
    if a.voice and tts.tts_model_type != "base":
        raise ValueError(f"--voice takes a cloned voice, which needs a Base model; {a.model} is a {kind} model"
                         + (" (pick a built-in speaker with --speaker)" if kind == "CustomVoice" else ""))
    if tts.tts_model_type != "voice_design":  # refused, not dropped unseen (the Python API keeps upstream's drop)
        tts.processor.check_options(instruct=a.instruct)
    if tts.tts_model_type == "custom_voice":
        return tts.generate_custom_voice_stream(text, speaker=a.speaker, language=a.language, instruct=a.instruct, **kw)
    if tts.tts_model_type == "voice_design":
        if not a.instruct:
            raise ValueError("this is a VoiceDesign model: describe the voice with --instruct")
        return tts.generate_voice_design_stream(text, instruct=a.instruct, language=a.language, **kw)
    if not a.voice:
        raise ValueError(f"{a.model} is a Base (voice clone) model: pass --voice voice.safetensors "
                         "(make one with `q3tts clone`) or a stored voice's name with --voice-dir")
    return tts.generate_voice_clone_stream(text, language=a.language, voice_clone_prompt=[_voice(tts, a)], **kw)


def cmd_say(a) -> int:
    """say / design: stream the audio into the WAV file (and the sound device), with a progress line."""
    text = _read_text(a)
    total_s = (a.max_new_tokens - 1) / 12.5 if a.max_new_tokens else None
    progress = Progress(label=a.cmd, total_s=total_s, enabled=False if a.quiet else None)
    split = _split_kwargs(a, text)
    progress.stage(f"loading {a.model}…")
    tts = _load(a, None if split else 1)
    progress.stage("preparing…")
    stream = _stream(tts, a, text, split)
    t0 = time.perf_counter()
    progress.t0 = t0
    wav = None
    try:
        with Player.maybe(a.play, tts.sample_rate) as player, WavWriter(a.output, tts.sample_rate) as wav:
            for chunk in stream:
                wav.write(chunk.audio)
                player.write(chunk.audio)
                if split:  # segments done / all
                    progress.label = f"{a.cmd} {stream.segments_done}/{stream.num_segments}"
                progress.update(wav.seconds)
            progress.update(wav.seconds, force=True)
    except KeyboardInterrupt:
        progress.close()
        kept = f"kept {wav.seconds:.2f} s of audio in {a.output}" if wav is not None else "nothing written"
        print(f"interrupted: {kept}", file=sys.stderr)
        return 130
    progress.close()
    wall = time.perf_counter() - t0
    first = f", first audio after {progress.first_s:.2f} s" if progress.first_s is not None else ""
    print(f"wrote {a.output}: {wav.seconds:.2f} s of audio in {wall:.2f} s ({wav.seconds / wall:.2f}x real time"
          f"{first})", file=sys.stderr)
    return 0


def cmd_clone(a) -> int:
    from .inputs.voice import VoiceCloner, voice_summary
    ref_text = Path(a.ref_text_file).read_text(encoding="utf-8").strip() if a.ref_text_file else a.ref_text
    progress = Progress(label="clone", enabled=False if a.quiet else None)
    progress.stage(f"loading the encoders of {a.model}…")
    _check_device(a.device)
    cloner = VoiceCloner.from_pretrained(a.model, device=a.device or "cpu")
    progress.stage(f"encoding {a.ref_audio}…")
    voice = cloner.create_voice(a.ref_audio, ref_text, x_vector_only_mode=a.x_vector_only, name=a.name,
                                append_silence=not a.no_append_silence)
    voice.save(a.save)
    progress.close()
    print(f"saved {a.save}: {voice_summary(voice)}", file=sys.stderr)
    return 0


def cmd_bench(a) -> int:
    """Random-weight checkpoint at the real dimensions -> our benchmark (+ the peers) -> one JSON."""
    import importlib.util
    import subprocess
    import tempfile

    import torch

    from .randomckpt import make_checkpoint
    if importlib.util.find_spec("bench") is None:
        raise ValueError("q3tts bench runs from a source checkout (it runs the repository's bench/ folder)")
    if not torch.cuda.is_available():
        raise ValueError("q3tts bench needs a CUDA GPU")
    steps = 3 if a.peers else 2
    progress = Progress(label="bench", enabled=False if a.quiet else None)
    tmp = tempfile.mkdtemp(prefix="q3tts-bench-")
    ckpt = os.path.join(tmp, a.model)
    progress.stage(f"[1/{steps}] making a random {a.model} checkpoint…")
    make_checkpoint(a.model, ckpt)
    progress.close()
    gpu = torch.cuda.get_device_name().replace(" ", "-").lower()
    out = a.out or f"bench/results/{gpu}-{time.strftime('%Y-%m-%d')}-{a.model}.json"
    run = lambda *cmd: subprocess.run([sys.executable, "-m", *cmd], check=True)  # noqa: E731
    if progress.enabled:  # the runners print their own lines below this one
        print(f"bench  [2/{steps}] q3tts: {a.frames} frames x {a.repeats} repeats, batch up to {a.batch}",
              file=sys.stderr)
    run("bench.ours", "--ckpt", ckpt, "--frames", str(a.frames), "--repeats", str(a.repeats), "--batch", str(a.batch),
        "--out", os.path.join(tmp, "ours.json"))
    result = {"command": " ".join(sys.argv), "model": a.model, "q3tts": json.load(open(os.path.join(tmp, "ours.json")))}
    if a.peers:
        if progress.enabled:
            print("bench  [3/3] peers (official qwen-tts, faster-qwen3-tts)", file=sys.stderr)
        run("bench.peers", "--ckpt", ckpt, "--frames", str(a.frames), "--repeats", str(a.repeats),
            "--out", os.path.join(tmp, "peers.json"))
        result["peers"] = json.load(open(os.path.join(tmp, "peers.json")))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_voices(a) -> int:
    from .cli_voices import run
    return run(a, _load)


def cmd_serve(argv: list[str]) -> int:
    """One server process (server.app), or replicas behind Ray Serve (--replicas / --ray-address)."""
    import logging

    from .server.settings import parse_args
    settings = parse_args(argv)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ValueError(f"q3tts serve needs the server's packages: pip install 'q3tts[serve]' "
                         f"(missing: {e.name})") from None
    _check_device(settings.device)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .engine import compile_helpers
    from .engine.compile import serve_precompile
    serve_precompile()
    os.environ.setdefault(compile_helpers.ENV, "auto")  # a cold start's compilation shared with helper processes
    ray = settings.replicas or settings.max_replicas or settings.ray_address
    if not (ray or settings.compile_artifact or settings.kv_block_size):
        # their imports now, beside the engine's loading (Ray's replicas are processes of their own; a paged cache or
        # an artifact takes no helper)
        compile_helpers.prestart(settings.device, settings.compile_cache)
    if settings.api_key is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("q3tts.server").warning("serving on %s without an API key (--api-key)", settings.host)
    if ray:
        try:
            from .server.ray_serve import serve_main
        except ImportError as e:
            raise SystemExit(f"--replicas / --ray-address need Ray Serve: pip install 'q3tts[ray]' ({e})") from None
        return serve_main(settings)
    from .server.app import main
    return main(settings)


def cmd_make_checkpoint(a) -> int:
    from .randomckpt import make_tiny
    if not a.tiny:
        raise ValueError("make-checkpoint writes --tiny checkpoints (random weights, about 50 MB, to try q3tts "
                         "offline); real-dimension ones for benchmarks: python -m bench.make_checkpoint in a source "
                         "checkout")
    make_tiny(a.dir, a.model_type)
    print(f"wrote a tiny random {a.model_type} checkpoint to {a.dir} (noise, not speech): "
          f"q3tts say \"Hello\" --model {a.dir} -o hello.wav", file=sys.stderr)
    return 0


def cmd_wyoming(argv: list[str]) -> int:
    """The Wyoming protocol server (server.wyoming), for Home Assistant."""
    try:
        from .server.wyoming import main
    except ImportError as e:
        raise SystemExit(f"q3tts wyoming needs the wyoming package: pip install 'q3tts[wyoming]' ({e})") from None
    return main(argv)


def cmd_warmup(argv: list[str]) -> int:
    """`q3tts warmup [--save FILE | --load FILE] [serve's flags]`: build the engine `q3tts serve` would build with
    those flags (on CUDA compiled: every torch.compile variant and CUDA graph; on a CPU with Q3TTS_COMPILE=1) and run
    its warm-up request; --save writes
    what was compiled to FILE (q3tts.engine.artifact: bake it into an image on a GPU builder), --load starts from
    such a file (as `q3tts serve --load-artifact FILE`; exit status 1 if it did not apply here). Prints one JSON
    line: times and compile-cache counts."""
    import logging
    import shutil
    import time

    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(prog="q3tts warmup", add_help=False)
    ap.add_argument("--save", default=None)
    ap.add_argument("--load", default=None)
    own, rest = ap.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print("usage: q3tts warmup [--save FILE | --load FILE] [q3tts serve's flags]\n\n" + cmd_warmup.__doc__)
        return 0
    if own.save and own.load:
        raise ValueError("--save and --load exclude each other (a saved artifact holds what this start compiled)")
    from .server.settings import parse_args
    settings = parse_args(rest + (["--load-artifact", own.load] if own.load else []))
    _check_device(settings.device)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .engine.compile import serve_precompile
    serve_precompile()
    from .engine.artifact import own_triton_cache
    triton_tmp = own_triton_cache() if own.save else None
    try:
        return _warmup(settings, own.save, t0)
    finally:
        if triton_tmp:
            shutil.rmtree(triton_tmp, ignore_errors=True)


def _warmup(settings, save: str | None, t0: float) -> int:
    import json
    import time

    from .api import TTS
    from .engine import compile_counts
    from .engine.artifact import save_artifact
    counts = compile_counts()
    tts = TTS.from_pretrained(settings.model, device=settings.device, dtype=settings.dtype,  # compile: as serve's
                              quantization=settings.quantization, compile_cache=settings.compile_cache,
                              compile_artifact=settings.compile_artifact,
                              generation_config=settings.generation_config)
    invariant = {"batch_invariant": True} if settings.batch_invariant else {}
    engine = tts.build_engine(max_slots=settings.max_concurrent, max_seq_len=settings.max_seq_len,  # as create_app
                              max_queue=settings.max_queue, **invariant, **settings.memory_budget)
    if save and not engine.runner.compiled:
        raise ValueError(f"nothing to save: torch.compile is off on {tts.device} (on a CPU by default: "
                         "Q3TTS_COMPILE=1 turns it on, for `q3tts serve` as well)")
    t_engine = time.perf_counter()
    prepared = [tts.warmup_request()]  # serve's warm-up
    for _ in tts.stream(prepared, first_chunk_frames=1, chunk_frames=4):
        pass
    after = compile_counts()
    out = {"ready_s": round(time.perf_counter() - t0, 2), "engine_built_s": round(t_engine - t0, 2),
           "compiled": after["fx_miss"] - counts["fx_miss"], "from_cache": after["fx_hit"] - counts["fx_hit"],
           "traced": after["traced"] - counts["traced"], "dynamo_installed": after["dynamo_hit"] - counts["dynamo_hit"],
           "artifact_loaded": engine.artifact is not None if settings.compile_artifact else None,
           "compile_cache": engine.runner.compile_cache}
    if save:
        header = save_artifact(save, tts.ckpt, {"max_slots": engine.runner.num_rows,
                                                "max_seq_len": engine.runner.max_len})
        out.update(saved=save, bytes=os.path.getsize(save), sections=dict(header["sections"]))
    print(json.dumps(out), flush=True)
    return 1 if out["artifact_loaded"] is False else 0  # --load: a file that did not apply fails the check


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        try:
            return cmd_serve(argv[1:])
        except (ValueError, FileNotFoundError, IsADirectoryError) as e:  # load failures, missing extras: one line
            print(f"q3tts: error: {e}", file=sys.stderr)
            return 2
    if argv[:1] == ["wyoming"]:
        return cmd_wyoming(argv[1:])
    if argv[:1] == ["warmup"]:
        try:
            return cmd_warmup(argv[1:])
        except (ValueError, FileNotFoundError, IsADirectoryError) as e:
            print(f"q3tts: error: {e}", file=sys.stderr)
            return 2
    ap = argparse.ArgumentParser(prog="q3tts", description="Qwen3-TTS inference: synthesize speech, serve an API.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    say = sub.add_parser("say", help="synthesize text to a WAV file")
    _common(say, DEFAULT_MODEL)
    say.add_argument("--speaker", default="vivian", help="CustomVoice speaker (default vivian)")
    say.add_argument("--instruct", default=None, help="style instruction (1.7B CustomVoice, VoiceDesign)")
    say.add_argument("--voice", default=None,
                     help="Base models: a voice file from `q3tts clone`, or a stored voice's name with --voice-dir")
    say.add_argument("--voice-dir", default=None, help="a voice directory (as `q3tts serve --voice-dir`)")
    design = sub.add_parser("design", help="synthesize with a voice described in words (VoiceDesign model)")
    _common(design, DEFAULT_DESIGN_MODEL)
    design.add_argument("--instruct", required=True, help="the voice, in words")
    clone = sub.add_parser("clone", help="make a reusable voice file from reference audio (Base model)")
    clone.add_argument("--model", default="Qwen/Qwen3-TTS-12Hz-0.6B-Base", help="a Base model (hub id or directory)")
    clone.add_argument("--ref-audio", required=True, help="reference recording (wav, flac, ogg, mp3), 1-60 s")
    clone.add_argument("--ref-text", default=None, help="its transcript (needed unless --x-vector-only)")
    clone.add_argument("--ref-text-file", default=None, help="read the transcript from a file")
    clone.add_argument("--x-vector-only", action="store_true", help="speaker embedding only (no ICL reference codes)")
    clone.add_argument("--no-append-silence", action="store_true",
                       help="do not pad the reference with 0.5 s of silence")
    clone.add_argument("--name", default=None)
    clone.add_argument("--device", default=None)
    clone.add_argument("--save", required=True, help="output voice file (.safetensors)")
    clone.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    voices = sub.add_parser("voices", help="list, add and delete stored voices (a server's, or a voice directory)")
    voices.add_argument("action", choices=["list", "add", "delete"])
    voices.add_argument("name", nargs="?", help="add: the new voice's name; delete: a voice's name or id")
    voices.add_argument("--server", default=os.environ.get("Q3TTS_SERVER", "http://127.0.0.1:8000"),
                        help="a running `q3tts serve` (default $Q3TTS_SERVER or http://127.0.0.1:8000)")
    voices.add_argument("--api-key", default=os.environ.get("Q3TTS_API_KEY"), help="its API key ($Q3TTS_API_KEY)")
    voices.add_argument("--voice-dir", default=None, help="use this voice directory directly instead of a server")
    voices.add_argument("--model", default=None, help="with --voice-dir: the Base model (hub id or directory)")
    voices.add_argument("--device", default=None)
    voices.add_argument("--dtype", default=None)
    voices.add_argument("--ref-audio", help="add: the reference recording (wav, flac, ogg, mp3), 1-60 s")
    voices.add_argument("--ref-text", default=None, help="add: its transcript (needed unless --x-vector-only)")
    voices.add_argument("--ref-text-file", default=None, help="add: read the transcript from a file")
    voices.add_argument("--x-vector-only", action="store_true", help="add: speaker embedding only")
    voices.add_argument("--json", action="store_true", help="list: print the voices as JSON")
    sub.add_parser("serve", help="OpenAI-compatible speech server (q3tts serve --help)")
    mk = sub.add_parser("make-checkpoint", help="write a tiny random checkpoint (offline, to try q3tts with)")
    mk.add_argument("dir", help="the directory to write")
    mk.add_argument("--tiny", action="store_true", help="tiny dimensions (about 50 MB; noise, not speech)")
    mk.add_argument("--model-type", default="custom_voice", choices=["custom_voice", "base", "voice_design"])
    sub.add_parser("wyoming", help="Wyoming server for Home Assistant (q3tts wyoming --help)")
    sub.add_parser("warmup", help="compile as `q3tts serve` would; --save FILE: a compiled artifact for "
                                  "`q3tts serve --load-artifact FILE` (q3tts warmup --help)")
    bench = sub.add_parser("bench", help="GPU benchmark on a random-weight checkpoint at the real dimensions")
    bench.add_argument("--model", default="0.6B-CustomVoice", choices=["0.6B-CustomVoice", "1.7B-CustomVoice"])
    bench.add_argument("--frames", type=int, default=125, help="frames decoded per run (125 = 10 s of audio)")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--batch", type=int, default=16)
    bench.add_argument("--peers", action="store_true", help="also run the official package and faster-qwen3-tts")
    bench.add_argument("--out", default=None, help="result JSON (default bench/results/<gpu>-<date>-<model>.json)")
    bench.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    a = ap.parse_args(argv)
    try:
        if a.cmd in ("say", "design"):
            if a.cmd == "design":
                a.speaker, a.voice, a.voice_dir = None, None, None
            return cmd_say(a)
        if a.cmd == "voices":
            if a.action != "list" and not a.name:
                voices.error(f"voices {a.action} needs a voice name")
            if a.action == "add" and not a.ref_audio:
                voices.error("voices add needs --ref-audio")
            return cmd_voices(a)
        if a.cmd == "clone":
            return cmd_clone(a)
        if a.cmd == "bench":
            return cmd_bench(a)
        if a.cmd == "make-checkpoint":
            return cmd_make_checkpoint(a)
    except (ValueError, FileNotFoundError, IsADirectoryError) as e:
        print(f"q3tts: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before any audio (loading); say/design handle it themselves once writing
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
