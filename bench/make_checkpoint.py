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

import torch

from q3tts.randomckpt import DEFAULT_TWEAKS, MODELS
from q3tts.randomckpt import make_checkpoint as make


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
