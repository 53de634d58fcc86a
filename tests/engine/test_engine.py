"""Engine equivalences on CPU fp32: batched == alone (sampling too, batched prefill too), streamed == offline,
cancellation, a failing request in a batch."""

import dataclasses
import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from q3tts.engine.deadline import chunk_cut
from q3tts.engine.engine import Engine
from q3tts.engine.request import RequestStatus, StreamOptions
from q3tts.models.talker import embed_prompt
from tests.engine.steps import generate_codes, run_to_completion
from tests.golden import fixtures as fx


def prepared_mix(tts, n_frames=12):
    """Requests of every CustomVoice flavour, some sampled with their own seeds and parameters."""
    kw = dict(max_new_tokens=n_frames + 1)
    out = []
    out += tts.prepare_custom_voice("Hello there, this is a test.", "vivian", "English", do_sample=False, subtalker_dosample=False, **kw)
    out += tts.prepare_custom_voice("你好，今天天气真不错。", "dylan", "Auto", non_streaming_mode=False, seed=11, temperature=0.7, **kw)
    out += tts.prepare_custom_voice("Short.", "ryan", "Auto", seed=5, top_k=5, top_p=0.8, max_new_tokens=6)
    out += tts.prepare_custom_voice("Another one, longer text goes here to vary the prompt length.", "serena",
                                    "Japanese", non_streaming_mode=False, seed=3, subtalker_temperature=1.3, **kw)
    return out


def run_alone(tts, p, max_seq_len=256):
    eng = Engine(tts.ckpt, max_slots=1, max_seq_len=max_seq_len)
    return generate_codes(eng, [p])[0]


GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=10)


def prepared_lengths(variant):
    """Greedy requests of one model, each with a different prompt length (cv06 adds a seeded sampler)."""
    tts = fx.tts(variant)
    if variant == "cv06":  # one prompt past 64 positions: batched, the short ones attend over a wider span
        long = "A sentence long enough to pass sixty-four prompt positions, so the batch attends over a wider span. " * 3
        ps = tts.prepare_custom_voice(["Hi.", long, "你好，今天天气真不错。"], ["vivian", "ryan", "dylan"],
                                      ["English", "Auto", "Chinese"], **GREEDY)
        ps += tts.prepare_custom_voice("Streamed text, seeded.", "serena", non_streaming_mode=False, seed=7, max_new_tokens=10)
    elif variant == "vd17":
        ps = tts.prepare_voice_design(["Designed voice.", "A much longer designed sentence, with commas, and more words."],
                                      ["A robot.", "A warm, low, slow narrator voice."], ["English", "Auto"], **GREEDY)
    else:  # Base: ICL with a short and a long reference, and an x-vector-only clone
        items = [it for name in ("icl_short_ref_stream", "icl_long_ref_stream", "xvec_stream")
                 for it in fx.case_prompt_items(variant, fx.get_case(variant, name))]
        ps = tts.prepare_voice_clone(["Short clone.", "A longer sentence to clone with the long reference.", "X-vector."],
                                     ["English", "Auto", "English"], voice_clone_prompt=items, **GREEDY)
    assert len({len(p.layout) for p in ps}) == len(ps)  # all different: the batch is right-padded
    assert variant != "cv06" or max(len(p.layout) for p in ps) > 64
    return tts, ps


@pytest.mark.parametrize("variant", ["cv06", "vd17", "base06"])
def test_batched_prefill_equals_alone(variant):
    tts, ps = prepared_lengths(variant)
    alone = [run_alone(tts, p) for p in ps]
    eng = Engine(tts.ckpt, max_slots=4, max_seq_len=256)
    handles = [eng.add_request(p) for p in ps]
    eng.step()  # one step admits all of them: one batched prefill
    assert sorted(h.slot for h in handles) == list(range(len(ps)))
    run_to_completion(eng, handles)
    for h, a in zip(handles, alone):
        assert torch.equal(torch.stack(h.frames), a), h.request_id


