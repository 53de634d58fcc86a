"""Write random-weight checkpoints in the official Qwen3-TTS layout.

Used by the golden-fixture script (tiny models checked against the official package), the CPU tests
(which rebuild the very same tiny checkpoints), `q3tts make-checkpoint --tiny` (`make_tiny`: an offline
model of each type to try the CLI and server with) and `q3tts bench` (real dimensions; weight values do
not change speed). Every tensor is drawn from its own generator seeded by (seed, tensor name), so a
checkpoint is a pure function of (names and shapes, seed, tweaks): fixtures commit that recipe, not
megabytes of weights.

The values are chosen so nothing is hidden by zeros or clamping: norms near 1, peaky output heads
(greedy decoding is then stable against rounding), codebooks and SnakeBeta parameters away from
their degenerate inits, and a small last vocoder conv so the waveform stays inside (-1, 1).

This module imports only torch, safetensors and the standard library so the oracle venv can load it
by file path.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def init_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) * 1000003 + seed) % (2**63))
    if dtype in (torch.int64, torch.int32):  # BatchNorm num_batches_tracked
        return torch.zeros(shape, dtype=dtype)
    r = torch.randn(shape, generator=g, dtype=torch.float32)
    leaf = name.rsplit(".", 1)[-1]
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    if leaf == "running_var":
        t = torch.rand(shape, generator=g) + 0.5
    elif leaf == "running_mean":
        t = 0.1 * r
    elif leaf == "cluster_usage":  # codebook usage counts: positive
        t = torch.rand(shape, generator=g) * 0.5 + 0.75
    elif leaf == "embedding_sum":
        t = r
    elif leaf in ("alpha", "beta"):  # SnakeBeta log-parameters
        t = 0.1 * r
    elif leaf in ("scale", "gamma"):  # LayerScale / ConvNeXt gamma: real init ~1e-2 / 1e-6 would hide blocks
        t = 0.1 + 0.05 * r
    elif leaf == "weight" and len(shape) == 1:  # RMSNorm / LayerNorm / BatchNorm weights
        t = 1.0 + 0.1 * r
    elif leaf == "bias":
        t = 0.02 * r
    elif "embedding" in name and len(shape) == 2:  # text / codec embeddings
        t = 0.5 * r
    elif "codec_head" in name or "lm_head" in name:  # peaky logits: greedy argmax far from ties
        t = 4.0 * r / math.sqrt(fan_in)
    else:
        t = r / math.sqrt(fan_in)
    return t.to(dtype)


def build_state_dict(shapes: dict[str, tuple[tuple[int, ...], str]], seed: int) -> dict[str, torch.Tensor]:
    """shapes: name -> (shape, dtype name such as 'float32')."""
    return {n: init_tensor(n, tuple(s), getattr(torch, d), seed) for n, (s, d) in sorted(shapes.items())}


def apply_tweaks(sd: dict[str, torch.Tensor], tweaks: dict, eos_id: int | None = None) -> None:
    """Deterministic edits on top of the recipe.

    - output_conv_scale: multiply the last vocoder conv (keeps the waveform well inside (-1, 1)).
    - eos_copy_from / eos_scale: make the EOS row of codec_head a scaled copy of another code's row,
      so greedy decoding stops where it would otherwise pick that code (tests EOS handling).
    - eos_gain: multiply the EOS row of codec_head: its logit then tops the random ones now and then, so a tiny
      model stops by itself after a few to a few dozen frames (greedy or sampled), as a real one does.
    - eos_zero: zero the EOS row of codec_head; its logit is then always 0, never in the top-k (or the
      argmax) of the peaky random logits, so every engine decodes exactly max_new_tokens frames (benchmarks).
    """
    if "output_conv_scale" in tweaks:
        last = max((k for k in sd if k.startswith("decoder.decoder.") and k.endswith(".conv.weight")),
                   key=lambda k: int(k.split(".")[2]))
        sd[last] = sd[last] * tweaks["output_conv_scale"]
    if "eos_copy_from" in tweaks:
        w = sd["talker.codec_head.weight"]
        w[eos_id] = w[tweaks["eos_copy_from"]] * tweaks.get("eos_scale", 1.05)
    if "eos_gain" in tweaks:
        sd["talker.codec_head.weight"][eos_id] *= tweaks["eos_gain"]
    if tweaks.get("eos_zero"):
        sd["talker.codec_head.weight"][eos_id] = 0.0


def digest(sd: dict[str, torch.Tensor]) -> str:
    """sha256 over names and raw bytes: detects a recipe (or RNG) drift between fixture and test."""
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_checkpoint(
    out_dir: str | Path,
    config: dict,
    speech_config: dict,
    shapes: dict,
    speech_shapes: dict,
    tokenizer_dir: str | Path,
    generation_config: dict,
    seed: int = 0,
    tweaks: dict | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, str]:
    """Write a complete model directory; returns the digests of both weight files."""
    out = Path(out_dir)
    (out / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    tweaks = tweaks or {}
    sd = build_state_dict(shapes, seed)
    ssd = build_state_dict(speech_shapes, seed + 1)
    apply_tweaks(sd, {k: v for k, v in tweaks.items() if k != "output_conv_scale"},
                 eos_id=config["talker_config"]["codec_eos_token_id"])
    apply_tweaks(ssd, {k: v for k, v in tweaks.items() if k == "output_conv_scale"})
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    digests = {"model": digest(sd), "speech_tokenizer": digest(ssd)}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(ssd, str(out / "speech_tokenizer" / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    (out / "speech_tokenizer" / "config.json").write_text(json.dumps(speech_config, indent=2))
    (out / "speech_tokenizer" / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "padding_side": "right",
        "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": 24000,
        "chunk_length_s": None, "overlap": None}, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "padding_side": "left", "padding_value": 0.0, "processor_class": "Qwen3TTSProcessor",
        "return_attention_mask": True}, indent=2))
    for f in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / f, out / f)
    return digests


# --------------------------------------------------------------------------- tiny checkpoints to try things with
MODEL_TYPES = ("custom_voice", "base", "voice_design")
TINY_TWEAKS = {"output_conv_scale": 0.015, "eos_gain": 2.5}  # quiet enough, and it stops by itself
TINY_MAX_NEW_TOKENS = 256  # its generation_config's cap: at most ~20 s of audio per request


def make_tiny(out_dir: str | Path, model_type: str = "custom_voice", seed: int | None = None) -> dict[str, str]:
    """Write a tiny random checkpoint (a few MB, seconds on a CPU) of one model type: the golden fixtures' tiny
    dimensions, the real tokenizer, speakers and languages, random weights whose EOS can win (so it ends within
    a few dozen frames) and noise for speech. For trying the CLI, the server and the page offline.

    Args:
        out_dir: the directory to write (created).
        model_type: custom_voice (0.6B-like, with the real speakers), base (voice cloning) or voice_design.
        seed: the weights' seed (default: the fixtures').
    Returns the digests of the two weight files."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown model type {model_type!r}; one of {', '.join(MODEL_TYPES)}")
    ref = Path(__file__).resolve().parent / "reference"
    recipe = json.loads((ref / "tiny.json").read_text())
    model = recipe["models"][model_type]
    gen = dict(recipe["generation_config"], max_new_tokens=TINY_MAX_NEW_TOKENS)
    return write_checkpoint(out_dir, model["config"], recipe["speech_config"], model["shapes"], recipe["speech_shapes"],
                            ref / "tokenizer", gen, seed=recipe["seed"] if seed is None else seed, tweaks=TINY_TWEAKS)


