"""CUDA-graph path == eager path (GPU only; skipped on CPU CI via the `gpu` marker)."""

import pytest
import torch

from q3tts import TTS
from q3tts.engine.engine import Engine
from tests.engine.steps import generate_codes, run_to_completion
from tests.golden import fixtures as fx

pytestmark = pytest.mark.gpu


def codes_with(tts, prepared, graphs: bool, max_slots=4):
    eng = Engine(tts.ckpt, max_slots=max_slots, max_seq_len=256, use_cuda_graphs=graphs)
    return generate_codes(eng, prepared)


def test_graph_equals_eager_fp32_120_frames():
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cuda", dtype=torch.float32)
    prepared = tts.prepare_custom_voice("A longer run to compare the captured frame with eager code.", "vivian",
                                        "English", do_sample=False, subtalker_dosample=False, max_new_tokens=121)
    g, e = codes_with(tts, prepared, True)[0], codes_with(tts, prepared, False)[0]
    assert g.shape == (120, 16) and torch.equal(g, e)


def test_mixed_sampling_parameters_inside_the_graph():
    """Per-request temperature / top-k / top-p / penalty / seed are honoured by the captured frame:
    a batch of differently-configured requests gives each the codes it gets alone.
    (All four are admitted in one step; their batched prefill is bit-identical to single ones on CPU, and on
    this GPU in fp32 it has been so far: if this ever fails in its first frame, look at the prefill.)"""
    tts = TTS.from_pretrained(fx.checkpoint("cv17"), device="cuda", dtype=torch.float32)
    p = []
    p += tts.prepare_custom_voice("First request.", "ryan", "English", seed=1, temperature=0.6, top_k=10, max_new_tokens=41)
    p += tts.prepare_custom_voice("Second, greedy.", "vivian", do_sample=False, subtalker_dosample=False, max_new_tokens=31)
    p += tts.prepare_custom_voice("Third one here.", "serena", "Chinese", seed=7, top_p=0.7, repetition_penalty=1.3,
                                  subtalker_temperature=1.2, max_new_tokens=36, non_streaming_mode=False)
    p += tts.prepare_custom_voice("Fourth.", "eric", seed=3, subtalker_top_k=3, max_new_tokens=26, instruct="Slowly.")
    batched = codes_with(tts, p, True)
    alone = [codes_with(tts, [x], True, max_slots=1)[0] for x in p]
    for i, (b, a) in enumerate(zip(batched, alone)):
        same = (b == a).all(1).long() if b.shape == a.shape else None
        assert torch.equal(b, a), f"request {i}: identical prefix {None if same is None else int(same.cumprod(0).sum())} " \
            f"of {a.shape[0]} frames alone, {b.shape[0]} batched"
    assert [c.shape[0] for c in batched] == [40, 30, 35, 25]