@pytest.mark.parametrize("variant", ["cv06", "base06"])
def test_prefill_batch_equals_single_prefills(variant):
    """Code 0 of frame 0, the last hidden and the prompt's KV are bit-identical to one request per forward."""
    tts, ps = prepared_lengths(variant)
    with torch.inference_mode():
        embeds = [embed_prompt(tts.ckpt.talker, p.layout, p.speaker_embedding, p.ref_codes) for p in ps]
    batched = Engine(tts.ckpt, max_slots=len(ps), max_seq_len=256).runner
    codes0 = batched.prefill_batch(0, [e[0] for e in embeds], [e[1] for e in embeds], [p.params for p in ps])
    for i, ((pre, trail), p) in enumerate(zip(embeds, ps)):
        single = Engine(tts.ckpt, max_slots=1, max_seq_len=256).runner
        assert single.prefill_batch(0, [pre], [trail], [p.params]) == [codes0[i]]
        assert torch.equal(single.slots.last_hidden[0], batched.slots.last_hidden[i])
        L = pre.shape[0]
        assert batched.slots.position_cpu[i] == L and int(batched.slots.position[i]) == L
        assert torch.equal(single.kv[:, :, 0, :, :L], batched.kv[:, :, i, :, :L])


class ScratchReplay:
    """A CPU stand-in for a captured prefill graph of padded length L: replay() runs what capture_graphs records."""

    def __init__(self, runner, L: int):
        self.runner, self.L, self.replays = runner, L, 0

    def replay(self) -> None:
        self.replays += 1
        self.runner._prefill_one(self.L)


def with_prefill_replays(runner, monkeypatch):
    """Give a CPU runner what capture_graphs gives a CUDA one for prefills: the scratch buffers, one replay per
    bucket, and one prompt padded to its bucket."""
    from q3tts.engine.runner import PREFILL_GRAPH_LENS
    lens = [b for b in PREFILL_GRAPH_LENS if b <= runner.max_len]
    runner.alloc_prefill_scratch()
    runner.prefill_graphs = {b: ScratchReplay(runner, b) for b in lens}
    monkeypatch.setattr(runner, "prefill_len", lambda N, L: next((b for b in lens if L <= b), L) if N == 1 else L)
    return runner


def test_a_few_admitted_together_replay_their_prefill_graphs_each_as_alone(monkeypatch):
    """Up to PREFILL_GRAPH_MAX_REQUESTS requests admitted in one step replay their bucket's prefill graph one after
    another (CPU stand-ins here): code 0, the last hidden, the KV rows, positions and per-row state are bit-identical
    to each request's prefill alone. More requests, or graphs=False, take the one batched forward."""
    from q3tts.engine.runner import PREFILL_GRAPH_MAX_REQUESTS as G
    tts, four = prepared_lengths("cv06")
    ps = [four[i % len(four)] for i in range(G)]  # G newcomers: the four prompt lengths over and over
    with torch.inference_mode():
        embeds = [embed_prompt(tts.ckpt.talker, p.layout, p.speaker_embedding, p.ref_codes) for p in ps]
    pre, trail, params = [e[0] for e in embeds], [e[1] for e in embeds], [p.params for p in ps]
    runner = with_prefill_replays(Engine(tts.ckpt, max_slots=G + 1, max_seq_len=256).runner, monkeypatch)
    assert runner.prefill_alone_max() == G and runner.prefill_alone_max(graphs=False) == 0
    codes0 = runner.prefill_batch(1, pre, trail, params)  # rows 1..G
    replayed = {b: g.replays for b, g in runner.prefill_graphs.items() if g.replays}
    assert replayed == Counter(min(b for b in runner.prefill_graphs if b >= x.shape[0]) for x in pre), replayed
    for i, p in enumerate(four):  # (the repeats are the same prompts: the same rows alone)
        single = with_prefill_replays(Engine(tts.ckpt, max_slots=1, max_seq_len=256).runner, monkeypatch)
        assert single.prefill_batch(0, pre[i:i + 1], trail[i:i + 1], params[i:i + 1]) == [codes0[i]]
        L, S = pre[i].shape[0], trail[i].shape[0]
        rs, ss = runner.slots, single.slots
        for j in range(i, G, len(four)):  # row 1 + j holds prompt i
            assert single.slots.last_code0[0] == codes0[j]
            assert torch.equal(ss.last_hidden[0], rs.last_hidden[1 + j])
            assert torch.equal(single.kv[:, :, 0, :, :L], runner.kv[:, :, 1 + j, :, :L])
            assert rs.position_cpu[1 + j] == L and int(rs.position[1 + j]) == L
            assert torch.equal(ss.trailing[0, :S], rs.trailing[1 + j, :S]) and int(rs.trailing_len[1 + j]) == S
            for f in dataclasses.fields(rs.sampling):
                assert getattr(rs.sampling, f.name)[1 + j] == getattr(ss.sampling, f.name)[0], f.name
            assert rs.seed[1 + j] == ss.seed[0] and rs.topk_ok_cpu[1 + j] == ss.topk_ok_cpu[0]
    # one more than PREFILL_GRAPH_MAX_REQUESTS (G + 1 rows: the slots allow it), or graphs=False: one batched
    # forward, no replay
    more = (pre + pre[:1], trail + trail[:1], params + params[:1])
    for args, kw in ((more, {}), ((pre, trail, params), {"graphs": False})):
        for g in runner.prefill_graphs.values():
            g.replays = 0
        runner.prefill_batch(0, *args, **kw)
        assert not any(g.replays for g in runner.prefill_graphs.values())
        assert runner.slots.last_code0[:G].tolist() == codes0  # (CPU: the batched forward is bit-identical too)


