"""Batch invariance on a GPU: is a request's output the same alone as beside others? Prints a table last.

    python -m bench.invariance --models 0.6B-CustomVoice,1.7B-CustomVoice --frames 40
    python -m bench.invariance --models 1.7B-Base,1.7B-VoiceDesign --frames 24 --skip-kernels

Checks, bf16, random weights at the real dimensions (bench.make_checkpoint: no early EOS, so lengths are exact):
- kernels (q3tts.invariant): each row of matmul / rms_norm / attention / embed_sum computed in a batch == alone
  (attention also over a longer span than the row's own); their distance from an fp32 / eager reference;
- the vocoder's decode_step, default mode: a row decoded alone vs among 16 (whether cuDNN/cuBLAS follow the batch);
- the engine in batch-invariant mode, any model type (CustomVoice speakers, VoiceDesign instructions, Base voice
  clones: ICL and x-vector only): --batch requests of mixed lengths, voices and sampling parameters, codes alone ==
  in a batch of 3 == of --batch == admitted staggered; a streamed text whose row sits out frames waiting for its
  words beside the others == its whole text alone; eager (no graphs) == graphs for 3; streamed PCM alone == in a
  batch of 3 (the streaming vocoder); offline PCM (TTS.decode, with ICL references) alone == decoded together.

The steps are this script's own loop over an engine it alone owns (generate_codes, staggered, parked), as the tests'
(tests/engine/steps.py, which a benchmark does not import): the product's one loop is q3tts.engine.AsyncEngine.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

ROWS: list[tuple[str, str, str]] = []  # (scope, check, result)


def row(scope: str, check: str, result: str) -> None:
    ROWS.append((scope, check, result))
    print(f"{scope:>18} | {check:<48} | {result}", flush=True)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def check_kernels() -> None:
    from q3tts import invariant
    from q3tts.models.layers import _attend
    invariant.set_enabled(True)
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    for N, K in ((4096, 1024), (1024, 2048), (3072, 1024), (6144, 2048)):
        x = torch.randn(200, K, device=dev, dtype=dt)
        w = torch.randn(N, K, device=dev, dtype=dt) * 0.03
        full = invariant.matmul(x, w)
        ok = all(same(invariant.matmul(x[a:a + m], w), full[a:a + m])
                 for m in (1, 2, 3, 16, 17, 64, 100) for a in (0, 5, 37))
        ref = x.float() @ w.float().T
        err = ((full.float() - ref).abs() / (ref.abs() + 1e-2)).max().item()
        row("kernel", f"matmul {N}x{K}: rows alone == in 200", f"{ok} (max rel err vs fp32 {err:.1e})")
    x = torch.randn(300, 1024, device=dev, dtype=dt) * 3
    nw = torch.randn(1024, device=dev, dtype=dt)
    full = invariant.rms_norm(x, nw, 1e-6)
    ok = all(same(invariant.rms_norm(x[a:a + m], nw, 1e-6), full[a:a + m]) for m in (1, 3, 64) for a in (0, 7))
    ref = nw.float() * torch.nn.functional.rms_norm(x.float(), (1024,), eps=1e-6)
    row("kernel", "rms_norm: rows alone == in 300", f"{ok} (max abs err {(full.float() - ref).abs().max().item():.1e})")
    B, H, Hkv, Dh, L = 8, 16, 8, 128, 1024
    for S in (1, 2):
        q = torch.randn(B, H, S, Dh, device=dev, dtype=dt)
        kc = torch.randn(B, Hkv, L, Dh, device=dev, dtype=dt)
        vc = torch.randn(B, Hkv, L, Dh, device=dev, dtype=dt)
        pos = torch.tensor([5, 63, 64, 200, 255, 256, 700, 1000], device=dev)[:, None] + torch.arange(S, device=dev)
        pos = pos.clamp(max=L - 1)
        n = L
        mask = torch.arange(n, device=dev)[None, None, None, :] <= pos[:, None, :, None]  # [B, 1, S, n]
        full = invariant.attention(q, kc[:, :, :n], vc[:, :, :n], mask)
        ok = True
        for b in range(B):
            nb = max(64, 1 << int(pos[b].max().item()).bit_length())
            one = invariant.attention(q[b:b + 1], kc[b:b + 1, :, :nb], vc[b:b + 1, :, :nb], mask[b:b + 1, ..., :nb])
            ok &= same(one, full[b:b + 1])
        G = H // Hkv
        qg = q.reshape(B, Hkv, G * S, Dh)
        m = mask.expand(B, 1, S, n).repeat(1, 1, G, 1)
        ref = _attend(qg, kc, vc, m, Dh).view(B, H, S, Dh)
        err = (full.float() - ref.float()).abs().max().item()
        row("kernel", f"attention S={S}: row alone (own span) == in 8 (span {n})",
            f"{ok} (max abs diff vs eager {err:.1e})")
    table = torch.randn(16 * 2048, 1024, device=dev, dtype=dt)
    off = torch.arange(16, device=dev) * 2048
    codes = torch.randint(0, 2048, (64, 16), device=dev)
    full = invariant.embed_sum(codes, off, table)
    ok = all(same(invariant.embed_sum(codes[a:a + 1], off, table), full[a:a + 1]) for a in range(64))
    ref = table[codes + off].float().sum(1)
    row("kernel", "embed_sum: rows alone == in 64", f"{ok} (max abs err {(full.float() - ref).abs().max().item():.1e})")
    invariant.set_enabled(False)


def check_vocoder(tts) -> None:
    """Default mode: does a row's decode depend on the rows beside it?"""
    c2w = tts.ckpt.code2wav
    dev, dt = tts.device, next(c2w.parameters()).dtype
    K = c2w.cfg.num_quantizers
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.inference_mode():
        state = c2w.init_state(16, dev, dt)
        _, state = c2w.decode_step(torch.randint(0, 2048, (16, K, 8), generator=g).to(dev), state)
        for t in (1, 4, 16):
            codes = torch.randint(0, 2048, (16, K, t), generator=g).to(dev)
            wav16, _ = c2w.decode_step(codes, state.select_rows(torch.arange(16, device=dev)))
            n_same = sum(same(c2w.decode_step(codes[i:i + 1], state.select_rows(torch.tensor([i], device=dev)))[0],
                              wav16[i:i + 1]) for i in range(16))
            row("vocoder default", f"decode_step {t} frames: row alone == in 16", f"{n_same}/16 rows identical")


