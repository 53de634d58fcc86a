"""Find a checkpoint (local directory or Hugging Face repo id) and load safetensors into our modules.

Our module names equal the checkpoint keys, so the map is the identity per prefix:
  model.safetensors                   talker.*            -> Talker
                                      speaker_encoder.*   -> SpeakerEncoder (Base models)
  speech_tokenizer/model.safetensors  decoder.*           -> Code2Wav
                                      encoder.*           -> the codec encoder (voice cloning; loaded on demand)
Missing, unexpected or mis-shaped keys are errors that name the keys. Safetensors only: nothing is
ever unpickled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

REQUIRED_FILES = ("config.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                  "speech_tokenizer/config.json")
ALLOW_PATTERNS = ["*.json", "*.txt", "*.safetensors", "speech_tokenizer/*"]


def resolve_model_dir(name_or_path: str | os.PathLike, required: tuple[str, ...] = REQUIRED_FILES,
                      weights: tuple[str, ...] = ("model", "speech_tokenizer/model")) -> Path:
    """A local directory as is; otherwise a hub repo id fetched with huggingface_hub (honours HF_HOME,
    HF_HUB_OFFLINE and the usual cache). Checks that every file the engine reads is present (`required`, and the
    safetensors of each stem in `weights`: the defaults are a TTS checkpoint's)."""
    p = Path(name_or_path).expanduser()
    if not p.is_dir():
        if p.exists() or str(name_or_path).startswith((".", "/", "~")):
            raise FileNotFoundError(f"{name_or_path}: not a model directory")
        try:
            from huggingface_hub import snapshot_download
            p = Path(snapshot_download(repo_id=str(name_or_path), allow_patterns=ALLOW_PATTERNS))
        except Exception as e:  # network, auth, offline cache miss: say what was tried
            raise FileNotFoundError(
                f"could not find model {str(name_or_path)!r}: it is not a local directory and the Hugging Face "
                f"hub download failed ({type(e).__name__}: {e}). Pass a local directory in the official layout "
                f"(config.json, model.safetensors, speech_tokenizer/, tokenizer files).") from e
    missing = [f for f in required if not (p / f).exists()]
    for stem in weights:
        if not (p / f"{stem}.safetensors").exists() and not (p / f"{stem}.safetensors.index.json").exists():
            missing.append(f"{stem}.safetensors")
    if missing:
        raise FileNotFoundError(f"{p}: incomplete checkpoint, missing: {', '.join(missing)}")
    return p


def safetensors_files(path_without_ext: Path) -> list[Path]:
    """`x.safetensors`, or the shards listed in `x.safetensors.index.json`."""
    single = path_without_ext.with_name(path_without_ext.name + ".safetensors")
    if single.exists():
        return [single]
    index = json.loads(path_without_ext.with_name(path_without_ext.name + ".safetensors.index.json").read_text())
    return [single.parent / f for f in sorted(set(index["weight_map"].values()))]


def read_tensors(files: list[Path], prefix: str) -> dict[str, torch.Tensor]:
    """All tensors whose key starts with prefix, with the prefix stripped."""
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.startswith(prefix):
                    out[k[len(prefix):]] = sf.get_tensor(k)
    return out


def cast_tensors(tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 host: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The tensors on `device` (the keys in `host`: in host memory), the floating-point ones in `dtype`: what a module
    built on the meta device in `dtype` takes with load_module(..., assign=True), as Module.to(dtype) would have cast
    it. read_tensors' tensors map the file, so this is where it is read, once, straight into its place; its copies
    release the GIL, so it can run on a thread while the modules are built.
    NOTE(no-mmap): always a copy, also where the file's dtype and place are already right: no weight stays mapped to
    the file, whose pages the kernel may drop under memory pressure and read again from disk in a request."""
    def cast(t: torch.Tensor, dev) -> torch.Tensor:
        return t.to(dev, dtype if t.is_floating_point() else t.dtype, copy=True)
    return {k: cast(v, "cpu" if k in host else device) for k, v in tensors.items()}


def load_module(module: nn.Module, tensors: dict[str, torch.Tensor], where: str, assign: bool = False) -> None:
    """Copy tensors into module's parameters and persistent buffers; every key must match exactly. assign: the
    tensors become them (a module built on the meta device; cast_tensors made them in its dtypes)."""
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    bad_shape = sorted(k for k in set(own) & set(tensors) if tuple(own[k].shape) != tuple(tensors[k].shape))
    if missing or unexpected or bad_shape:
        def show(keys):
            return ", ".join(keys[:8]) + (f" ... ({len(keys)} in all)" if len(keys) > 8 else "")
        parts = []
        if missing:
            parts.append(f"missing keys: {show(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {show(unexpected)}")
        if bad_shape:
            parts.append("shape mismatches: " + ", ".join(
                f"{k} checkpoint {tuple(tensors[k].shape)} vs model {tuple(own[k].shape)}" for k in bad_shape[:8]))
        raise ValueError(f"{where}: checkpoint does not match the model config; " + "; ".join(parts))
    if assign:
        bad_dtype = sorted(k for k in own if own[k].dtype != tensors[k].dtype)  # (an integer tensor for a float one)
        if bad_dtype:
            raise ValueError(f"{where}: checkpoint dtypes do not match the model: " + ", ".join(
                f"{k} checkpoint {tensors[k].dtype} vs model {own[k].dtype}" for k in bad_dtype[:8]))
        # a parameter stored with other strides than the file's (q3tts.models.codec's taps-middle conv weights) keeps
        # them: its values are copied into that layout (on its device)
        module.load_state_dict({k: t if t.stride() == own[k].stride() else
                                torch.empty_strided(t.shape, own[k].stride(), dtype=t.dtype, device=t.device).copy_(t)
                                for k, t in tensors.items()}, strict=True, assign=True)
        return
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(tensors[k].to(v.dtype))


def check_prefixes(files: list[Path], allowed: tuple[str, ...], where: str) -> None:
    stray = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            stray += [k for k in sf.keys() if not k.startswith(allowed)]
    stray.sort()
    if stray:
        raise ValueError(f"{where}: unexpected keys outside {allowed}: {', '.join(stray[:8])}")