class WaveReplay(ScratchReplay):
    """A CPU stand-in for a captured batched prefill graph of N rows at padded length L."""

    def __init__(self, runner, N: int, L: int):
        super().__init__(runner, L)
        self.N = N

    def replay(self) -> None:
        self.replays += 1
        self.runner._prefill_wave(self.N, self.L)


def with_wave_replays(runner, sizes=None):
    """Give a CPU runner what capture_graphs gives a CUDA one for waves: the scratch, one replay per (size, length)."""
    from q3tts.engine.memory import wave_buckets
    runner.wave_sizes, runner.wave_lens = wave_buckets(runner.num_rows, runner.max_len)
    runner.wave_sizes = sizes or runner.wave_sizes
    runner.alloc_wave_scratch()
    runner.wave_graphs = {key: WaveReplay(runner, *key) for key in runner.wave_keys()}
    return runner


@pytest.mark.parametrize("lo, sizes, replays", [(1, None, {(16, 128): 1}),  # one wave graph, 4 padding rows
                                                (1, [8], {(8, 128): 2}),  # chunks of 8: 8 + 4 rows
                                                (20, None, {})])  # rows 20..35 pass the 32 slots: one forward
def test_a_wave_replays_its_wave_graphs_each_row_as_alone(lo, sizes, replays):
    """More than PREFILL_GRAPH_MAX_REQUESTS newcomers replay the least wave graph (CPU stand-ins) holding them, in
    chunks of the largest wave size, into a scratch cache then their rows: code 0, the last hidden, the KV rows and
    the positions are bit-identical to each one's prefill alone (CPU: unpadded); the rows before the wave (running
    streams) are untouched, and the padding rows write only free rows. Where the padded wave would pass the slots
    (or graphs=False), one batched forward."""
    from q3tts.engine.runner import PREFILL_GRAPH_MAX_REQUESTS as G
    tts, four = prepared_lengths("cv06")
    ps = [four[i % len(four)] for i in range(12)]
    assert len(ps) > G
    with torch.inference_mode():
        embeds = [embed_prompt(tts.ckpt.talker, p.layout, p.speaker_embedding, p.ref_codes) for p in ps]
    pre, trail, params = [e[0] for e in embeds], [e[1] for e in embeds], [p.params for p in ps]
    runner = with_wave_replays(Engine(tts.ckpt, max_slots=32, max_seq_len=256).runner, sizes)
    runner.kv.fill_(7.0)
    runner.slots.last_hidden.fill_(7.0)  # the rows outside the wave's: must keep these
    codes0 = runner.prefill_batch(lo, pre, trail, params)
    assert {k: g.replays for k, g in runner.wave_graphs.items() if g.replays} == replays
    end = lo + len(ps) if not replays else lo + max(k[0] for k in replays) * (2 if sizes else 1)
    assert bool((runner.kv[:, :, :lo] == 7).all()) and bool((runner.slots.last_hidden[:lo] == 7).all())
    assert bool((runner.kv[:, :, end:] == 7).all()) and bool((runner.slots.last_hidden[end:] == 7).all())
    for i, p in enumerate(four):
        single = Engine(tts.ckpt, max_slots=1, max_seq_len=256).runner
        assert single.prefill_batch(0, pre[i:i + 1], trail[i:i + 1], params[i:i + 1]) == [codes0[i]]
        L = pre[i].shape[0]
        for j in range(i, len(ps), len(four)):
            assert torch.equal(single.slots.last_hidden[0], runner.slots.last_hidden[lo + j])
            assert torch.equal(single.kv[:, :, 0, :, :L], runner.kv[:, :, lo + j, :, :L])
            assert runner.slots.position_cpu[lo + j] == L and int(runner.slots.position[lo + j]) == L
    for g in runner.wave_graphs.values():
        g.replays = 0
    assert runner.prefill_batch(lo, pre, trail, params, graphs=False) == codes0
    assert not any(g.replays for g in runner.wave_graphs.values())


