"""StreamingVocoder: pooled per-request states, chunks cut into power-of-two pieces, batched across requests
== one full decode of each request's codes (CPU, fp32, the tiny Code2Wav of tests/models/test_codec.py)."""

import numpy as np
import pytest
import torch

from q3tts.engine.vocoder import StreamingVocoder, final_pieces, pieces
from tests.models.test_codec import SPF, TOL, rand_codes, tiny_model


def test_pieces():
    assert pieces(13, 16) == [8, 4, 1]
    assert pieces(40, 16) == [16, 16, 8]
    assert pieces(16, 16) == [16] and pieces(1, 4) == [1] and pieces(0, 16) == []
    assert all(sum(pieces(n, m)) == n for n in range(1, 70) for m in (1, 2, 8, 16))


def test_final_pieces():
    assert final_pieces(13, 16) == [16] and final_pieces(40, 16) == [16, 16, 8] and final_pieces(16, 16) == [16]
    assert final_pieces(3, 4) == [4] and final_pieces(0, 16) == []
    for n in range(1, 70):  # whole pieces, then one power of two that covers the rest, padded by less than itself
        got = final_pieces(n, 16)
        assert got[:-1] == [16] * (len(got) - 1) and 0 <= sum(got) - n < got[-1] and got[-1] & (got[-1] - 1) == 0


