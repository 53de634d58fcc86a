"""Rebuild the tiny checkpoints recorded by make_golden.py and read the official outputs."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import load_file

from q3tts import randomckpt

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
REFERENCE = HERE.parents[1] / "q3tts" / "reference"
VARIANTS = sorted(p.name for p in FIXTURES.iterdir() if (p / "manifest.json").exists()) if FIXTURES.exists() else []
_TMP = Path(tempfile.mkdtemp(prefix="q3tts-golden-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)  # the rebuilt checkpoints go when the test run ends


@lru_cache(maxsize=None)
def manifest(variant: str) -> dict:
    return json.loads((FIXTURES / variant / "manifest.json").read_text())


@lru_cache(maxsize=None)
def outputs(variant: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / variant / "outputs.safetensors"))


@lru_cache(maxsize=None)
def checkpoint(variant: str) -> Path:
    """Write the variant's checkpoint (same recipe as the fixture) and check it is bit-identical."""
    m = manifest(variant)
    out = _TMP / variant
    digests = randomckpt.write_checkpoint(
        out, m["config"], m["speech_config"], m["shapes"], m["speech_shapes"], REFERENCE / "tokenizer",
        m["generation_config"], seed=m["seed"], tweaks=m["tweaks"])
    assert digests == m["digests"], f"{variant}: rebuilt checkpoint differs from the fixture's (recipe or RNG drift)"
    return out


@lru_cache(maxsize=None)
def tts(variant: str):
    from q3tts import TTS
    return TTS.from_pretrained(checkpoint(variant), device="cpu", dtype=torch.float32)


def case_prompt_items(variant: str, case: dict) -> list:
    from q3tts import VoiceClonePromptItem
    t = outputs(variant)
    items = []
    for j, (mode, _, _) in enumerate(case["prompt"]):
        items.append(VoiceClonePromptItem(
            ref_code=t.get(f"{case['name']}.ref_code.{j}"), ref_spk_embedding=t[f"{case['name']}.ref_spk_embedding.{j}"],
            x_vector_only_mode=mode == "xvec", icl_mode=mode == "icl", ref_text=case["prompt_ref_text"][j]))
    return items


def all_cases() -> list[tuple[str, str]]:
    return [(v, c["name"]) for v in VARIANTS for c in manifest(v)["cases"]]


def get_case(variant: str, name: str) -> dict:
    return next(c for c in manifest(variant)["cases"] if c["name"] == name)