def test_a_too_long_request_is_refused_and_the_others_run_as_alone():
    tts = fx.tts("cv06")
    ok = tts.prepare_custom_voice(["Hi.", "Hello there, a longer one.", "你好。"], ["vivian", "ryan", "dylan"], **GREEDY)
    long = tts.prepare_custom_voice("Far too long for this cache. " * 20, "eric", **GREEDY)[0]
    alone = [run_alone(tts, p, max_seq_len=64) for p in ok]
    eng = Engine(tts.ckpt, max_slots=4, max_seq_len=64)
    handles = [eng.add_request(ok[0])]
    with pytest.raises(ValueError, match="max_seq_len 64"):  # refused when it is added: it never takes a slot
        eng.add_request(long)
    handles += [eng.add_request(p) for p in ok[1:]]
    eng.step()
    assert sorted(h.slot for h in handles) == [0, 1, 2] and eng.scheduler.queue_depth == 0
    run_to_completion(eng, handles)
    for h, a in zip(handles, alone):
        assert h.status.reason == "length" and torch.equal(torch.stack(h.frames), a), h.request_id
    assert eng.scheduler.num_running == 0 and len(eng.scheduler.free_slots) == 4


def test_batched_equals_alone_with_staggered_arrivals_and_a_cancel():
    tts = fx.tts("cv06")
    reqs = prepared_mix(tts)
    alone = [run_alone(tts, p) for p in reqs]
    eng = Engine(tts.ckpt, max_slots=3, max_seq_len=256)  # fewer slots than requests: one waits for a free slot
    handles = [eng.add_request(reqs[0]), eng.add_request(reqs[1])]
    for _ in range(3):
        eng.step()
    handles.append(eng.add_request(reqs[2]))  # joins a running batch at frame 3
    victim = eng.add_request(reqs[0], request_id="victim")
    handles.append(eng.add_request(reqs[3]))  # queued behind the victim until a slot frees
    eng.step()
    eng.step()
    eng.abort("victim")
    run_to_completion(eng, handles + [victim])
    assert victim.status == RequestStatus.FINISHED_ABORTED and victim.num_frames < 12
    for h, a in zip(handles, alone):
        got = torch.stack(h.frames)
        assert torch.equal(got, a), h.request_id
    assert eng.scheduler.num_running == 0 and len(eng.scheduler.free_slots) == 3


def stream_alone(tts, p, opts):
    eng = Engine(tts.ckpt, max_slots=1, max_seq_len=256)
    req = eng.add_request(p, opts)
    chunks = run_to_completion(eng, [req])
    return torch.stack(req.frames), np.concatenate([c.audio for c in chunks])


def test_voice_clone_mix_streamed_staggered_with_a_cancel():
    """Base model: ICL clones with references of different lengths and an x-vector clone, streamed, arriving at
    different frames, one cancelled mid-way, sharing batched prefills, frames and vocoder calls (and a vocoder
    row freed by the cancel): each gets exactly its codes alone, and its audio alone."""
    tts, ps = prepared_lengths("base06")  # ICL short ref, ICL long ref, x-vector
    opts = StreamOptions(first_chunk_frames=1, chunk_frames=4)
    alone = [stream_alone(tts, p, opts) for p in ps]
    eng = Engine(tts.ckpt, max_slots=3, max_seq_len=256)
    handles = [eng.add_request(ps[0], opts)]
    victim = eng.add_request(ps[1], opts, request_id="victim")
    chunks = eng.step() + eng.step()
    handles.append(eng.add_request(ps[1], opts))  # the long reference again, joining at frame 2
    chunks += eng.step()
    eng.abort("victim")
    handles.append(eng.add_request(ps[2], opts))  # x-vector: takes the victim's slot and vocoder row, fresh
    chunks += run_to_completion(eng, handles + [victim])
    audio = {h.request_id: [] for h in handles}
    for c in chunks:
        audio.get(c.request_id, []).append(c.audio)
    assert victim.status == RequestStatus.FINISHED_ABORTED and 0 < victim.num_frames < 9
    for h, (codes, wav) in zip(handles, alone):
        assert torch.equal(torch.stack(h.frames), codes), h.request_id
        got = np.concatenate(audio[h.request_id])
        # vocoder calls of 3 rows vs 1: float sums in another order, through the decoder's gain (test_parity.py)
        assert got.shape == wav.shape and np.abs(got - wav).max() <= 1e-4, h.request_id
    assert sorted(eng.vocoder.free_rows) == [0, 1, 2]