def full(codes: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return tiny_model()(codes)[0].numpy()  # codes [1, K, T] -> [T*1920]


@pytest.mark.parametrize("max_call_frames", [64, 16])
def test_interleaved_streams_equal_full_decodes(max_call_frames):
    """Three streams with different chunkings share calls (same-size pieces batch together, split into calls
    of at most max_call_frames rows x frames); one of them is ICL-warmed; a row freed by a finished stream is
    reused by a new one and starts fresh."""
    voc = StreamingVocoder(tiny_model(), max_rows=3, max_call_frames=max_call_frames)
    codes = {name: rand_codes(T, seed)[0].T for name, T, seed in (("a", 23, 1), ("b", 30, 2), ("c", 9, 3), ("d", 12, 4))}
    ref = rand_codes(11, 5)[0].T  # [11, K]: ICL reference of stream b
    chunks = {"a": [1, 2, 4, 16], "b": [1, 2, 4, 8, 15], "c": [3, 6], "d": [5, 7]}
    rows = dict(zip("abc", voc.open([None, ref, None])))
    out: dict[str, list[np.ndarray]] = {k: [] for k in chunks}
    done = {k: 0 for k in chunks}
    while rows:
        work = []
        for name, row in rows.items():
            n = chunks[name][len(out[name])]
            work.append((name, row, codes[name][done[name]: done[name] + n]))
            done[name] += n
        for (name, _, _), wav in zip(work, voc.decode([(row, c) for _, row, c in work])):
            out[name].append(wav)
        for name in [n for n in rows if len(out[n]) == len(chunks[n])]:
            voc.close(rows.pop(name))
            if name == "c":  # d takes c's row at once
                rows["d"] = voc.open([None])[0]
                assert rows["d"] == 2
    assert not rows and sorted(voc.free_rows) == [0, 1, 2]
    for name in "acd":
        got = np.concatenate(out[name])
        assert got.shape == (codes[name].shape[0] * SPF,)
        assert np.abs(got - full(codes[name].T[None])).max() <= TOL, name
    with_ref = full(torch.cat([ref, codes["b"]]).T[None])[ref.shape[0] * SPF:]  # the reference's audio is dropped
    assert np.abs(np.concatenate(out["b"]) - with_ref).max() <= TOL


def test_a_final_chunk_is_padded_into_the_call_of_its_piece_size(monkeypatch):
    """A stream's final chunk of 13 frames goes as one 16-frame piece (3 frames of code 0, their audio dropped) in the
    call of another stream's 16-frame chunk: 1 call instead of 4 (16 and 8, then 4, then 1). Its 13 frames' audio is the
    full decode's (the decoder is causal), and the other stream goes on exactly."""
    a, b = rand_codes(32, 1)[0].T, rand_codes(20, 2)[0].T
    for final, want_calls in ((False, 4), (True, 1)):
        voc = StreamingVocoder(tiny_model(), max_rows=2)
        ra, rb = voc.open([None, None])
        first = voc.decode([(ra, a[:16]), (rb, b[:7])])
        calls = []
        call = voc._call
        monkeypatch.setattr(voc, "_call", lambda rows, codes: calls.append(codes.shape) or call(rows, codes))
        wa, wb = voc.decode([(ra, a[16:]), (rb, b[7:])], final=[False, final])
        assert len(calls) == want_calls and wb.shape == (13 * SPF,)
        assert np.abs(np.concatenate([first[1], wb]) - full(b.T[None])).max() <= TOL
        assert np.abs(np.concatenate([first[0], wa]) - full(a.T[None])).max() <= TOL


def _state_of(state):
    return (*state.tails, state.keys, state.values, state.pos)


def test_a_reference_is_warmed_once_and_kept(monkeypatch):
    """An ICL row is warmed by decoding its reference through it as one chunk, audio dropped: its state is what
    streaming those frames makes, bit for bit. Rows opened with the same reference share that one decode (the state is
    kept); another reference is decoded on its own; past WARM_CACHE_BYTES the least recently used state is dropped
    (and decoded again when its reference comes back)."""
    from q3tts.engine import vocoder as V
    voc = StreamingVocoder(tiny_model(), max_rows=4)
    decode, calls = voc.decode, []
    monkeypatch.setattr(voc, "decode", lambda work, sizes=None: calls.append(work[0][1].shape[0]) or decode(work, sizes))
    ref, other = rand_codes(11, 5)[0].T, rand_codes(7, 6)[0].T
    rows = voc.open([ref, None, ref.clone()])
    assert calls == [11]
    streamed = StreamingVocoder(tiny_model(), max_rows=1)  # the reference streamed as a chunk, its audio played
    row = streamed.open([None])[0]
    streamed.decode([(row, ref)])
    want = _state_of(streamed.pool.select_rows(torch.tensor([row])))
    for row in (rows[0], rows[2]):
        assert all(torch.equal(a, b) for a, b in zip(_state_of(voc.pool.select_rows(torch.tensor([row]))), want))
    assert not voc.pool.select_rows(torch.tensor([rows[1]])).pos.any()  # no reference: a fresh row
    for row in rows:
        voc.close(row)
    voc.open([other])
    assert calls == [11, 7] and len(voc.warmed) == 2
    monkeypatch.setattr(V, "WARM_CACHE_BYTES", voc.warmed_bytes // 2)  # room for one state (all are one size)
    voc.open([rand_codes(5, 7)[0].T])  # kept alone: the two before it go, the least recently used first
    assert calls == [11, 7, 5] and len(voc.warmed) == 1 and voc.warmed_bytes == V.WARM_CACHE_BYTES
    voc.open([ref])  # decoded again
    assert calls == [11, 7, 5, 11]


def test_batch_invariant_mode_decodes_each_stream_as_alone():
    """In batch-invariant mode (q3tts.invariant) three streams decoded together give each stream's audio alone, bit
    for bit: each piece is its own call (a convolution's or GEMM's kernel, and its sums' order, may follow the rows)."""
    from q3tts import invariant
    codes = [rand_codes(T, seed)[0].T for T, seed in ((9, 1), (13, 2), (5, 3))]
    invariant.set_enabled(True)
    try:
        voc = StreamingVocoder(tiny_model(), max_rows=3)
        assert set(voc.call_rows.values()) == {1}  # as the mode is at its build: one row per call (and graph)
        together = voc.decode(list(zip(voc.open([None] * 3), codes)))
        alone = []
        for c in codes:
            one = StreamingVocoder(tiny_model(), max_rows=1)
            alone += one.decode([(one.open([None])[0], c)])
    finally:
        invariant.set_enabled(False)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(alone, together))


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_graphs_equal_eager_on_gpu(compiled):
    """The captured (rows bucket, piece) calls, padded with scratch rows, give the eager calls' audio, and both the
    CPU's; compiled: the graphs' pre-transformer compiled by Inductor, as the engine captures them."""
    model = tiny_model().to("cuda")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # fp32 convolutions in fp32 (TF32 rounds operands to 10 bits: ~5e-4)
    try:
        eager = StreamingVocoder(model, max_rows=5)
        graphed = StreamingVocoder(model, max_rows=5, use_graphs=True, compiled=compiled)
        # rows 1, 2, 4, 8 x pieces 1, 2, 4, 8; rows 1, 2, 4 x piece 16 (64 rows x frames per call at most)
        assert graphed.capture_graphs() == 4 * 4 + 3
        streams = [rand_codes(37, s)[0].T for s in range(3)]
        res = []
        for voc in (eager, graphed):
            rows = voc.open([None, rand_codes(6, 9)[0].T, None])
            outs = [[] for _ in streams]
            for lo, hi in ((0, 1), (1, 3), (3, 10), (10, 37)):
                for o, wav in zip(outs, voc.decode([(r, s[lo:hi]) for r, s in zip(rows, streams)])):
                    o.append(wav)
            res.append([np.concatenate(o) for o in outs])
        for e, g in zip(*res):
            assert np.abs(e - g).max() <= 1e-4
        # and the CUDA kernels (Triton joins, cuDNN channels-last convolutions) give the CPU's full decode: float
        # sums in another order, as between batch sizes (tests/engine/test_paged.py)
        tiny_model().to("cpu")
        wants = [full(streams[0].T[None]), full(torch.cat([rand_codes(6, 9)[0].T, streams[1]]).T[None])[6 * SPF:],
                 full(streams[2].T[None])]
        for g, want in zip(res[1], wants):
            assert g.shape == want.shape and np.abs(g - want).max() <= 1e-4
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
        tiny_model().to("cpu")


def test_the_compiled_pre_transformer_gives_the_eager_audio():
    """compiled=True (the engine's choice wherever it compiles): the pre-transformer's layers compiled by Inductor
    (q3tts.engine.compile.compile_codec) give the eager vocoder's audio (fp32: the same sums, some in another order),
    and the decoder module itself stays eager (its offline decodes of other lengths must not compile while serving)."""
    import torch._dynamo.utils
    model = tiny_model()
    streams = [rand_codes(8, seed)[0].T for seed in (1, 2)]
    outs, traced = [], torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for compiled in (False, True):
        voc = StreamingVocoder(model, max_rows=2, compiled=compiled)
        rows = voc.open([None, None])
        chunks = [voc.decode([(r, s[lo:hi]) for r, s in zip(rows, streams)]) for lo, hi in ((0, 4), (4, 8))]
        outs.append([np.concatenate(parts) for parts in zip(*chunks)])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > traced  # the compiled run did compile
    for e, c in zip(*outs):
        assert e.shape == (8 * SPF,) and np.abs(e - c).max() <= TOL
    assert not hasattr(model.pre_transformer.forward, "_torchdynamo_orig_callable")
    assert isinstance(model.pre_transformer.forward, type(model.forward))  # a plain bound method
