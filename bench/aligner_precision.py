"""Why the aligner's padded pass (ForcedAligner(graphs=True)) can give other words than the eager pass in bf16:
both passes on the same random-weight checkpoint and the same utterances, in float32 and bfloat16, with the 24 ->
16 kHz resampling on the device (Polyphase) and on the CPU (soxr); on a CPU the padded pass runs uncaptured.

    python3 -m bench.aligner_precision --rows 4 --seconds 5 --out /tmp/precision.json     # real dimensions, CPU

Per dtype, variant and row: words equal to the eager pass's; the largest difference padded vs eager of the mel
features, of the audio encoder's output and of the logits at the <timestamp> slots; the smallest top-2 gap of the
eager logits at those slots (float32 and this dtype); and for every slot whose class differs, its top-2 gap beside
how much (logit[eager's class] - logit[padded's class]) moved between the passes. Rounding explains a flip whose
gap is below the move, the move being within twice the logits' difference. The checkpoint is written in bf16 (as
bench/aligner.py writes it for a GPU), so both dtypes run the same weight values.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.aligner import make_checkpoint, utterance
from q3tts.align import ForcedAligner
from q3tts.models.audio_encoder import tokens_after_cnn


def record(thinker) -> dict:
    """Wrap the thinker's and its audio encoder's entry points (instance attributes shadow the methods): the dict
    returned holds each one's last (args, output) under "lm", "lm_padded", "enc", "enc_padded"."""
    seen = {}
    for obj, name, key in ((thinker, "forward", "lm"), (thinker, "forward_padded", "lm_padded"),
                           (thinker.audio_tower, "forward", "enc"), (thinker.audio_tower, "forward_padded",
                                                                       "enc_padded")):
        def f(*args, _orig=getattr(type(obj), name), _obj=obj, _key=key):
            out = _orig(_obj, *args)
            seen[_key] = (args, out)
            return out
        setattr(obj, name, f)
    return seen


def rows_of_pass(seen: dict, rows: list[np.ndarray], ts: int) -> list[dict]:
    """Each row's mel [mel, f], encoder output [n, D] and <timestamp> logits [m, classes], float32: the eager pass's
    cut out of its packed tensors, the padded pass's out of [B, ...]."""
    out = []
    if "lm" in seen:
        (mel, frames), audio = seen["enc"]
        logits = seen["lm"][1]  # [M, classes], rows in order
        at_a = at_l = 0
        for b, (r, f) in enumerate(zip(rows, frames)):
            n, m = tokens_after_cnn(f), int((r == ts).sum())
            out.append(dict(mel=mel[b, :, :f], audio=audio[at_a:at_a + n], logits=logits[at_l:at_l + m]))
            at_a, at_l = at_a + n, at_l + m
    else:
        (mel, _mask), audio = seen["enc_padded"]
        logits = seen["lm_padded"][1]  # [B, S, classes]
        for b, r in enumerate(rows):
            out.append(dict(mel=mel[b], audio=audio[b], logits=logits[b, :len(r)][torch.from_numpy(r == ts)]))
    return [{k: v.float() for k, v in d.items()} for d in out]


def gap(logits: torch.Tensor) -> torch.Tensor:
    """[M, classes] -> [M]: top-1 minus top-2."""
    t = logits.topk(2, dim=-1).values
    return t[:, 0] - t[:, 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=("real", "tiny"), default="real")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sr = 24000
    utts = [utterance(a.seconds, sr, i) for i in range(a.rows)]
    wavs, texts = [w for w, _ in utts], [t for _, t in utts]
    ckpt = make_checkpoint(a.size, Path(tempfile.mkdtemp(prefix="q3tts-aligner-prec-")), torch.bfloat16)
    result: dict = dict(size=a.size, rows=a.rows, seconds=a.seconds, words_per_row=len(texts[0].split()))
    eager32 = None  # the fp32 eager pass: (words, per-row tensors)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        eager = ForcedAligner.from_pretrained(ckpt, device="cpu", dtype=dtype)
        seen = record(eager.thinker)
        ts = eager.cfg.timestamp_token_id
        t0 = time.perf_counter()
        words_e = eager.align(wavs, sr, texts, "English", rows_alone=True)
        res: dict = dict(eager_s=round(time.perf_counter() - t0, 1))
        items = [eager._item(w, sr, t, "English", i) for i, (w, t) in enumerate(zip(wavs, texts))]
        prompts = eager._prompts(items, [it.wav.shape[0] // 160 for it in items])
        r_e = rows_of_pass(seen, prompts, ts)
        if eager32 is None:
            eager32 = (words_e, r_e)
        else:
            res["eager_vs_fp32_eager"] = dict(
                rows_equal=sum(x == y for x, y in zip(words_e, eager32[0])),
                slots_differ=sum(int((x["logits"].argmax(-1) != y["logits"].argmax(-1)).sum())
                                 for x, y in zip(r_e, eager32[1])),
                logits_max_abs_diff=max(float((x["logits"] - y["logits"]).abs().max()) for x, y in zip(r_e, eager32[1])))
        for on_device in (True, False):
            seen.clear()
            fast = ForcedAligner(eager.thinker, eager.tokenizer, eager.cfg, eager.model_dir, graphs=True,
                                 resample_on_device=on_device)
            t0 = time.perf_counter()
            words_p = fast.align(wavs, sr, texts, "English", rows_alone=True)
            v = dict(padded_s=round(time.perf_counter() - t0, 1), rows=[])
            r_p = rows_of_pass(seen, prompts, ts)
            for b, (x, y) in enumerate(zip(r_e, r_p)):
                f = x["mel"].shape[1]
                le, lp = x["logits"], y["logits"]
                ce, cp = le.argmax(-1), lp.argmax(-1)
                flips = torch.nonzero(ce != cp).flatten()
                g32 = gap(eager32[1][b]["logits"])
                g = gap(le)
                # the move of (eager's class - padded's class) between the passes, at each flipped slot
                i = flips
                move = (le[i, ce[i]] - le[i, cp[i]]) - (lp[i, ce[i]] - lp[i, cp[i]])
                v["rows"].append(dict(
                    words_equal=words_e[b] == words_p[b], slots=int(le.shape[0]), slots_differ=int(flips.numel()),
                    mel_max_abs_diff=float((x["mel"] - y["mel"][:, :f]).abs().max()),
                    audio_max_abs_diff=float((x["audio"] - y["audio"][:x["audio"].shape[0]]).abs().max()),
                    audio_max_abs=float(x["audio"].abs().max()),
                    logits_max_abs_diff=float((le - lp).abs().max()), logits_max_abs=float(le.abs().max()),
                    min_gap_fp32=float(g32.min()), min_gap=float(g.min()),
                    flips=[dict(slot=int(s), gap_fp32=round(float(g32[s]), 4), gap=round(float(g[s]), 4),
                                move=round(float(mv), 4), logits_diff=round(float((le[s] - lp[s]).abs().max()), 4))
                           for s, mv in zip(flips.tolist(), move.tolist())]))
            v["rows_equal"] = sum(r["words_equal"] for r in v["rows"])
            res[f"padded_resample_on_device_{on_device}"] = v
            print(json.dumps({name: {f"padded_resample_on_device_{on_device}": v}}), flush=True)
        result[name] = res
        del eager, fast, seen
    line = json.dumps(result)
    print(line)
    if a.out:
        Path(a.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
