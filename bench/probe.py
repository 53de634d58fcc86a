"""Where the time goes (exploration, GPU): kernel profile of the captured frame, code-predictor variants,
vocoder step cost (eager vs graphed), prefill cost. Prints a JSON summary and the profiler tables.

    python -m bench.probe --ckpt /tmp/ck-0.6B-CustomVoice
"""

from __future__ import annotations

import argparse
import json
import time
import types

import torch
import torch.nn.functional as F

from bench.ours import graph_of, replay_ms, sync
from q3tts.models.layers import AttnContext, run_layers
from q3tts.models.talker import embed_prompt


def kernel_profile(fn, n=10, rows=25):
    from torch.profiler import ProfilerActivity, profile
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_call = len(kernels) / n
    busy_ms = sum(e.device_time for e in kernels) / 1000 / n
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=rows), flush=True)
    return {"kernels_per_call": per_call, "kernel_busy_ms_per_call": round(busy_ms, 3)}


def fused_cp(r, reduce_attention: bool):
    """A whole code-predictor step (layers + norm + head + sampler + next embedding) as one compiled function."""
    from q3tts.sampling import sample_topk
    cp = r.talker.code_predictor
    if reduce_attention:
        for layer in cp.model.layers:
            layer.self_attn.forward = types.MethodType(reduce_attn_forward, layer.self_attn)

    def step(x, cos, sin, kv, write_pos, mask, head_w, emb_w, dos, temp, topk, topp, noise):
        hid = cp(x, cos, sin, kv, AttnContext(write_pos, mask))[:, -1]
        logits = F.linear(hid, head_w).float()
        code = sample_topk(logits, dos, temp, topk, topp, noise)
        return code, F.embedding(code, emb_w)[:, None]

    step_c = torch.compile(step, fullgraph=True)

    def code_predictor(self, B, h, code0, capped):
        from q3tts.sampling import frame_noise
        p, rr = self.params, slice(0, B)
        kv = self.cp_kv[:, :, :B]
        frame = self.num_generated[rr] - 1
        noise_all = frame_noise(self.seed[rr], frame, cp.lm_head[0].out_features, 1, self.K - 1)
        x = torch.stack([h, self.talker.model.codec_embedding(code0)], dim=1)
        out = []
        for i in range(self.K - 1):
            sl = slice(0, 2) if i == 0 else slice(i + 1, i + 2)
            pos = self.cp_pos[sl][None].expand(B, -1)
            emb_w = cp.model.codec_embedding[min(i, self.K - 3)].weight
            code, x = step_c(x, self.cp_cos[:, sl], self.cp_sin[:, sl], kv, pos, self.cp_masks[i], cp.lm_head[i].weight,
                             emb_w, p["subtalker_dosample"][rr], p["subtalker_temperature"][rr],
                             p["subtalker_top_k"][rr], p["subtalker_top_p"][rr], noise_all[:, i])
            out.append(code)
        return torch.stack(out, dim=1)

    r._code_predictor = types.MethodType(code_predictor, r)