def test_sampled_output_is_reproducible_from_the_seed():
    tts = fx.tts("cv06")
    a = tts.generate_custom_voice("Seeded run.", "aiden", seed=42, max_new_tokens=10)[0][0]
    b = tts.generate_custom_voice("Seeded run.", "aiden", seed=42, max_new_tokens=10)[0][0]
    c = tts.generate_custom_voice("Seeded run.", "aiden", seed=43, max_new_tokens=10)[0][0]
    assert np.array_equal(a, b) and not np.array_equal(a, c)


CV = dict(text="Streaming equals offline.", speaker="eric", language="Chinese")


@pytest.mark.parametrize("variant,method,kw,schedule", [
    ("cv06", "custom_voice", CV, (1, 1)),
    ("cv06", "custom_voice", CV, (2, 8)),
    ("cv06", "custom_voice", CV, (3, 5)),
    ("cv17", "custom_voice", dict(text="Instruct too.", speaker="uncle_fu", instruct="Loud.", non_streaming_mode=False), (1, 4)),
    ("vd17", "voice_design", dict(text="Designed voice.", instruct="A robot.", language="English"), (2, 3)),
    ("base06", "voice_clone", None, (1, 6)),
])
def test_streamed_equals_offline(variant, method, kw, schedule):
    tts = fx.tts(variant)
    if kw is None:  # ICL clone: the reference warms the decoder, its audio is never emitted
        case = fx.get_case("base06", "icl_short_ref_stream")
        kw = dict(text="Clone streaming.", language="English", voice_clone_prompt=fx.case_prompt_items("base06", case))
    greedy = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=20)
    prepared = getattr(tts, f"prepare_{method}")(**kw, **greedy)
    codes = tts.generate_codes(prepared)[0]
    ref = prepared[0].ref_codes
    full = codes if ref is None else torch.cat([ref, codes])
    with torch.inference_mode():
        offline = tts.ckpt.code2wav(full.T[None])[0].numpy()[(0 if ref is None else ref.shape[0]) * 1920:]
    chunks = list(getattr(tts, f"generate_{method}_stream")(**kw, **greedy, first_chunk_frames=schedule[0], chunk_frames=schedule[1]))
    assert chunks[-1].is_last and chunks[-1].finish_reason == "length"
    assert [c.frame_index for c in chunks] == list(np.cumsum([0] + [c.num_frames for c in chunks[:-1]]))
    # chunks end on the schedule's boundaries (first_chunk_frames doubling up to chunk_frames); the first may hold
    # several of its chunks when steps are long (q3tts.engine.deadline), never fewer than one
    bounds = list(itertools.accumulate(chunk_cut(StreamOptions(*schedule), 0, codes.shape[0])))
    assert chunks[0].num_frames >= min(schedule[0], codes.shape[0])
    assert all(c.frame_index + c.num_frames in bounds for c in chunks)
    streamed = np.concatenate([c.audio for c in chunks])
    assert streamed.shape == offline.shape
    assert np.abs(streamed - offline).max() <= 1e-4
    # and the public non-streaming call gives the same audio (<= 300 frames: upstream decodes in one chunk)
    off_api = getattr(tts, f"generate_{method}")(**kw, **greedy)[0][0]
    n = min(len(off_api), len(streamed))
    assert abs(len(off_api) - len(streamed)) <= 1  # ICL: upstream's proportional cut may round one sample
    assert np.abs(off_api[-n:] - streamed[-n:]).max() <= 1e-4


def test_stream_consumer_closing_early_frees_the_slot():
    tts = fx.tts("cv06")
    it = tts.generate_custom_voice_stream("Cancel me please.", "vivian", max_new_tokens=30, chunk_frames=2)
    next(it)
    it.close()
    assert tts.engine.scheduler.num_running == 0 and not tts.engine.has_work()


