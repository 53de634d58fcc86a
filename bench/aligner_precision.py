"""Why the aligner's padded pass (ForcedAligner(graphs=True)) can give other words than the eager pass in bf16:
both passes on the same random-weight checkpoint and the same utterances, in float32 and bfloat16, with the 24 ->
16 kHz resampling on the device (Polyphase) and on the CPU (soxr); on a CPU the padded pass runs uncaptured.

    python3 -m bench.aligner_precision --rows 4 --seconds 5 --out /tmp/precision.json     # real dimensions, CPU

Per dtype and padded variant, against the eager pass (and, in bf16, against the fp32 eager pass): rows with equal
words, the largest time difference, slots of another class, the largest differences of the mel, the encoder's
output and the <timestamp> logits; the median fp32 top-2 gap over all slots; for every slot whose class changed, the
two classes, its top-2 gap in fp32 and in this dtype, how far (logit[eager's class] - logit[padded's class]) moved
between the passes (a change needs a move past the gap; a move is at most twice the logits' difference), and how
many slots have an fp32 gap no larger than the largest changed one's. The checkpoint is written in bf16 (as
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

from bench.aligner import make_checkpoint, same_words, utterance
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


def rows_of_pass(seen: dict, rows: list[np.ndarray], frames: list[int], ts: int) -> list[dict]:
    """Each row's mel [mel, f], encoder output [n, D] and <timestamp> logits [m, classes], float32: the eager pass's
    cut out of its packed tensors, the padded pass's out of [B, ...]."""
    out = []
    if "lm" in seen:
        mel, audio = seen["enc"][0][0], seen["enc"][1]
        logits = seen["lm"][1]  # [M, classes], rows in order
        at_a = at_l = 0
        for b, (r, f) in enumerate(zip(rows, frames)):
            n, m = tokens_after_cnn(f), int((r == ts).sum())
            out.append(dict(mel=mel[b, :, :f], audio=audio[at_a:at_a + n], logits=logits[at_l:at_l + m]))
            at_a, at_l = at_a + n, at_l + m
    else:
        (mel, _mask), audio = seen["enc_padded"]
        logits = seen["lm_padded"][1]  # [B, S, classes]
        for b, (r, f) in enumerate(zip(rows, frames)):
            out.append(dict(mel=mel[b, :, :f], audio=audio[b, :tokens_after_cnn(f)],
                            logits=logits[b, :len(r)][torch.from_numpy(r == ts)]))
    return [{k: v.float() for k, v in d.items()} for d in out]


def compare(words_a, rows_a, words_b, rows_b) -> dict:
    """Two passes' words and per-row tensors: rows with equal words (and the largest time difference, as
    bench/aligner.py reports it), <timestamp> slots of another class, and the largest differences of the mel, the
    encoder's output and the logits."""
    def most(k):
        return max(float((x[k] - y[k]).abs().max()) for x, y in zip(rows_a, rows_b))
    return dict(**same_words(words_a, words_b),
                slots_differ=sum(int((x["logits"].argmax(-1) != y["logits"].argmax(-1)).sum())
                                 for x, y in zip(rows_a, rows_b)),
                mel_max_abs_diff=most("mel"), audio_max_abs_diff=most("audio"), logits_max_abs_diff=most("logits"))


def gap(logits: torch.Tensor) -> torch.Tensor:
    """[M, classes] -> [M]: top-1 minus top-2."""
    t = logits.topk(2, dim=-1).values
    return t[:, 0] - t[:, 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=("real", "tiny"), default="real")
    ap.add_argument("--rows", type=int, default=4, help="utterances, aligned as one batch (rows alone)")
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
        frames = [it.wav.shape[0] // 160 for it in items]
        prompts = eager._prompts(items, frames)
        r_e = rows_of_pass(seen, prompts, frames, ts)
        if eager32 is None:
            eager32 = (words_e, r_e)
        else:
            res["eager_vs_fp32_eager"] = compare(words_e, r_e, *eager32)
        for on_device in (True, False):
            seen.clear()
            fast = ForcedAligner(eager.thinker, eager.tokenizer, eager.cfg, eager.model_dir, graphs=True,
                                 resample_on_device=on_device)
            t0 = time.perf_counter()
            words_p = fast.align(wavs, sr, texts, "English", rows_alone=True)
            padded_s = round(time.perf_counter() - t0, 1)
            r_p = rows_of_pass(seen, prompts, frames, ts)
            v = dict(padded_s=padded_s, vs_eager=compare(words_p, r_p, words_e, r_e))
            if dtype != torch.float32:
                v["vs_fp32_eager"] = compare(words_p, r_p, *eager32)
            gaps32 = torch.cat([gap(x["logits"]) for x in eager32[1]])
            flips = []
            for b, (x, y) in enumerate(zip(r_e, r_p)):
                le, lp = x["logits"], y["logits"]
                ce, cp = le.argmax(-1), lp.argmax(-1)
                g32, g = gap(eager32[1][b]["logits"]), gap(le)
                for s in torch.nonzero(ce != cp).flatten().tolist():
                    e, p_ = int(ce[s]), int(cp[s])
                    # how far (logit[eager's class] - logit[padded's class]) moved between the passes
                    move = (le[s, e] - le[s, p_]) - (lp[s, e] - lp[s, p_])
                    flips.append(dict(row=b, slot=s, classes=(e, p_), gap_fp32=round(float(g32[s]), 4), gap=round(float(g[s]), 4),
                                      move=round(float(move), 4),
                                      logits_diff=round(float((le[s] - lp[s]).abs().max()), 4)))
            worst = max((f["gap_fp32"] for f in flips), default=0.0)
            v.update(slots=int(gaps32.numel()), median_gap_fp32=round(float(gaps32.median()), 4),
                     flips_max_gap_fp32=worst,
                     slots_gap_fp32_at_most_that=int((gaps32 <= worst).sum()) if flips else 0,
                     flips=flips)
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