def reduce_attn_forward(self, x, cos, sin, k_cache, v_cache, ctx):
    """Attention over <= 16 positions as broadcast-multiply + sum (fusable reductions, no bmm)."""
    from q3tts.models.layers import apply_rope
    B, S, _ = x.shape
    H, Hkv, Dh = self.num_heads, self.num_kv_heads, self.head_dim
    q, k, v = F.linear(x, self.qkv_weight).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
    q = apply_rope(self.q_norm(q.view(B, S, H, Dh)).transpose(1, 2), cos, sin)
    k = apply_rope(self.k_norm(k.view(B, S, Hkv, Dh)).transpose(1, 2), cos, sin)
    idx = ctx.write_pos[:, None, :, None].expand(B, Hkv, S, Dh)
    k_cache.scatter_(2, idx, k.to(k_cache.dtype))
    v_cache.scatter_(2, idx, v.view(B, S, Hkv, Dh).transpose(1, 2).to(v_cache.dtype))
    n = ctx.mask.shape[-1]
    keys, values = k_cache[:, :, :n], v_cache[:, :, :n]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * S, Dh)
    scores = (qg[:, :, :, None, :].float() * keys[:, :, None, :, :].float()).sum(-1) * (Dh ** -0.5)
    mask = ctx.mask.expand(B, 1, S, n).repeat(1, 1, G, 1) if G > 1 else ctx.mask
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
    out = (probs[..., None].float() * values[:, :, None, :, :].float()).sum(-2).to(q.dtype).view(B, H, S, Dh)
    return self.o_proj(out.transpose(1, 2).reshape(B, S, H * Dh))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default="fused,fused_reduce")
    ap.add_argument("--sections", default="cp,prefill,vocoder")
    a = ap.parse_args()
    from q3tts import TTS
    from q3tts.engine.runner import ModelRunner
    from q3tts.models.layers import fuse_projections
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    tts = TTS.from_pretrained(a.ckpt, max_batch_size=64, max_seq_len=512)
    talker = tts.talker
    fuse_projections(talker)
    n = 256

    def new_runner(compile):
        return ModelRunner(talker, tts.tts_pad_embed, max_slots=64, max_len=512, compile=compile)

    def cp_times(r, tag):
        with torch.inference_mode():
            out = {}
            for B in (1, 64):
                t0 = time.perf_counter()
                g = graph_of(lambda: r._frame_codes(B, True))
                out[f"cp_graph_ms_b{B}"] = round(replay_ms(g), 3)
                out[f"compile_capture_s_b{B}"] = round(time.perf_counter() - t0, 1)
                if B == 1:
                    print(f"== {tag}: code predictor, batch 1 ==", flush=True)
                    out["profile_b1"] = kernel_profile(g.replay)
        print(tag, out, flush=True)
        return out

    # code-predictor variants first (each on uncompiled layers), then the shipped path
    for v in [x for x in a.variants.split(",") if x]:
        r = new_runner(False)
        fused_cp(r, reduce_attention=(v == "fused_reduce"))
        try:
            res[f"cp_{v}"] = cp_times(r, v)
        except Exception as e:  # an exploration: report, go on
            res[f"cp_{v}"] = {"error": repr(e)[:500]}
            print(v, "failed", repr(e)[:2000], flush=True)
        for layer in talker.code_predictor.model.layers:  # undo the attention patch
            layer.self_attn.__dict__.pop("forward", None)
        del r
        torch.cuda.empty_cache()
    r = new_runner(True)
    secs = a.sections.split(",")
    if "cp" in secs:
        res["cp_shipped"] = cp_times(r, "shipped")
    with torch.inference_mode():
        for B in ((1, 64) if "cp" in secs else ()):
            g = graph_of(lambda: r._frame_talker(B, n, True))
            res[f"talker_graph_ms_b{B}"] = round(replay_ms(g), 3)
            if B == 1:
                print("== talker step, batch 1 ==", flush=True)
                res["talker_profile_b1"] = kernel_profile(g.replay)
            g = graph_of(lambda: r._frame(B, n, True))
            res[f"frame_graph_ms_b{B}"] = round(replay_ms(g), 3)

    with torch.inference_mode():
      if "prefill" in secs:
        # prefill: one request (eager, compiled layers), as the engine does today
        pr = tts.prepare_custom_voice("Hello! This is a speed test of Qwen3 text to speech on a random-weight "
                                      "checkpoint, and every engine decodes exactly the same number of frames.",
                                      "ryan", "English")[0]
        pre, trail = embed_prompt(talker, pr.layout, pr.speaker_embedding, pr.ref_codes)
        res["prompt_len"] = pre.shape[0]
        for N in (1, 4, 16, 1, 4, 16):  # second round timed
            sync()
            t0 = time.perf_counter()
            r.prefill_batch(0, [pre] * N, [trail] * N, [pr.params] * N)
            sync()
            res[f"prefill_batch{N}_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        t0 = time.perf_counter()
        for _ in range(16):
            embed_prompt(talker, pr.layout, pr.speaker_embedding, pr.ref_codes)
        sync()
        res["embed_prompt_ms"] = round((time.perf_counter() - t0) / 16 * 1000, 3)

      if "vocoder" in secs:
        # vocoder: one decode_step, eager and graphed
        c2w = tts.code2wav
        voc = {}
        for B, t in ((1, 16), (16, 1), (64, 1)):
            st = c2w.init_state(B, "cuda", tts.dtype)
            codes = torch.randint(0, 2048, (B, 16, t), device="cuda")
            for _ in range(3):
                c2w.decode_step(codes, st)
            sync()
            t0 = time.perf_counter()
            for _ in range(10):
                c2w.decode_step(codes, st)
            sync()
            eager = (time.perf_counter() - t0) / 10 * 1000
            g = graph_of(lambda: c2w.decode_step(codes, st))
            voc[f"b{B}_t{t}"] = {"eager_ms": round(eager, 3), "graph_ms": round(replay_ms(g, 20), 3)}
            if (B, t) == (64, 1):
                print("== vocoder step b64 t1 (graph) ==", flush=True)
                voc["profile_b64_t1"] = kernel_profile(g.replay, n=5, rows=15)
            del g
        res["vocoder_step"] = voc
        # each convolution of one streaming step (batch 64, t = 1), alone
        shapes = []
        hooks = [m.register_forward_hook(lambda m, i, o: shapes.append((m, i[0].shape)))
                 for m in c2w.modules() if isinstance(m, torch.nn.Conv1d)]
        c2w.decode_step(torch.randint(0, 2048, (64, 16, 1), device="cuda"), c2w.init_state(64, "cuda", tts.dtype))
        for h in hooks:
            h.remove()
        convs = []
        for m, shp in shapes:
            x = torch.randn(shp, device="cuda", dtype=tts.dtype)
            g = graph_of(lambda: m(x))
            convs.append((round(replay_ms(g, 10) * 1000, 1), f"{m} in {tuple(shp)}"))
        res["vocoder_convs_b64_t1_us"] = sorted(convs, reverse=True)[:12]
    print(json.dumps(res, indent=1))
    if a.out:
        open(a.out, "w").write(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