def test_attending_to_the_end_of_the_cache_compiles_nothing_new():
    """The contiguous cache holds KV_SPARE positions past its last span, so a prompt whose span reaches the end of
    the cache reuses the layers compiled for a short prompt and for frames (on a CPU the frames compile as they
    come; the first request's frames go past 64 positions, to the last span), where a slice to the end of the cache
    compiled apart before. Its greedy codes equal the uncompiled engine's (fp32: compiled kernels differ from eager
    ones by rounding only, ~1e-6 relative, far below the random tiny model's logit gaps)."""
    import torch._dynamo.utils

    from q3tts import TTS
    # a TTS of its own: compile_layers compiles its talker's layers in place, which the shared fx.tts must not keep
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cpu", dtype=torch.float32)
    eng = Engine(tts.ckpt, max_slots=1, max_seq_len=128, compile=True)
    warm = generate_codes(eng, tts.prepare_custom_voice("Hi.", "ryan", **dict(GREEDY, max_new_tokens=80)))[0]
    assert warm.shape[0] > 64, "the first request's frames must attend to the end of the cache too"
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    long = tts.prepare_custom_voice("A sentence long enough to pass sixty-four prompt positions, so the prefill "
                                    "attends to the end of this small cache. " * 3, "ryan", **GREEDY)
    L = len(long[0].layout)
    assert eng.runner.kv_span(L) == eng.runner.max_len and not eng.runner.eager_prefill(1, L), L
    codes = generate_codes(eng, long)[0]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
    assert torch.equal(codes, run_alone(tts, long[0], max_seq_len=128))


def test_code_predictor_steps_reuse_the_layers_compiled_for_the_talker():
    """Batches of 2 and more run the code predictor's steps through the compiled decoder layer. Where its layers
    have the talker's shape (the real 0.6B models: 1024 wide, 16 x 128 heads), its steps after the first reuse the
    variant compiled for the talker's frames, and its first step (2 positions) the prefill's: a frame of 2 rows
    compiles the layer twice (1 position, 2 positions). With its own layout of constant inputs (one broadcast RoPE
    table and mask, not inference tensors, a cache of exactly 16 positions) the code predictor's steps compiled
    their own variant too. Random weights: only the compiled variants are counted."""

    from q3tts.engine.runner import ModelRunner
    from q3tts.models.layers import DecoderLayer
    from q3tts.models.talker import Talker
    cfg = fx.tts("cv06").ckpt.talker.cfg
    cfg = dataclasses.replace(cfg, code_predictor=dataclasses.replace(cfg.code_predictor, head_dim=cfg.head_dim))
    torch.manual_seed(0)
    runner = ModelRunner(Talker(cfg).eval(), torch.zeros(cfg.hidden_size), max_slots=2, max_len=64,
                         use_cuda_graphs=False, compile=True)
    torch._dynamo.reset()  # the layer's variants of earlier tests (other shapes) are not this test's
    with torch.inference_mode():
        runner.warm_up_frames([(2, 64, True)])
    variants = torch._dynamo.eval_frame._debug_get_cache_entry_list(DecoderLayer.forward.__code__)
    assert len(variants) == 2


def test_settled_once_every_streaming_row_has_sent_its_first_audio():
    """Engine.settled (what the forced aligner's worker waits for): False from a request's arrival until no request
    waits for a slot and every streaming row has sent its first chunk; an offline request does not hold it."""
    tts = fx.tts("cv06")
    eng = Engine(tts.ckpt, max_slots=1, max_seq_len=256)
    assert eng.settled
    kw = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=20)
    a = eng.add_request(tts.prepare_custom_voice("A first stream.", "vivian", **kw)[0],
                        StreamOptions(first_chunk_frames=3, chunk_frames=4))
    b = eng.add_request(tts.prepare_custom_voice("A second one waits for the slot.", "ryan", **kw)[0],
                        StreamOptions(first_chunk_frames=1, chunk_frames=4))
    assert not eng.settled
    seen = []
    while not b.first_sent_at:
        eng.step()
        seen.append((a.first_sent_at is not None, b.first_sent_at is not None, eng.settled))
    assert (True, False, False) in seen  # a played while b waited for its slot
    assert seen[-1] == (True, True, True)
    run_to_completion(eng, [b])
    eng.add_request(tts.prepare_custom_voice("Offline.", "ryan", **kw)[0])
    assert not eng.settled
    eng.step()
    assert eng.settled
