"""A compile helper's process (q3tts.engine.compile_helpers): python -m q3tts.engine.helper_process, reading one line
from its stdin: the JSON that compile_helpers.Helpers writes ({"source": Source's fields, "units": warm-up names,
"batch_invariant": bool, "cache_dir": the compile cache's directory}); none (the end of its stdin): exit. Reports
'start NAME' and 'done NAME' per warm-up on its stdout."""

from __future__ import annotations

import json
import sys

import torch

from .. import invariant
from ..models.loaders import load_checkpoint
from .compile import precompiling
from .compile_helpers import KERNELS, VOCODER, Source
from .graphs import side_stream, warm_ups
from .runner import ModelRunner
from .vocoder import StreamingVocoder


def main(spec: dict) -> None:
    """A helper: load the checkpoint, build the runner, run its warm-ups (the runner's, or the vocoder's), exit (no
    capture, nothing served)."""
    invariant.set_enabled(spec["batch_invariant"])
    s = Source(**spec["source"])
    ckpt = load_checkpoint(s.model_dir, s.device, s.dtype, s.quantization)
    runner = ModelRunner(ckpt.talker, ckpt.tts_pad_embed, max_slots=s.max_slots, max_len=s.max_len,
                         use_cuda_graphs=True, compile=True, compile_cache=spec.get("cache_dir") or False)
    units = dict(warm_ups(runner))
    # the engine's vocoder's rows, its pre-transformer compiled as the engine's
    units[VOCODER] = lambda: StreamingVocoder(ckpt.code2wav, s.max_slots, compiled=True).warm_up()
    units[KERNELS] = lambda: eager_frames(runner)
    with precompiling(), torch.inference_mode(), side_stream():
        for name in spec["units"]:
            print("start", name, flush=True)
            warm_up, _, half = name.partition(":")  # a frame's half (compile_helpers.halves): warm_up_frames' own
            if half:
                units[warm_up](half=half)
            else:
                units[warm_up]()
            torch.cuda.synchronize()
            print("done", name, flush=True)


def eager_frames(runner: ModelRunner) -> None:
    """One frame of one row per sampler at the shortest span, every compiled function run uncompiled: the same calls
    of q3tts's kernels as the compiled one-row frames make (the same shapes, dtypes and alignments), so Triton
    compiles them into its cache without waiting for Inductor."""
    n = min(n for _, n, _ in runner.graph_keys())
    with torch.compiler.set_stance("force_eager"):
        runner.warm_up_frames([(1, n, False), (1, n, True)])


if __name__ == "__main__":
    import torch._inductor.compile_fx  # noqa: F401 (imported while waiting: the first compilation's imports)
    line = sys.stdin.readline()
    if line.strip():
        main(json.loads(line))