def probe_gemm() -> None:
    """q3tts.invariant.matmul's time per tile configuration (BLOCK_M, BLOCK_N, BLOCK_K), the 0.6B's shapes at 1, 16
    and 64 rows, in a CUDA graph, weights cycled through more than L2 holds (as a frame reads them); cuBLAS beside."""
    from q3tts import invariant
    invariant.set_enabled(True)
    dev, dt = "cuda", torch.bfloat16
    shapes = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (3072, 1024), (2048, 1024))
    configs = ((16, 32, 256), (32, 32, 256), (64, 32, 128), (16, 64, 256), (16, 16, 256), (64, 64, 64))
    saved = invariant.BLOCK_M, invariant.BLOCK_N, invariant.BLOCK_K
    for M in (1, 16, 64):
        for N, K in shapes:
            ws = [torch.randn(N, K, device=dev, dtype=dt) for _ in range(max(2, (96 << 20) // (N * K * 2)))]
            x = torch.randn(M, K, device=dev, dtype=dt)
            res = []
            for cfg in (None, *configs):
                if cfg is None:
                    fn = lambda w: torch.nn.functional.linear(x, w)  # noqa: E731
                else:
                    invariant.BLOCK_M, invariant.BLOCK_N, invariant.BLOCK_K = cfg
                    fn = lambda w: invariant.matmul(x, w)  # noqa: E731
                for w in ws:
                    fn(w)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for w in ws * 4:
                        fn(w)
                g.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    g.replay()
                end.record()
                torch.cuda.synchronize()
                us = start.elapsed_time(end) * 1000 / (40 * len(ws))
                res.append(f"{'cublas' if cfg is None else 'x'.join(map(str, cfg))} {us:.1f}")
            row("gemm us", f"M={M} {N}x{K}", ", ".join(res))
    invariant.BLOCK_M, invariant.BLOCK_N, invariant.BLOCK_K = saved
    invariant.set_enabled(False)


WORDS = ("Every request should sound the same whether it runs alone or beside sixty three others on a busy "
         "server, with any seed, speaker and sampling parameters.").split()
INSTRUCTS = ("A calm, low narrator.", "A bright young voice, speaking fast.", "An old man, slowly and softly.")


def clone_voices(tts) -> list:
    """A Base model's voice-clone prompts: ICL with a short and a longer reference (reference codes in the prompt, the
    reference's audio in front of the decoder), and an x-vector-only one. Synthetic references: random weights."""
    import numpy as np
    t = np.arange(int(3.2 * 24000)) / 24000
    wave = (0.2 * np.sin(2 * np.pi * 170 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    short = tts.create_voice_clone_prompt((wave[:36000], 24000), ref_text="A short reference.")
    long = tts.create_voice_clone_prompt((wave[::-1].copy(), 24000), ref_text="A longer reference, with a pause.")
    xvec = tts.create_voice_clone_prompt((wave, 24000), x_vector_only_mode=True)
    return short + long + xvec


def prepare(tts, text, i: int, voices=None, **kw):
    """Request i's voice for any model type: a speaker (CustomVoice), an instruction (VoiceDesign) or voices[i % 3]
    (Base: clone_voices)."""
    kind = tts.tts_model_type
    if kind == "custom_voice":
        speakers = tts.get_supported_speakers()
        return tts.prepare_custom_voice(text, speakers[i % len(speakers)], "English", **kw)
    if kind == "voice_design":
        return tts.prepare_voice_design(text, INSTRUCTS[i % len(INSTRUCTS)], "English", **kw)
    return tts.prepare_voice_clone(text, "English", voice_clone_prompt=[voices[i % len(voices)]], **kw)


def requests(tts, n: int, frames: int, voices=None):
    """n requests of frames..frames+12 frames, mixed texts, voices and samplers (greedy, top-k, the uncapped sampler,
    top-p) and both layouts (all text in the prompt; the streamed-text layout: one text token per frame)."""
    ps = []
    for i in range(n):
        kw = dict(max_new_tokens=frames + 1 + 3 * (i % 5), seed=100 + i)
        kind = i % 4
        if kind == 0:
            kw.update(do_sample=False, subtalker_dosample=False)
        elif kind == 1:
            kw.update(temperature=0.8, top_k=30, subtalker_temperature=1.1)
        elif kind == 2:
            kw.update(top_k=0, top_p=0.8, repetition_penalty=1.3)  # the uncapped sampler
        else:
            kw.update(subtalker_top_k=5, top_p=0.9)
        ps += prepare(tts, " ".join(WORDS[: 3 + (7 * i) % len(WORDS)]), i, voices, non_streaming_mode=kind != 3, **kw)
    return ps


def streamed_text(tts, voices=None, frames: int = 40):
    """(the same seeded request twice: its whole text, and text=None to stream the text into), its text's pieces
    (1-3 characters, cut mid-word). A Base model's takes the x-vector clone: an ICL prompt lays the text over its
    reference frames, so it waits for as many text tokens as they are frames (more than this text has)."""
    import random
    text = "Parked rows wait for words that an LLM types slowly, then speak them."
    i = 1 if voices is None else next(j for j, v in enumerate(voices) if v.x_vector_only_mode)
    kw = dict(max_new_tokens=frames + 1, seed=7, top_k=20, subtalker_temperature=0.9, non_streaming_mode=False)
    whole, = prepare(tts, text, i, voices, **kw)
    fed, = prepare(tts, None, i, voices, **kw)
    rng, pieces, i = random.Random(0), [], 0
    while i < len(text):
        k = rng.randint(1, 3)
        pieces.append(text[i:i + k])
        i += k
    return whole, fed, pieces


def parked(eng, ps, fed, pieces: list[str], every: int = 3):
    """ps admitted together beside `fed` (prepared with text=None), whose text arrives one piece every `every` steps
    and is closed after the last: its row sits out the frames its next text token has not reached.
    -> (codes of ps, codes of fed, the frames it sat out while other rows ran)."""
    from q3tts.engine.request import RequestStatus
    reqs = [eng.add_request(p) for p in ps]
    req = eng.add_request(fed)
    sat_out, steps, sent = 0, 0, 0
    while not all(r.status.finished for r in [*reqs, req]):
        if sent < len(pieces) and steps % every == 0:
            fed.text.append(pieces[sent])
            sent += 1
            if sent == len(pieces):
                fed.text.close()
        steps += 1
        if not eng.has_work():  # only more text can move it on
            continue
        mine, others = req.num_frames, sum(r.num_frames for r in reqs)
        eng.step()
        sat_out += (req.status == RequestStatus.RUNNING and req.num_frames == mine
                    and sum(r.num_frames for r in reqs) > others)
    return [torch.stack(r.frames).cpu() for r in reqs], torch.stack(req.frames).cpu(), sat_out


def generate_codes(eng, ps) -> list[torch.Tensor]:
    """Codes [T_i, K] of each request, stepping an engine this script alone owns (no AsyncEngine loop on it)."""
    reqs = [eng.add_request(p) for p in ps]
    while any(not r.status.finished for r in reqs):
        if eng.wait_for_work():
            eng.step()
    return [torch.stack(r.frames).cpu() for r in reqs]


def staggered(eng, ps, gap: int) -> list[torch.Tensor]:
    reqs, pending, steps = [], list(ps), 0
    while pending or any(not r.status.finished for r in reqs):
        if pending and steps % gap == 0:
            reqs.append(eng.add_request(pending.pop(0)))
        if eng.has_work():
            eng.step()
        steps += 1
    return [torch.stack(r.frames).cpu() for r in reqs]


def streamed(tts, ps) -> list[bytes]:
    audio: dict[str, list] = {}
    for ch in tts.stream(ps, first_chunk_frames=1, chunk_frames=4):
        audio.setdefault(ch.request_id, []).append(ch.audio)
    keys = sorted(audio, key=lambda k: int(k.rsplit("-", 1)[-1]))
    import numpy as np
    return [np.concatenate(audio[k]).tobytes() for k in keys]


def count(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    n = sum(same(x, y) for x, y in zip(a, b))
    firsts = [int((x != y).any(1).nonzero()[0]) if x.shape == y.shape and not same(x, y) else None
              for x, y in zip(a, b)]
    bad = [f for f in firsts if f is not None]
    return f"{n}/{len(a)} identical" + (f" (first differing frame of each: {bad})" if bad else "")


def check_engine(model: str, frames: int, n: int) -> None:
    from bench.make_checkpoint import make
    from q3tts import TTS
    from q3tts.engine.engine import Engine
    path = tempfile.mkdtemp() + "/ck"
    make(model, path)
    t0 = time.perf_counter()
    tts = TTS.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_batch_size=n, max_seq_len=512,
                              batch_invariant=True)
    eng = tts.engine
    row(model, "engine built (s)", f"{time.perf_counter() - t0:.1f}")
    voices = clone_voices(tts) if tts.tts_model_type == "base" else None
    ps = requests(tts, n, frames, voices)
    alone = [generate_codes(eng, [p])[0] for p in ps]
    row(model, "codes: alone == batch of 3", count(alone[:3], generate_codes(eng, ps[:3])))
    row(model, f"codes: alone == batch of {n}", count(alone, generate_codes(eng, ps)))
    row(model, f"codes: alone == {n} staggered (one every 3 frames)", count(alone, staggered(eng, ps, 3)))
    row(model, "codes: alone == batch of 4 reversed", count(alone[:4][::-1], generate_codes(eng, ps[:4][::-1])))
    whole, fed, pieces = streamed_text(tts, voices)
    want = generate_codes(eng, [whole])[0]
    others, got, sat_out = parked(eng, ps[:n - 1], fed, pieces)
    row(model, f"streamed text (sat out {sat_out} frames) beside {n - 1} == whole text alone",
        count([want, *alone[:n - 1]], [got, *others]))
    refs = [p.ref_codes for p in ps[:8]]
    wav_alone = [tts.decode([c], [r])[0].tobytes() for c, r in zip(alone[:8], refs)]
    wav_all = [w.tobytes() for w in tts.decode(alone[:8], refs)]
    row(model, "offline PCM: decoded alone == 8 together", f"{sum(a == b for a, b in zip(wav_alone, wav_all))}/8")
    s_alone = [streamed(tts, [p])[0] for p in ps[:3]]
    s_batch = streamed(tts, ps[:3])
    row(model, "streamed PCM: alone == batch of 3", f"{sum(a == b for a, b in zip(s_alone, s_batch))}/3 identical")
    eager = Engine(tts.ckpt, max_slots=4, max_seq_len=512, use_cuda_graphs=False, batch_invariant=True)
    row(model, "codes: graphs alone == eager batch of 3", count(alone[:3], generate_codes(eager, ps[:3])))
    del eager, eng, tts
    torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="0.6B-CustomVoice", help="comma-separated, of q3tts.randomckpt.MODELS")
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--probe-gemm", action="store_true", help="only time matmul's tile configurations")
    a = ap.parse_args(argv)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if a.probe_gemm:
        probe_gemm()
        return
    if not a.skip_kernels:
        check_kernels()
    for i, model in enumerate(a.models.split(",")):
        if i == 0:
            from bench.make_checkpoint import make
            from q3tts import TTS
            path = tempfile.mkdtemp() + "/ck"
            make(model, path)
            check_vocoder(TTS.from_pretrained(path, device="cuda", dtype=torch.bfloat16, max_batch_size=1))
        check_engine(model, a.frames, a.batch)
    print("\n== batch invariance ==")
    for r in ROWS:
        print(" | ".join(r))


if __name__ == "__main__":
    main()
