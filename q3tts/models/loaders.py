"""Loading a checkpoint in the official layout: a `Checkpoint` bundle for the engine, and the two cloning
encoders (loaded on demand, fp32).

    ckpt = load_checkpoint("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")    # or a local directory
    engine = Engine(ckpt, max_slots=8)
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import (
    GenerationDefaults,
    ModelConfig,
    SpeechTokenizerConfig,
    generation_overrides,
    parse_generation_defaults,
    parse_model_config,
    parse_speech_tokenizer_config,
    read_json,
)
from ..weights import (
    cast_tensors,
    check_prefixes,
    load_module,
    read_tensors,
    resolve_model_dir,
    safetensors_files,
)
from .codec import Code2Wav
from .codec_encoder import CodecEncoder, parse_codec_encoder_config
from .layers import fuse_projections
from .quant import check_mode as check_quantization
from .quant import quantize_
from .speaker_encoder import SpeakerEncoder
from .talker import Talker

SAMPLE_RATE = 24000
TEXT_TABLE = "model.text_embedding.weight"  # (talker.*) kept in host memory (load_checkpoint)


@dataclass(eq=False)
class Checkpoint:
    """What the engine and the input side need of one loaded checkpoint."""

    model_dir: Path
    cfg: ModelConfig
    speech_cfg: SpeechTokenizerConfig
    defaults: GenerationDefaults  # generation_config.json, with the loader's overrides laid over it
    talker: Talker  # talker + code predictor, on `device` in `dtype`
    code2wav: Code2Wav  # the 12 Hz decoder, same device and dtype
    tts_pad_embed: torch.Tensor  # [D] embedded tts_pad text token: the talker's text input once the text is used up
    device: torch.device
    dtype: torch.dtype
    sample_rate: int = SAMPLE_RATE
    quantization: str | None = None  # as loaded (q3tts.models.quant)

    @property
    def samples_per_frame(self) -> int:
        return self.code2wav.cfg.total_upsample  # 1920 at 24 kHz: one 80 ms frame


def load_checkpoint(name_or_path: str | os.PathLike, device: str | torch.device | None = None,
                    dtype: torch.dtype | str | None = None, quantization: str | None = None,
                    generation_config: dict | str | os.PathLike | None = None) -> Checkpoint:
    """Configs, talker and Code2Wav of a local directory or hub id (device: CUDA when available; dtype: bf16
    on CUDA, fp32 on CPU; quantization: see q3tts.models.quant; generation_config: defaults laid over the
    checkpoint's generation_config.json, see q3tts.config.generation_overrides). The cloning encoders are loaded
    separately, on first use."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quantization = check_quantization(quantization, device)  # a bad value fails before the weights are read
    overrides = generation_overrides(generation_config)  # so does a bad generation config
    d = resolve_model_dir(name_or_path)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg = parse_model_config(read_json(d / "config.json"))
    speech_cfg = parse_speech_tokenizer_config(read_json(d / "speech_tokenizer" / "config.json"))

    files = safetensors_files(d / "model")
    check_prefixes(files, ("talker.", "speaker_encoder."), str(d / "model.safetensors"))
    speech_files = safetensors_files(d / "speech_tokenizer" / "model")
    check_prefixes(speech_files, ("decoder.", "encoder."), f"{d}/speech_tokenizer/model.safetensors")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # this thread's device, for the loading threads
    code2wav_dtype = vocoder_dtype(device, dtype, quantization)
    # NOTE(load-once): the modules are built on the meta device in their final dtypes and take the checkpoint's
    # tensors as they are (assign), each read from the file once, cast and copied straight to where it lives (not
    # built and randomly initialised on the host, then overwritten, moved and cast). The reads and copies run on two
    # threads (they release the GIL) while this one builds the modules (the first meta tensor imports torch._dynamo).
    # On a GPU the text embedding table (151936 x 2048: 0.58 GiB in bf16, 30% of 0.6B's weights) stays in host
    # memory: a request looks up its few hundred rows once (streamed text: a few at a time) and only the [L, 2048]
    # result crosses to the device. A lookup is a copy, so nothing changes numerically.
    with ThreadPoolExecutor(2, thread_name_prefix="q3tts-load") as pool:
        talker_tensors = pool.submit(cast_tensors, read_tensors(files, "talker."), device, dtype,
                                     host=(TEXT_TABLE,))
        code2wav_tensors = pool.submit(cast_tensors, read_tensors(speech_files, "decoder."), device, code2wav_dtype)
        with torch.device("meta"):
            talker = Talker(cfg.talker).to(dtype)
            code2wav = Code2Wav(speech_cfg.decoder).to(code2wav_dtype)
        load_module(talker, talker_tensors.result(), f"{d}/model.safetensors (talker.*)", assign=True)
        load_module(code2wav, code2wav_tensors.result(), f"{d}/speech_tokenizer (decoder.*)", assign=True)
    talker.eval()
    code2wav.eval()
    if device.type == "cuda" or quantization:
        # one GEMM for q|k|v and for gate|up: 4 calls per layer instead of 7 (quantized CPU runs are not exact
        # anyway, and a per-row quantization is the same fused or not); one lookup for a frame's 16 codec embeddings
        # (the same values); the exact CPU path stays upstream-shaped
        fuse_projections(talker)
        talker.fuse_codec_embeddings()
    quantize_(talker, quantization, device)
    with torch.inference_mode():
        pad = talker.embed_text(torch.tensor([cfg.tts_pad_token_id]))[0]
    defaults = parse_generation_defaults(read_json(d / "generation_config.json"), overrides)
    return Checkpoint(d, cfg, speech_cfg, defaults, talker, code2wav, pad, device, dtype, quantization=quantization)


def vocoder_dtype(device: torch.device, dtype: torch.dtype, quantization: str | None) -> torch.dtype:
    """The model dtype, but bf16 for a quantized model on a CPU with AMX tiles (Intel Sapphire Rapids and later),
    where oneDNN runs bf16 convolutions on AMX (faster: bench/probe_cpu.py --vocoder). Quantized output is not
    exact anyway; unquantized, the CPU vocoder stays fp32 (exact), and so it does without AMX, where bf16
    convolutions are emulated (very slow)."""
    if quantization and device.type == "cpu" and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return torch.bfloat16
    return dtype


def _load_encoder(files_stem: Path, prefix: str, module: torch.nn.Module, what: str, device, dtype):
    tensors = read_tensors(safetensors_files(files_stem), prefix)
    if not tensors:
        raise ValueError(f"{files_stem}.safetensors has no {prefix}* weights: this checkpoint cannot clone "
                         f"voices ({what} missing; voice cloning needs the official Base checkpoint)")
    load_module(module, tensors, f"{files_stem}.safetensors ({prefix}*)")
    return module.to(device=device, dtype=dtype).eval()


def load_speaker_encoder(model_dir: Path, cfg: ModelConfig, device="cpu", dtype=torch.float32) -> SpeakerEncoder:
    """The ECAPA-TDNN x-vector encoder of a Base checkpoint (`speaker_encoder.*` in model.safetensors)."""
    return _load_encoder(Path(model_dir) / "model", "speaker_encoder.", SpeakerEncoder(cfg.speaker_encoder),
                         "speaker encoder", device, dtype)


def load_codec_encoder(model_dir: Path, speech_cfg: SpeechTokenizerConfig, device="cpu",
                       dtype=torch.float32) -> CodecEncoder:
    """The 12 Hz codec encoder (`encoder.*` in speech_tokenizer/model.safetensors): audio -> reference codes."""
    if not speech_cfg.encoder:
        raise ValueError(f"{model_dir}/speech_tokenizer/config.json has no encoder_config: "
                         "this checkpoint cannot encode reference audio")
    enc = CodecEncoder(parse_codec_encoder_config(speech_cfg.encoder),
                       num_codes=speech_cfg.encoder_valid_num_quantizers)
    return _load_encoder(Path(model_dir) / "speech_tokenizer" / "model", "encoder.", enc, "codec encoder", device,
                         dtype)