@pytest.fixture(scope="module")
def real06(real_checkpoint):
    """TTS of a random 0.6B-CustomVoice checkpoint at the real dimensions, bf16."""
    return TTS.from_pretrained(real_checkpoint("0.6B-CustomVoice"), device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("batch", [1, 3])
def test_graph_equals_eager_bf16_real_dims(real06, batch):
    """bf16 at the real dimensions, in batch-invariant mode (q3tts.invariant), greedy and seeded requests: each
    request's codes alone (captured frames) == in the batch (captured frames) == in the batch (eager frames), bit for
    bit. (In the default mode bf16 frames are not bit-exact between a replay and a launch from Python, nor between
    batch sizes: on an H100 one stream's greedy codes parted at the second frame in some runs, ceed380's code alike;
    the fp32 tests above hold there.)"""
    from q3tts import invariant
    tts = real06
    texts = ["Real dimensions, bf16.", "A second stream, decoded in the same batch.", "And a third one."][:batch]
    prepared = tts.prepare_custom_voice(texts, ["ryan", "vivian", "serena"][:batch], "English", do_sample=False,
                                        subtalker_dosample=False, max_new_tokens=101)
    if batch > 1:
        prepared += tts.prepare_custom_voice(texts[1], "aiden", seed=5, max_new_tokens=61)
    try:
        graphs = Engine(tts.ckpt, max_slots=4, max_seq_len=256, use_cuda_graphs=True, batch_invariant=True)
        alone = [generate_codes(graphs, [p])[0] for p in prepared]
        batched = generate_codes(graphs, prepared)
        eager = generate_codes(Engine(tts.ckpt, max_slots=4, max_seq_len=256, use_cuda_graphs=False,
                                      batch_invariant=True), prepared)
    finally:
        invariant.set_enabled(False)  # process-wide: the other tests' engines run the default mode
    for i, (a, b, e) in enumerate(zip(alone, batched, eager)):
        for name, x in (("batched", b), ("eager", e)):
            same = (a == x).all(1).long() if a.shape == x.shape else torch.zeros(1, dtype=torch.long)
            assert torch.equal(a, x), f"request {i}, {name}: identical prefix {int(same.cumprod(0).sum())} frames"


def test_nothing_compiles_after_warm_up(real06):
    """Once the engine is built (graphs captured, variants compiled, none while capturing), admitting any number of
    requests with any prompt length, streaming, compiles nothing: a compilation would stall every running stream for
    seconds. Nor does a Triton kernel launched outside the graphs compile a variant for the newcomers' rows (they
    start at row 1 here, behind a running stream: an odd offset into every per-slot tensor)."""
    import torch._dynamo.utils

    from q3tts.engine.request import StreamOptions
    from tests.kernels import triton_variants
    tts = real06
    eng = Engine(tts.ckpt, max_slots=32, max_seq_len=512)
    assert eng.runner.compiled_while_capturing == 0  # every variant came with the warm-ups (one span per batch)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    words = "Streams join and leave the batch at every frame while others keep talking".split()
    prompt = lambda i, n: tts.prepare_custom_voice(" ".join((words * 8)[: 2 + 7 * i]), "ryan",  # noqa: E731
                                                   max_new_tokens=n)[0]
    run_to_completion(eng, [eng.add_request(prompt(0, 6), StreamOptions(1, 4))])  # as the server's warm-up
    variants = triton_variants()
    background = eng.add_request(prompt(1, 400), StreamOptions(1, 4))  # row 0 throughout (unless it samples EOS)
    eng.step()
    # one alone, bursts (13, and 20: 16 then 4, the scheduler's cap per step: a wave graph (16, 128) into rows 1..16,
    # then alone), a few; prompt lengths from 12 to 114 positions
    for group in (1, 13, 3, 1, 20, 2):
        reqs = [eng.add_request(prompt(i, 6), StreamOptions(1, 4)) for i in range(group)]
        run_to_completion(eng, reqs)
        assert all(r.status.reason in ("stop", "length") and r.stream_done for r in reqs)
    eng.abort(background.request_id)
    run_to_completion(eng, [background])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
    assert triton_variants() == variants


def test_long_prompts_compile_nothing_after_warm_up(real06):
    """Prompts long enough for the attention's one-head-at-a-time branch (models.layers.ATTN_SCORES_CHUNK), alone
    and two together, compile nothing either: the warm-up compiles that branch too."""
    import torch._dynamo.utils

    from q3tts.models.layers import ATTN_SCORES_CHUNK
    tts = real06
    eng = Engine(tts.ckpt, max_slots=2, max_seq_len=4096)
    H = tts.ckpt.cfg.talker.num_attention_heads
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    words = "Streams join and leave the batch at every frame while others keep talking".split()
    for n, num_words in ((1, 2200), (2, 1200)):
        reqs = [eng.add_request(tts.prepare_custom_voice(" ".join((words * 200)[:num_words]), "ryan",
                                                         max_new_tokens=4)[0]) for _ in range(n)]
        L = max(len(r.prepared.layout) for r in reqs)
        assert n * H * L * eng.runner.kv_span(L) > ATTN_SCORES_CHUNK, L
        run_to_completion(eng, reqs)
        assert all(r.status.reason in ("stop", "length") for r in reqs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before


def test_paged_graphs_equal_contiguous_eager_fp32():
    """The paged cache in captured frames (block tables, scratch rows for padding, blocks handed out as rows grow)
    gives the contiguous eager engine's codes; 3 requests in 4 slots, blocks of 16 positions."""
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cuda", dtype=torch.float32)
    p = tts.prepare_custom_voice(["One, greedy.", "Two, a longer text with more words in it.", "Three."],
                                 ["vivian", "ryan", "serena"], do_sample=False, subtalker_dosample=False,
                                 max_new_tokens=81)
    paged = generate_codes(Engine(tts.ckpt, max_slots=4, max_seq_len=256, kv_block_size=16), p)
    for a, b in zip(paged, codes_with(tts, p, False)):
        assert torch.equal(a, b)


def test_wave_graphs_equal_the_same_wave_from_python_fp32():
    """A wave of more newcomers than PREFILL_GRAPH_MAX_REQUESTS replays its wave graph (20 rows: the (32, 64) graph,
    12 padding rows) behind a running row: code 0, the last hidden and the KV rows are bit-identical to the same
    padded wave launched from Python into the same rows (fp32), and the padding rows write nothing outside the free
    rows behind the wave."""
    from q3tts.models.talker import embed_prompt
    from tests.engine.test_engine import WaveReplay
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cuda", dtype=torch.float32)
    words = "A burst of newcomers arrives at once while one stream keeps talking".split()
    ps = tts.prepare_custom_voice([" ".join((words * 5)[: 24 + i]) for i in range(20)], "ryan", seed=3,
                                  max_new_tokens=8)  # prompts of 34 to 53 positions
    with torch.inference_mode():
        embeds = [embed_prompt(tts.ckpt.talker, p.layout, p.speaker_embedding, p.ref_codes) for p in ps]
    pre, trail, params = [e[0] for e in embeds], [e[1] for e in embeds], [p.params for p in ps]
    assert 32 < max(x.shape[0] for x in pre) <= 64
    runner = Engine(tts.ckpt, max_slots=64, max_seq_len=256).runner
    assert set(runner.wave_graphs) == {(N, L) for N in (16, 32, 64) for L in (32, 64, 128)}
    assert runner.compiled_while_capturing == 0
    replays = []
    graph = runner.wave_graphs[(32, 64)]
    runner.wave_graphs[(32, 64)] = type("Counted", (), {"replay": lambda self: (replays.append(1), graph.replay())})()

    def admit():
        with torch.inference_mode():
            runner.kv.fill_(7.0)
            runner.slots.last_hidden.fill_(7.0)
            codes0 = runner.prefill_batch(1, pre, trail, params)
            return codes0, runner.kv[:, :, :33 + 8].clone(), runner.slots.last_hidden.clone()
    replayed = admit()
    assert replays == [1]
    runner.wave_graphs = {key: WaveReplay(runner, *key) for key in runner.wave_graphs}
    launched = admit()
    assert runner.wave_graphs[(32, 64)].replays == 1
    assert replayed[0] == launched[0]
    assert torch.equal(replayed[1], launched[1]) and torch.equal(replayed[2], launched[2])
    assert bool((replayed[1][:, :, 0] == 7).all()) and bool((replayed[2][33:] == 7).all())