# --------------------------------------------------------------------------- forced aligner (Qwen3-ASR layout)
# The aligner's special tokens at the ids third-party ports of Qwen/Qwen3-ForcedAligner-0.6B use (its own
# tokenizer files are not in our reference set): they extend the Qwen2 BPE of the TTS checkpoints.
ALIGNER_SPECIAL_IDS = {"<|audio_start|>": 151669, "<|audio_end|>": 151670, "<|audio_pad|>": 151676,
                       "<timestamp>": 151705}


def aligner_tokenizer_config(tts_tokenizer_config: dict) -> dict:
    """tokenizer_config.json for an aligner checkpoint: the TTS tokenizer's entries up to <|audio_end|>, reserved
    fillers, then <|audio_pad|> and <timestamp> at the ids of ALIGNER_SPECIAL_IDS."""
    added = {k: v for k, v in tts_tokenizer_config["added_tokens_decoder"].items() if int(k) <= 151670}
    by_id = {i: t for t, i in ALIGNER_SPECIAL_IDS.items()}
    for i in range(151671, max(by_id) + 1):
        content = by_id.get(i, f"<|asr_reserved_{i}|>")
        added[str(i)] = {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True}
    cfg = dict(tts_tokenizer_config, added_tokens_decoder=added)
    cfg["additional_special_tokens"] = [t for t in cfg["additional_special_tokens"] if not t.startswith("<tts")]
    cfg["additional_special_tokens"].append("<timestamp>")
    return cfg


