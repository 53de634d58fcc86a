"""How far quantized weights move the model, without real weights: one checkpoint, the unquantized model
against each quantization, on the same prompt.

    python -m bench.quant_quality --ckpt /tmp/ck06 --modes int8,int4 --frames 200          # CPU (fp32 base)
    python -m bench.quant_quality --ckpt /tmp/ck06 --device cuda --modes int8,fp8          # GPU (bf16 base)

Per mode:
- logits, teacher-forced on the unquantized model's greedy codes (every frame sees the same history):
  relative error = max |logits_q - logits| / max |logits| per frame (talker code-0 logits; code-predictor
  logits of codes 1..15), reported as the max and the median over frames; and how often the argmax agrees
  (code 0 over the codec range; all 16 codes of a frame).
- free-running greedy generation (do_sample off for both samplers, the engine as shipped): the fraction of
  the frames identical in all 16 codes, and the first frame that differs. Once one code differs the two
  continuations are different sequences, so this is mostly "how long until the first flip".
Random weights give flatter logits than trained ones (more near-ties), so agreement here is a pessimistic
stand-in; the relative errors transfer better. One JSON on stdout / --out.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.peers import DEFAULT_TEXT as TEXT
from q3tts.models.layers import AttnContext, rope_cos_sin, rope_inv_freq
from q3tts.models.talker import embed_prompt

GREEDY = dict(do_sample=False, subtalker_dosample=False, seed=0)


@torch.inference_mode()
def teacher_forced_logits(tts, prepared, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [T, K] (a trajectory) -> talker logits [T, V] and code-predictor logits [T, K-1, V_cp], fp32,
    from full causal forwards over the trajectory (equal to the engine's incremental decode)."""
    tk, cfg = tts.ckpt.talker, tts.cfg.talker
    dev, dt = tts.ckpt.device, tts.ckpt.dtype
    pr = prepared[0]
    pre, trail = embed_prompt(tk, pr.layout, pr.speaker_embedding, pr.ref_codes)
    T, K = codes.shape
    codes = codes.to(dev)
    frames = tk.embed_codes(codes[:-1])  # inputs after the prefill: frame t feeds the talker for frame t+1
    text = torch.stack([trail[t] if t < trail.shape[0] else tts.ckpt.tts_pad_embed for t in range(T - 1)]) if T > 1 \
        else frames[:0]
    x = torch.cat([pre.to(dt), frames + text.to(dt)])[None]  # [1, L + T - 1, D]
    S = x.shape[1]
    pos = torch.arange(S, device=dev)[None]
    kv = torch.zeros(cfg.num_hidden_layers, 2, 1, cfg.num_key_value_heads, S, cfg.head_dim, device=dev, dtype=dt)
    ctx = AttnContext(write_pos=pos, mask=(pos[0][None, :] <= pos[0][:, None])[None, None])
    cos, sin = rope_cos_sin(pos, rope_inv_freq(cfg.head_dim, cfg.rope_theta).to(dev), dt)
    hid = tk(x, cos, sin, kv, ctx)[0, pre.shape[0] - 1:]  # [T, D]: hidden that predicts each frame's code 0
    talker_logits = tk.codec_head(hid).float()
    cp, cpc = tk.code_predictor, cfg.code_predictor
    embs = [tk.model.codec_embedding(codes[:, 0])] + [cp.model.codec_embedding[i](codes[:, i + 1]) for i in range(K - 2)]
    y = torch.stack([hid] + embs, dim=1)  # [T, K, D]: [h, e0(c0), e1(c1), ..., e14(c14)]
    pos = torch.arange(K, device=dev)[None].expand(T, -1)
    kv = torch.zeros(cpc.num_hidden_layers, 2, T, cpc.num_key_value_heads, K, cpc.head_dim, device=dev, dtype=dt)
    ctx = AttnContext(write_pos=pos, mask=(pos[0][None, :] <= pos[0][:, None])[None, None])
    cos, sin = rope_cos_sin(pos, rope_inv_freq(cpc.head_dim, cpc.rope_theta).to(dev), dt)
    h = cp(y, cos, sin, kv, ctx)  # [T, K, D_cp]; position i+1 predicts code i+1
    cp_logits = torch.stack([cp.lm_head[i](h[:, i + 1]) for i in range(K - 1)], dim=1).float()
    return talker_logits, cp_logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per frame (dim 0): max |a - b| / max |b|."""
    d = (a - b).abs().flatten(1).amax(1)
    return d / b.abs().flatten(1).amax(1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="int8,int4")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--speaker", default="ryan")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from q3tts import TTS
    N = a.frames
    kw = dict(speaker=a.speaker, language="English", max_new_tokens=N + 1, **GREEDY)
    t0 = time.perf_counter()
    base = TTS.from_pretrained(a.ckpt, device=a.device, max_batch_size=1, max_seq_len=512, compile=False)
    pr = base.prepare_custom_voice(TEXT, **kw)
    ref_codes = base.generate_codes(pr)[0][:N]  # [N, K]
    ref_t, ref_c = teacher_forced_logits(base, pr, ref_codes)
    V = base.cfg.talker.vocab_size
    res = {"ckpt": a.ckpt, "device": a.device, "dtype": str(base.ckpt.dtype), "frames": int(ref_codes.shape[0]),
           "torch": torch.__version__, "modes": {}}
    for mode in a.modes.split(","):
        tts = TTS.from_pretrained(a.ckpt, device=a.device, max_batch_size=1, max_seq_len=512, compile=False,
                                  quantization=mode)
        q_t, q_c = teacher_forced_logits(tts, pr, ref_codes)
        et, ec = rel_err(q_t, ref_t), rel_err(q_c, ref_c)
        code0_ok = (q_t[:, :V - 1024].argmax(-1) == ref_t[:, :V - 1024].argmax(-1))
        frame_ok = code0_ok & (q_c.argmax(-1) == ref_c.argmax(-1)).all(-1)
        codes = tts.generate_codes(tts.prepare_custom_voice(TEXT, **kw))[0][:N]
        same = (codes == ref_codes).all(-1)
        first = int((~same).nonzero()[0, 0]) if not bool(same.all()) else None
        res["modes"][mode] = dict(
            talker_logits_rel_err_max=round(float(et.max()), 5), talker_logits_rel_err_median=round(float(et.median()), 5),
            cp_logits_rel_err_max=round(float(ec.max()), 5), cp_logits_rel_err_median=round(float(ec.median()), 5),
            teacher_forced_code0_argmax_agree=round(float(code0_ok.float().mean()), 4),
            teacher_forced_frame_argmax_agree=round(float(frame_ok.float().mean()), 4),
            greedy_frames_identical=round(float(same.float().mean()), 4), greedy_first_different_frame=first)
        print(mode, json.dumps(res["modes"][mode]), flush=True)
        del tts
    res["seconds"] = round(time.perf_counter() - t0, 1)
    out = json.dumps(res, indent=1)
    if a.out:
        open(a.out, "w").write(out)
    print(out)
    print("\n| quantization | talker logits rel. err max / median | code-predictor logits rel. err max / median | "
          "teacher-forced frames argmax-equal | greedy frames identical (first differing) |\n|---|---|---|---|---|")
    for m, r in res["modes"].items():
        print(f"| {m} | {r['talker_logits_rel_err_max']} / {r['talker_logits_rel_err_median']} | "
              f"{r['cp_logits_rel_err_max']} / {r['cp_logits_rel_err_median']} | {r['teacher_forced_frame_argmax_agree']} | "
              f"{r['greedy_frames_identical']} ({r['greedy_first_different_frame']}) |")


if __name__ == "__main__":
    main()
