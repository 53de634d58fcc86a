"""Write a random-weight Qwen3-TTS checkpoint at the real dimensions, in the official layout.

    python -m bench.make_checkpoint --model 0.6B-CustomVoice --out /tmp/ckpt-0.6B

Names and shapes come from `q3tts/reference/<model>.state_dict_shapes.tsv` (derived from the official
classes, see ../shared/reference/models/_derived) and `Qwen3-TTS-Tokenizer-12Hz.state_dict_shapes.tsv`;
configs, tokenizer files and the generation config from `q3tts/reference/`. The main model is written in
bf16 and the speech tokenizer in fp32, as upstream ships them. Default tweaks: `eos_zero` (the EOS row of
codec_head is zero, so no engine ever stops early: every run decodes exactly the frames it is asked for)
and `output_conv_scale` (waveform inside (-1, 1), as in the golden fixtures). Weight values do not change
speed. Prints one JSON line (recipe + sha256 digests) and writes it to `<out>/bench_checkpoint.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from q3tts.randomckpt import write_checkpoint

REFERENCE = Path(__file__).resolve().parents[1] / "q3tts" / "reference"
MODELS = ("0.6B-CustomVoice", "1.7B-CustomVoice")
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


def make(model: str, out: str | Path, seed: int = 0, tweaks: dict | None = None,
         dtype: torch.dtype = torch.bfloat16) -> dict:
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, default="0.6B-CustomVoice")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="main model dtype (the speech tokenizer is always fp32)")
    ap.add_argument("--tweaks", default=None, help=f"JSON dict of randomckpt tweaks (default {DEFAULT_TWEAKS})")
    a = ap.parse_args(argv)
    tweaks = json.loads(a.tweaks) if a.tweaks else None
    print(json.dumps(make(a.model, a.out, a.seed, tweaks, getattr(torch, a.dtype))))


if __name__ == "__main__":
    main()