def write_aligner_checkpoint(out_dir: str | Path, config: dict, shapes: dict, tokenizer_dir: str | Path,
                             preprocessor_config: dict, seed: int = 0, tweaks: dict | None = None,
                             dtype: torch.dtype | None = None) -> str:
    """A forced-aligner directory (config.json, preprocessor_config.json, tokenizer files, model.safetensors with
    `thinker.*` keys); returns the weights' digest.

    tweaks: `timestamp_embed_scale` scales the <timestamp> row of the token embedding; small, the hidden state at a
    timestamp slot comes mostly from what it attends to (audio, words, position), so the random model's classes vary
    along the text instead of repeating one class.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = build_state_dict(shapes, seed)
    if "timestamp_embed_scale" in (tweaks or {}):
        sd["thinker.model.embed_tokens.weight"][config["timestamp_token_id"]] *= tweaks["timestamp_embed_scale"]
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config, indent=2))
    for f in ("vocab.json", "merges.txt"):
        shutil.copyfile(Path(tokenizer_dir) / f, out / f)
    tok = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
    (out / "tokenizer_config.json").write_text(json.dumps(aligner_tokenizer_config(tok), indent=2, ensure_ascii=False))
    return digest(sd)


# ---------------------------------------------------------------------------------- real dimensions
REFERENCE = Path(__file__).resolve().parent / "reference"  # the real configs, shapes and tokenizer files
MODELS = ("0.6B-CustomVoice", "1.7B-CustomVoice", "0.6B-Base", "1.7B-Base", "1.7B-VoiceDesign")
DEFAULT_TWEAKS = {"eos_zero": True, "output_conv_scale": 0.015}


def read_shapes(path: Path) -> dict[str, tuple[list[int], str]]:
    """Parse a state_dict_shapes.tsv (name<TAB>AxBxC<TAB>numel; '#' comments; a header line)."""
    shapes: dict[str, tuple[list[int], str]] = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, shape = line.split("\t")[:2]
        if name == "name":  # header
            continue
        dims = [int(d) for d in shape.split("x")] if shape else []
        shapes[name] = (dims, "int64" if name.endswith("num_batches_tracked") else "float32")
    return shapes


def make_checkpoint(model: str, out: str | Path, seed: int = 0, tweaks: dict | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> dict:
    """A random-weight checkpoint of `model` (MODELS) at the real dimensions in the official layout under `out`
    (main model in dtype, speech tokenizer in fp32, as upstream ships them) -> its recipe and sha256 digests, also
    written to <out>/bench_checkpoint.json. Default tweaks: `eos_zero` (the EOS row of codec_head is zero: every run
    decodes exactly the frames it is asked for) and `output_conv_scale` (waveform inside (-1, 1))."""
    tweaks = dict(DEFAULT_TWEAKS if tweaks is None else tweaks)
    config = json.loads((REFERENCE / f"{model}.config.json").read_text())
    speech_config = json.loads((REFERENCE / "speech_tokenizer.config.json").read_text())
    generation_config = json.loads((REFERENCE / "generation_config.json").read_text())
    shapes = read_shapes(REFERENCE / f"{model}.state_dict_shapes.tsv")
    speech_shapes = read_shapes(REFERENCE / "Qwen3-TTS-Tokenizer-12Hz.state_dict_shapes.tsv")
    t0 = time.perf_counter()
    digests = write_checkpoint(out, config, speech_config, shapes, speech_shapes, REFERENCE / "tokenizer",
                               generation_config, seed=seed, tweaks=tweaks, dtype=dtype)
    info = dict(model=model, out=str(out), seed=seed, tweaks=tweaks, dtype=str(dtype).removeprefix("torch."),
                speech_tokenizer_dtype="float32", n_tensors=len(shapes),
                n_params=sum(int(torch.Size(s).numel()) for s, _ in shapes.values()),
                digests=digests, seconds=round(time.perf_counter() - t0, 1))
    (Path(out) / "bench_checkpoint.json").write_text(json.dumps(info, indent=2))
    return info
