"""Code2Wav: checkpoint names, offline decode vs upstream rules, exact streaming (CPU, fp32, tiny model)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from q3tts.config import Code2WavConfig, parse_speech_tokenizer_config, read_json
from q3tts.models.codec import CausalConv, CausalTransConv, Code2Wav, Transformer
from q3tts.randomckpt import init_tensor

ROOT = Path(__file__).resolve().parents[2]
TSV_NAME = "Qwen3-TTS-Tokenizer-12Hz.state_dict_shapes.tsv"
TSV_CANDIDATES = [ROOT / "q3tts" / "reference" / TSV_NAME, Path("/work/shared/reference/models/_derived") / TSV_NAME]
GOLDEN = ROOT / "tests" / "golden" / "fixtures" / "cv06"
TOL = 1e-5  # streaming vs one full decode, fp32; measured ~1e-6
SPF = 1920  # samples per frame

# Tiny but complete: 2 layers with window 8 (exercised by every T > 8), the real up-sampling factors.
TINY = Code2WavConfig(codebook_size=2048, codebook_dim=16, num_quantizers=16, latent_dim=32, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=16, sliding_window=8, upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2),
                      decoder_dim=32)


@lru_cache(maxsize=None)
def tiny_model() -> Code2Wav:
    model = Code2Wav(TINY).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = init_tensor("decoder." + name, tuple(p.shape), torch.float32, seed=0)
            # Damp the residual branches as training does: with the raw recipe the vocoder's activations
            # grow to ~50 and fp32 rounding (~1e-4 relative) would swamp a 1e-5 comparison.
            if name.endswith("conv2.conv.weight"):
                t = t * 0.3
            p.copy_(t)
        model.decoder[-1].conv.weight.mul_(0.1)  # keeps |wav| well inside the clamp
    return model


def rand_codes(T: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (batch, 16, T), generator=g)  # [B, K, T]


@lru_cache(maxsize=None)
def full(T: int, seed: int) -> torch.Tensor:
    with torch.no_grad():
        return tiny_model()(rand_codes(T, seed))  # [1, T*1920]


def schedule(kind: str, T: int) -> list[int]:
    if kind == "ones":
        pattern = itertools.repeat(1)
    elif kind == "random":
        g = torch.Generator().manual_seed(T)
        pattern = iter(torch.randint(1, 21, (T,), generator=g).tolist())
    else:  # "2,8" -> 2, 8, 8, 8, ...; "3,7,1,16" cycles
        first, *rest = [int(x) for x in kind.split(",")]
        pattern = itertools.chain([first], itertools.repeat(rest[0]) if len(rest) == 1 else itertools.cycle(rest))
    out, left = [], T
    for t in pattern:
        if left == 0:
            return out
        out.append(min(t, left))
        left -= out[-1]
    return out


def stream(model, codes, sizes, state=None):
    """Feed codes [B, K, T] in chunks of `sizes` frames; returns the chunks and the final state."""
    state = state if state is not None else model.init_state(codes.shape[0])
    chunks, start = [], 0
    for t in sizes:
        wav, state = model.decode_step(codes[..., start:start + t], state)
        assert wav.shape == (codes.shape[0], t * SPF)
        chunks.append(wav)
        start += t
    return chunks, state


def test_names_and_shapes_match_real_checkpoint():
    tsv = next((p for p in TSV_CANDIDATES if p.exists()), None)
    if tsv is None:
        pytest.skip(f"{TSV_NAME} not found")
    want = {}
    for line in tsv.read_text().splitlines():
        if line.startswith("decoder."):
            name, shape, _ = line.split("\t")
            want[name[len("decoder."):]] = tuple(int(x) for x in shape.split("x"))
    real = read_json(ROOT / "q3tts" / "reference" / "speech_tokenizer.config.json")
    cfg = parse_speech_tokenizer_config(real).decoder
    with torch.device("meta"):
        model = Code2Wav(cfg)
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert sorted(set(got) ^ set(want)) == []
    assert {n: s for n, s in got.items() if want[n] != s} == {}
    assert list(model.buffers()) == []  # pure module: no hidden state
    assert model.total_upsample == SPF


def test_offline_decode_is_causal_and_in_range():
    wav = full(120, 1)
    assert 0.05 < wav.abs().max() < 0.95  # non-degenerate, and the clamp hides nothing
    for n in (1, 9, 50):  # a prefix decodes to the prefix of the audio
        with torch.no_grad():
            head = tiny_model()(rand_codes(120, 1)[..., :n])
        torch.testing.assert_close(head, wav[:, :n * SPF], atol=TOL, rtol=0)


def test_attention_window_is_hf_sliding_window():
    # HF's sliding-window causal mask: query i sees keys j with i - W < j <= i. Through one layer,
    # perturbing frame j must change exactly frames j .. j+W-1 (streaming and full share the mask,
    # so only this test and the golden one pin its width).
    tr = Transformer(dataclasses.replace(TINY, num_hidden_layers=1)).eval()
    with torch.no_grad():
        for name, p in tr.named_parameters():
            p.copy_(init_tensor("decoder.pre_transformer." + name, tuple(p.shape), torch.float32, seed=0))
        x, pos = torch.randn(1, 20, TINY.latent_dim, generator=torch.Generator().manual_seed(0)), torch.arange(20)[None]
        y0 = tr(x, pos, pos)[0]
        x[:, 5] += 1.0
        changed = ((tr(x, pos, pos)[0] - y0).abs().amax(-1)[0] > 0).nonzero().flatten().tolist()
    assert changed == list(range(5, 5 + TINY.sliding_window))


@pytest.mark.parametrize("T, kind", [
    (1, "ones"), (5, "ones"), (9, "2,8"), (37, "3,7,1,16"), (37, "random"), (120, "2,8"),
    (333, "3,7,1,16"), (333, "random"), (400, "ones"),
])
def test_streaming_equals_full_decode(T, kind):
    model, ref = tiny_model(), full(T, T)
    assert ref.abs().max() < 0.95
    chunks, state = stream(model, rand_codes(T, T), schedule(kind, T))
    start = 0
    for c in chunks:  # every chunk is already final: equal to the full decode of all T frames
        torch.testing.assert_close(c, ref[:, start:start + c.shape[1]], atol=TOL, rtol=0)
        start += c.shape[1]
    assert start == T * SPF
    assert state.pos.tolist() == [T] and state.frames_processed == T


def test_batched_rows_equal_single_rows():
    model, T = tiny_model(), 60
    codes = torch.cat([rand_codes(T, 100 + b) for b in range(3)])  # [3, K, T], different rows
    batched = torch.cat(stream(model, codes, schedule("random", T))[0], dim=-1)
    for b in range(3):
        single = torch.cat(stream(model, codes[b:b + 1], schedule("3,7,1,16", T))[0], dim=-1)
        torch.testing.assert_close(batched[b:b + 1], single, atol=TOL, rtol=0)
        torch.testing.assert_close(batched[b:b + 1], full(T, 100 + b), atol=TOL, rtol=0)


def test_warm_icl_reference_then_stream():
    """ICL: reference codes run through a state, their audio dropped (as engine.vocoder warms a row), then the frames
    that follow decode as if the reference were in front of them."""
    model, gen = tiny_model(), rand_codes(30, 301)
    for R in (20, 11):
        ref = rand_codes(R, 300 + R)
        state = model.decode_step(ref, model.init_state(1))[1]
        out = torch.cat(stream(model, gen, schedule("3,7,1,16", 30), state)[0], dim=-1)
        with torch.no_grad():
            want = model(torch.cat([ref, gen], dim=-1))[:, R * SPF:]
        torch.testing.assert_close(out, want, atol=TOL, rtol=0)
    # per request in a batch: warm each row alone (different reference lengths), then stream together
    state, idx = model.init_state(2), torch.arange(2)
    for row, R in enumerate((20, 11)):
        state.assign_rows_(idx[row:row + 1], model.decode_step(rand_codes(R, 300 + R), model.init_state(1))[1])
    assert state.pos.tolist() == [20, 11]
    out = torch.cat(stream(model, torch.cat([gen, gen]), [4, 26], state)[0], dim=-1)
    for row, R in enumerate((20, 11)):
        with torch.no_grad():
            want = model(torch.cat([rand_codes(R, 300 + R), gen], dim=-1))[:, R * SPF:]
        torch.testing.assert_close(out[row:row + 1], want, atol=TOL, rtol=0)
    torch.testing.assert_close(state.select_rows(idx[1:]).pos, torch.tensor([11]))


def test_chunked_decode_follows_upstream_rule():
    model = tiny_model()
    with torch.no_grad():
        assert torch.equal(model.chunked_decode(rand_codes(120, 120)), full(120, 120))  # one chunk = forward
        codes, ref = rand_codes(400, 400), full(400, 400)
        chunked = model.chunked_decode(codes)
        # second chunk: frames 300..399 decoded from scratch with 25 frames of context in front
        assert torch.equal(chunked[:, 300 * SPF:], model(codes[..., 275:])[:, 25 * SPF:])
        torch.testing.assert_close(chunked, ref, atol=1e-3, rtol=0)
        # a short context shows it is an approximation of the full decode, not the full decode
        short = model.chunked_decode(codes[..., :120], chunk_size=50, left_context_size=2)
        assert torch.equal(short[:, 50 * SPF:100 * SPF], model(codes[..., 48:100])[:, 2 * SPF:])
        diff = (short - ref[:, :120 * SPF]).abs().max()
        assert 1e-4 < diff < 0.5


def test_decode_batch_pads_and_trims_like_upstream():
    model, lengths = tiny_model(), (37, 5, 20)
    items = [rand_codes(T, 500 + T)[0].T for T in lengths]  # [T_i, K] each
    wavs = model.decode_batch(items)
    for w, T in zip(wavs, lengths):
        assert w.shape == (T * SPF,)
        torch.testing.assert_close(w[None], full(T, 500 + T), atol=TOL, rtol=0)


def test_work_per_call_does_not_grow():
    model, codes = tiny_model(), rand_codes(320, 7)
    seen: list[tuple] = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((type(m).__name__, tuple(i[0].shape))))
             for m in model.modules() if isinstance(m, (CausalConv, CausalTransConv, torch.nn.Linear))]
    try:
        _, state = stream(model, codes[..., :10], [10])
        shapes0 = [tuple(t.shape) for t in (*state.tails, state.keys, state.values)]
        per_call = []
        for start in (10, 302):
            if start > 10:  # advance the stream to frame `start`
                _, state = stream(model, codes[..., 14:start], [16] * ((start - 14) // 16), state)
            seen.clear()
            before = state.frames_processed
            _, state = model.decode_step(codes[..., start:start + 4], state)
            assert state.frames_processed - before == 4
            per_call.append(list(seen))
        assert per_call[0] == per_call[1]  # identical work at history 10 and 302
        q_proj = model.pre_transformer.layers[0].self_attn.q_proj
        assert ("Linear", (1, 4, q_proj.in_features)) in per_call[0]  # only the 4 new frames
        assert [tuple(t.shape) for t in (*state.tails, state.keys, state.values)] == shapes0
    finally:
        for h in hooks:
            h.remove()


def test_rejects_bad_codes():
    model = tiny_model()
    with pytest.raises(ValueError):
        model(torch.zeros(1, 15, 4, dtype=torch.long))
    with pytest.raises(ValueError):
        model.decode_step(torch.zeros(2, 16, 4, dtype=torch.long), model.init_state(1))
    with pytest.raises(ValueError):
        model.decode_step(torch.zeros(1, 16, 0, dtype=torch.long), model.init_state(1))


def test_matches_official_decode_golden():
    """Official `Qwen3TTSTokenizerV2Model.decode` output recorded by tests/golden/make_golden.py (cv06)."""
    if not (GOLDEN / "manifest.json").exists():
        pytest.skip("golden fixture cv06 not present")
    from safetensors.torch import load_file

    from q3tts import randomckpt
    m = json.loads((GOLDEN / "manifest.json").read_text())
    out = load_file(str(GOLDEN / "outputs.safetensors"))
    if "decode_long.codes" not in out:
        pytest.skip("fixture has no decode_long case")
    sd = randomckpt.build_state_dict(m["speech_shapes"], m["seed"] + 1)  # the recipe of write_checkpoint
    randomckpt.apply_tweaks(sd, {k: v for k, v in m["tweaks"].items() if k == "output_conv_scale"})
    model = Code2Wav(parse_speech_tokenizer_config(m["speech_config"]).decoder).eval()
    model.load_state_dict({k[len("decoder."):]: v for k, v in sd.items() if k.startswith("decoder.")})
    codes = out["decode_long.codes"]  # [330, K]: two upstream chunks
    wavs = model.decode_batch([codes, codes[:37]])
    # the fixture's raw recipe amplifies fp32 rounding (see tiny_model); measured 7e-6
    for i, w in enumerate(wavs):
        torch.testing.assert_close(w, out[f"decode_long.wav.{i}"], atol=3e-5, rtol=0)
    streamed = torch.cat(stream(model, codes[:37].T[None], [3, 7, 1, 16, 10])[0], dim=-1)[0]
    torch.testing.assert_close(streamed, out["decode_long.wav.1"], atol=5e-5, rtol=0)  # measured 1.6e-5


def test_conv_weights_load_into_the_time_major_layout():
    """Every conv weight keeps the checkpoint's shape but is stored taps-middle after a real load (bf16), so the
    time-major layers read it with no copy: a channels-last conv weight, or a GEMM operand."""
    from safetensors.torch import load_file

    from q3tts.models.loaders import load_checkpoint
    from tests.golden import fixtures as fx
    if "cv06" not in fx.VARIANTS:
        pytest.skip("golden fixture cv06 not present")
    c2w = load_checkpoint(fx.checkpoint("cv06"), device="cpu", dtype=torch.bfloat16).code2wav
    convs = [m for m in c2w.modules() if isinstance(m, (CausalConv, CausalTransConv))]
    assert len(convs) == 1 + 2 * 2 + 1 + 4 * 7 + 1  # pre_conv, 2 x (up, dwconv), decoder conv, 4 x 7, last conv
    for m in convs:
        w = m.conv.weight
        assert w.dtype == torch.bfloat16 and w.permute(0, 2, 1).is_contiguous(), m
    sd = load_file(str(fx.checkpoint("cv06") / "speech_tokenizer" / "model.safetensors"))
    assert torch.equal(convs[-1].conv.weight, sd["decoder.decoder.6.conv.weight"].to(torch.bfloat16))


def test_a_codebook_table_is_made_once_per_weights():
    """EuclideanCodebook.table: made at the first decode and reused (a captured vocoder call then reads it rather than
    making it), made again once its weights change in place or move, and equal to the expression it caches."""
    cb = Code2Wav(TINY).quantizer.rvq_first.vq.layers[0]._codebook
    with torch.no_grad():
        cb.embedding_sum.normal_()
        cb.cluster_usage.uniform_(0.5, 4.0)
    want = lambda: cb.embedding_sum / cb.cluster_usage.clamp(min=1e-5)[:, None]  # noqa: E731
    first = cb.table()
    assert cb.table() is first and torch.equal(first, want())
    with torch.no_grad():
        cb.cluster_usage.mul_(2)  # in place: the same storage, a new version
    again = cb.table()
    assert again is not first and torch.equal(again, want())
    cb.double()  # moved: new storage
    assert cb.table().dtype == torch.float64 and torch.equal(cb.table(), want())
