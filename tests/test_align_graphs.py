"""ForcedAligner(graphs=True), the padded bucketed pass: the same words and times as the eager pass (and the official
fixtures), with padding rows, chunks and tokens that never reach a real one. On CPU the padded pass runs as is; the
CUDA-graph replay of it is checked on a GPU (the `gpu` marker)."""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np
import pytest
import torch

import q3tts.align as align_mod
from q3tts.align import AlignerWorker, ForcedAligner
from q3tts.models.audio_encoder import Ragged, reflect_rows, reflect_rows_device, tokens_after_cnn
from tests.test_align import CASES, aligner, audio, checkpoint, expected, run_case_with


def zero_padded(wavs: list[np.ndarray]) -> torch.Tensor:
    """Waveforms as rows [B, max_len], zeros past each."""
    out = np.zeros((len(wavs), max(w.shape[0] for w in wavs)), np.float32)
    for b, w in enumerate(wavs):
        out[b, :w.shape[0]] = w
    return torch.from_numpy(out)


@lru_cache(maxsize=1)
def fast() -> ForcedAligner:
    return ForcedAligner.from_pretrained(checkpoint(), device="cpu", graphs=True)


@pytest.fixture
def padded_calls(monkeypatch):
    """Each padded pass's bucket key (None: the batch ran eagerly)."""
    calls = []
    orig = align_mod._PaddedPass.__call__

    def spy(self, items, frames):
        out = orig(self, items, frames)
        calls.append(out.key if out is not None else None)
        return out
    monkeypatch.setattr(align_mod._PaddedPass, "__call__", spy)
    return calls


@pytest.mark.parametrize("name", ["en", "zh", "mixed", "en_24k", "long_windowed"])
def test_padded_pass_equals_the_official(name, padded_calls):
    """Single utterances of a second or more go through the padded pass (long_windowed: two attention windows, its
    chunks padded to a multiple of a window) and give the official's words and times."""
    case = CASES[name]
    assert run_case_with(fast(), case) == expected(case)
    assert padded_calls and padded_calls[-1] is not None


def _rows_alone(a: ForcedAligner, names: list[str], texts: list[str], lang: str = "English"):
    items = [audio(n) for n in names]
    return a.align([w for w, _ in items], [sr for _, sr in items], texts, lang, rows_alone=True)


def test_padded_batch_equals_eager_rows_alone(padded_calls):
    """Three rows of different lengths padded to a bucket of four rows: each row's words and times are the eager
    pass's (rows_alone), and the longest row's are the official's for it alone."""
    names = ["c", "b", "d", "long"]
    texts = [CASES["en"]["text"][0], "one two three four", CASES["en_24k"]["text"][0], CASES["long_windowed"]["text"][0]]
    for k in (3, 4):
        got = _rows_alone(fast(), names[:k], texts[:k])
        assert got == _rows_alone(aligner(), names[:k], texts[:k])
        assert padded_calls[-1][0] == 4  # rows bucketed to a power of two
    assert got[0] == expected(CASES["en"])[0]


def test_padded_logits_equal_eager_logits():
    """Under the argmax: the padded pass's logits at the <timestamp> slots equal the packed pass's (fp32 GEMM order
    differs with the padded shapes: 1e-4)."""
    a = fast()
    items = [a._item(*audio(n), t, "English", i) for i, (n, t) in enumerate([("c", "a b c d"), ("b", "e f")])]
    frames = [it.wav.shape[0] // 160 for it in items]
    rows = a._prompts(items, frames)
    key = a._padded.key(frames, [len(r) for r in rows])
    x = a._padded._buffers(key)
    captured = {}
    orig = a._padded._pass

    def spy(inputs):
        captured["logits"] = a.thinker.forward_padded(inputs["ids"], inputs["mel"], inputs["mask"],
                                                      inputs["audio_at"])
        return orig(inputs)
    a._padded._pass = spy
    try:
        with torch.inference_mode():
            a._padded(items, frames)
            mel, fr = a._features(items, rows_alone=True)
            audio_emb = a.thinker.audio_tower(mel, fr)
            ids = np.concatenate(rows)
            select = np.flatnonzero(ids == a.cfg.timestamp_token_id)
            from q3tts.models.audio_encoder import Ragged
            ref = a.thinker(torch.from_numpy(ids), Ragged.of([len(r) for r in rows], "cpu"), audio_emb,
                            torch.from_numpy(select))
    finally:
        del a._padded._pass
    got = torch.cat([captured["logits"][b, :len(r)][torch.from_numpy(r == a.cfg.timestamp_token_id)]
                     for b, r in enumerate(rows)])
    assert x["ids"].shape[0] == 2 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_encoder_padded_equals_packed():
    """AudioEncoder.forward_padded (rows zero-padded to whole chunks, windows masked) gives each row's tokens of
    forward (packed, windows cut per row), for rows of one chunk, a tail and two windows."""
    tower = aligner().thinker.audio_tower
    g = torch.Generator().manual_seed(3)
    frames = [100, 250, 1130]
    chunk = 2 * tower.cfg.n_window
    C = 16  # 1130 frames: 12 chunks, padded to two windows of 8
    mel = torch.zeros(len(frames), 128, C * chunk)
    for b, f in enumerate(frames):
        mel[b, :, :f] = torch.randn(128, f, generator=g) * 0.5
    T = tower.window_tokens(C)
    W = C * tokens_after_cnn(chunk) // T
    mask = torch.zeros(len(frames), W, T, dtype=torch.bool)
    for b, f in enumerate(frames):
        mask[b].view(-1)[:tokens_after_cnn(f)] = True
    mask = mask.view(-1, T)
    mask[~mask.any(1)] = True
    with torch.inference_mode():
        padded = tower.forward_padded(mel, mask)
        packed = tower(mel[:, :, :max(frames)], frames).split([tokens_after_cnn(f) for f in frames])
    for b, p in enumerate(packed):
        torch.testing.assert_close(padded[b, :p.shape[0]], p, atol=1e-5, rtol=1e-5)


def test_reflect_rows_on_the_device_equal_the_host():
    rng = np.random.default_rng(0)
    wavs = [rng.standard_normal(n).astype(np.float32) for n in (321, 1000, 4567)]
    host, _ = reflect_rows(wavs)
    lengths = [w.shape[0] for w in wavs]
    dev = reflect_rows_device(zero_padded(wavs), torch.tensor(lengths))
    assert torch.equal(dev, torch.from_numpy(host))


def test_rows_under_one_chunk_run_eagerly(padded_calls):
    """The official pads a sub-second utterance's single chunk to its own length, not a chunk: such a batch runs
    the eager pass, with the official's words."""
    case = CASES["short"]
    assert run_case_with(fast(), case) == expected(case)
    assert padded_calls == [None]


def test_buckets():
    p = fast()._padded
    per = fast().cfg.audio.n_window_infer // (2 * fast().cfg.audio.n_window)
    assert p.key([500] * 3, [100, 117, 90]) == (4, 5, 16000, 120)  # rows to a power of two, tokens to 8s
    assert p.key([100], [33], 24000) == (1, 1, 24000, 40)
    # a bucket's rows hold every waveform of its frames: at most C chunks of frames, at 16 kHz or the input rate
    assert p.samples((1, 1, 16000)) == 100 * 160 + 159 and p.samples((1, 1, 24000)) == -(-(100 * 160 + 159) * 3 // 2)
    assert p.key([930, 500], [10, 10])[1] == 2 * per  # past one window: whole windows of chunks
    assert p.key([99, 500], [10, 10]) is None


def test_fused_qkv_weights_are_held_once():
    enc = aligner().thinker.audio_tower
    for layer, (w, b) in zip(enc.layers, enc.qkv):
        a = layer.self_attn
        assert a.q_proj.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        assert a.v_proj.bias.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert torch.equal(w[-a.v_proj.out_features:], a.v_proj.weight)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_batch_prepared_on_the_prep_threads(device, monkeypatch):
    """A large batch's checks (and on CUDA its copies into the upload buffer) run on the prep threads in groups of
    rows: the words of the batch prepared on the calling thread, and a bad row's error is the first bad row's."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a = ForcedAligner.from_pretrained(checkpoint(), device=device, dtype=torch.float32, graphs=True)
    names = ["c", "b", "d", "long", "c", "d"]
    texts = [CASES["en"]["text"][0], "one two three four", CASES["en_24k"]["text"][0], CASES["long_windowed"]["text"][0],
             "five six", "seven eight nine"]
    alone = _rows_alone(a, names, texts)
    groups = []
    orig = ForcedAligner._in_groups

    def spy(self, fn, n, samples):
        out = orig(self, fn, n, samples)
        groups.append(len(out))
        return out
    monkeypatch.setattr(ForcedAligner, "_in_groups", spy)
    monkeypatch.setattr(align_mod, "PREP_MIN_SAMPLES", 0)
    monkeypatch.setattr(align_mod, "PREP_MIN_ROWS", 2)
    assert _rows_alone(a, names, texts) == alone
    assert groups and min(groups) == min(3, a._prep_threads) and (device == "cpu" or len(groups) == 2)
    wavs = [audio(n) for n in names]
    bad = [w for w, _ in wavs]
    bad[3] = np.full_like(bad[3], np.nan)
    bad[5] = np.full_like(bad[5], np.inf)
    with pytest.raises(ValueError, match="item 3: audio has NaN"):
        a.align(bad, [sr for _, sr in wavs], texts, "English", rows_alone=True)


class _ReplayedOnCPU:
    """A CUDA graph's contract on a CPU: fn's output is one static tensor, which replay() recomputes in place from
    the static inputs that fn reads."""

    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def replay(self):
        self.out.copy_(self.fn())


def test_encoder_and_lm_graphs_emulated_on_cpu(monkeypatch):
    """The captured route's plumbing (the encoder's graph replayed before the prompts are tokenized, the LM's graph
    reading the encoder graph's static output, each bucket's inputs written in place) with graphs emulated on the
    CPU: the words of the uncaptured pass, and a second batch of the bucket, its rows in another order, replays the
    same two graphs."""
    a = ForcedAligner.from_pretrained(checkpoint(), device="cpu", graphs=True)
    p = a._padded
    monkeypatch.setattr(p, "_graph", lambda fn: (lambda g: (g, g.out))(_ReplayedOnCPU(fn)))
    p.capture = True
    names, texts = ["c", "b", "d"], [CASES["en"]["text"][0], "one two three four", CASES["en_24k"]["text"][0]]
    want = _rows_alone(fast(), names, texts)
    assert _rows_alone(a, names, texts) == want
    keys = set(p.graphs)
    assert sorted(map(len, keys)) == [3, 4]
    assert _rows_alone(a, names[::-1], texts[::-1]) == want[::-1] and set(p.graphs) == keys


@pytest.mark.gpu
def test_cuda_graphs_equal_the_padded_pass_uncaptured():
    """On CUDA (fp32): the captured graphs' replay gives the words of the same padded pass launched op by op, and a
    second batch of the same bucket replays the encoder and LM graphs captured by the first (loading captured the
    warm-up's)."""
    a = ForcedAligner.from_pretrained(checkpoint(), device="cuda", dtype=torch.float32, graphs=True)
    warm = set(a._padded.graphs)
    names, texts = ["c", "b", "d"], [CASES["en"]["text"][0], "one two three four", CASES["en_24k"]["text"][0]]
    graphed = _rows_alone(a, names, texts)
    new = set(a._padded.graphs) - warm
    assert sorted(map(len, new)) == [3, 4]  # the bucket's encoder (rows, chunks, rate) and LM (+ tokens)
    assert _rows_alone(a, names[::-1], texts[::-1]) == graphed[::-1] and set(a._padded.graphs) == warm | new
    # the pass entered directly, outside align()'s inference mode, writes the same captured inputs
    items = [a._item(*audio(n), t, "English", i, ready=False) for i, (n, t) in enumerate(zip(names, texts))]
    assert a._run(items, rows_alone=True) == graphed
    a._padded.capture = False  # the same pass launched op by op, on the graph's own inputs
    assert _rows_alone(a, names, texts) == graphed


def test_device_resampler_is_soxrs_filter():
    """Polyphase (soxr's filter read off its impulse responses, run as a float64 FFT correlation) against
    q3tts.audio.resample (soxr_hq) on noise, a tone and the fixtures' 24 kHz audio, rows of different lengths in one
    call. Max abs difference 1e-6: both compute the same filter; soxr rounds its sums to float32 (about 2.4e-7 here)."""
    from q3tts.audio import resample
    from q3tts.models.resample import Polyphase
    rng = np.random.default_rng(0)
    for sr in (24000, 8000, 48000):
        f = Polyphase.of(sr, 16000)
        assert f is not None
        wavs = [(0.3 * rng.standard_normal(int(sr * 1.3))).astype(np.float32),
                np.sin(np.arange(sr + 7) * 0.3).astype(np.float32)]
        if sr == 24000:
            wavs.append(audio("d")[0])
        lengths = [w.shape[0] for w in wavs]
        got = f(zero_padded(wavs), lengths)
        for w, g in zip(wavs, got):
            want = resample(w, sr, 16000)
            assert f.out_len(w.shape[0]) == want.shape[0]
            assert np.abs(g[:want.shape[0]].numpy() - want).max() <= 1e-6
            assert not g[want.shape[0]:].any()
    assert Polyphase.of(44100, 16000) is None  # a period of 441 input samples: soxr on the CPU


@pytest.mark.parametrize("name", ["en_24k", "long_windowed"])
def test_resampling_on_the_device_gives_the_officials_words(name):
    """24 kHz (en_24k) and 8 kHz (long) audio resampled by the device filter: the official's words and times."""
    a = ForcedAligner.from_pretrained(checkpoint(), device="cpu", graphs=True, resample_on_device=True)
    case = CASES[name]
    assert run_case_with(a, case) == expected(case)
    assert any(f is not None for f in a._padded.resamplers.values())


@pytest.mark.parametrize("graphs", [False, True])
def test_align_leaves_the_callers_audio_as_it_was(graphs):
    """align() keeps a float32 waveform without copying it: nothing of the pass writes into it (peak scaling, clipping
    and resampling make new arrays), and a loud row (peak past 1) gets the words of a copy of it aligned alone."""
    a = fast() if graphs else aligner()
    wav, sr = audio("d")
    loud = wav * 4.0
    before = loud.copy()
    got = a.align([loud, wav], sr, ["one two", "three four"], "English", rows_alone=True)
    assert np.array_equal(loud, before)
    assert got[0] == aligner().align(before.copy(), sr, "one two", "English")


def _bf16_passes(a: ForcedAligner, wavs: list[np.ndarray], sr: int, texts: list[str]) -> dict[str, list]:
    """The eager pass (rows_alone) and the padded pass of `a` on the same rows: each row's mel into the audio encoder
    [mel, frames] and logits at its <timestamp> slots [m, classes], in the model's dtype."""
    ts = a.cfg.timestamp_token_id
    items = [a._item(w, sr, t, "English", i, ready=False) for i, (w, t) in enumerate(zip(wavs, texts))]
    frames = [it.num_samples // 160 for it in items]
    rows = a._prompts(items, frames)
    seen = {}

    def spy(x):
        seen["mel"] = x["mel"].clone()
        seen["logits"] = a.thinker.forward_padded(x["ids"], x["mel"], x["mask"], x["audio_at"])
        return seen["logits"].argmax(-1)
    a._padded._pass = spy
    try:
        with torch.inference_mode():
            a._padded(items, frames)
            ready = [it.ready() for it in items]
            mel, fr = a._features(ready, rows_alone=True)
            assert fr == frames
            select = np.flatnonzero(np.concatenate(rows) == ts)
            eager = a.thinker(torch.from_numpy(np.concatenate(rows)), Ragged.of([len(r) for r in rows], "cpu"),
                              a.thinker.audio_tower(mel, fr), torch.from_numpy(select))
    finally:
        del a._padded._pass
    m = np.cumsum([int((r == ts).sum()) for r in rows])[:-1]
    return dict(padded_mel=[seen["mel"][b, :, :f] for b, f in enumerate(frames)],
                eager_mel=[mel[b, :, :f] for b, f in enumerate(frames)],
                padded=[seen["logits"][b, :len(r)][torch.from_numpy(r == ts)] for b, r in enumerate(rows)],
                eager=list(eager.tensor_split(torch.from_numpy(m))))


@lru_cache(maxsize=2)
def _bf16_runs(on_device: bool) -> tuple[dict, dict]:
    """_bf16_passes in float32 and in bfloat16, on three 24 kHz rows (resampled on the device or by soxr)."""
    from q3tts.audio import resample
    wavs = [audio("d")[0]] + [resample(audio(n)[0], 16000, 24000) for n in ("c", "b")]
    texts = [CASES["en_24k"]["text"][0], CASES["en"]["text"][0], "one two three four"]
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        a = ForcedAligner.from_pretrained(checkpoint(), device="cpu", dtype=dtype, graphs=True,
                                          resample_on_device=on_device)
        out.append(_bf16_passes(a, wavs, 24000, texts))
    return out[0], out[1]


@pytest.mark.parametrize("on_device", [False, True])
def test_bf16_padded_features_are_the_eager_ones_rounded(on_device):
    """The padded pass's log-mel is the eager pass's: equal when both resample with soxr; with the device resampler
    (within 1e-6 of soxr) the float32 mels differ by under 1e-4, and the bf16 features are those mels rounded: apart
    by that difference plus bf16's rounding of each (a step of the value's last bit where a value sits near a
    rounding boundary) - the only difference the padded pass adds to the features."""
    f32, bf16 = _bf16_runs(on_device)
    for p32, e32, p16, e16 in zip(f32["padded_mel"], f32["eager_mel"], bf16["padded_mel"], bf16["eager_mel"]):
        assert p16.dtype == e16.dtype == torch.bfloat16
        if not on_device:
            assert torch.equal(p32, e32) and torch.equal(p16, e16)
            continue
        assert (p32 - e32).abs().max() < 1e-4
        # round to nearest in bf16 (8 significant bits) moves a value by at most 2^-8 of it
        assert torch.equal(p16, p32.to(torch.bfloat16)) and torch.equal(e16, e32.to(torch.bfloat16))
        assert ((p16.float() - e16.float()).abs() <= (p32 - e32).abs() + 2.0 ** -8 * (p32.abs() + e32.abs())).all()


@pytest.mark.parametrize("on_device", [False, True])
def test_bf16_padded_logits_within_bf16_rounding_of_eager(on_device):
    """In bf16 the padded pass's <timestamp> logits differ from the eager pass's by no more than two bf16 roundings of
    the same float32 pass can: twice the eager bf16 pass's own distance from float32 (both passes round the same
    computation along other GEMM shapes, or from features one bf16 step apart). An argmax can therefore change only
    at slots whose top-2 gap is under that difference: a near tie, which random weights (near-uniform logits over
    5000 classes) make common (bench/aligner_precision.py); in float32 the passes agree to 1e-4
    (test_padded_logits_equal_eager_logits)."""
    f32, bf16 = _bf16_runs(on_device)
    ref = torch.cat(f32["eager"])
    eager, padded = torch.cat(bf16["eager"]).float(), torch.cat(bf16["padded"]).float()
    assert eager.shape == padded.shape == ref.shape
    bf16_error = (eager - ref).abs().max()
    assert bf16_error > 0  # the bound is bf16's own rounding, not zero
    assert (padded - eager).abs().max() <= 2 * bf16_error
    torch.testing.assert_close(torch.cat(f32["padded"]), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_worker_gives_the_words_of_align(device):
    """AlignerWorker's path (on CUDA each waveform staged in page-locked memory at submission and copied straight to
    the device in its pass) gives the words of align() with rows_alone, for a batch that its passes take together."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a = ForcedAligner.from_pretrained(checkpoint(), device=device, dtype=torch.float32, graphs=True)
    names = ["c", "b", "d", "long"]
    texts = [CASES["en"]["text"][0], "one two three four", CASES["en_24k"]["text"][0], CASES["long_windowed"]["text"][0]]
    want = _rows_alone(a, names, texts)
    release = threading.Event()
    worker = AlignerWorker(a, busy=lambda: not release.is_set(), max_defer_s=60.0)  # holds its pass until released
    try:
        futs = [worker.submit(*audio(n), t, "English") for n, t in zip(names, texts)]
        staged = [it.pinned for it, _, _ in worker._queue]
        assert all((p is not None and p.is_pinned()) if device == "cuda" else p is None for p in staged)
        release.set()
        assert [f.result(timeout=120) for f in futs] == want
    finally:
        worker.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_worker_passes_overlap_and_each_gets_its_own_words(device, monkeypatch):
    """Passes of one row each, launched back to back: each pass is launched before the last one's words are handed
    out (on CUDA its inputs are written while the last one runs, into the static buffers of a bucket they may share),
    and every utterance gets the words of align() alone; align() called meanwhile from another thread (another
    stream) gets its own."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a = ForcedAligner.from_pretrained(checkpoint(), device=device, dtype=torch.float32, graphs=True)
    names = ["c", "b", "d", "long", "c", "d", "b", "long"]
    texts = [CASES["en"]["text"][0], "one two three four", CASES["en_24k"]["text"][0], CASES["long_windowed"]["text"][0],
             "five six seven", "eight nine", "ten eleven twelve", "thirteen"]
    want = [a.align(*audio(n), t, "English") for n, t in zip(names, texts)]
    order = []  # the worker thread's launches and hand-outs, in order
    start, hand_out = a._start, AlignerWorker._hand_out

    def log(what: str) -> None:
        if threading.current_thread().name == "q3tts-aligner":
            order.append(what)
    monkeypatch.setattr(a, "_start", lambda items, rows_alone=False: log("start") or start(items, rows_alone))
    monkeypatch.setattr(AlignerWorker, "_hand_out", staticmethod(
        lambda launched: (launched is not None and log("hand out"), hand_out(launched))[1]))
    release = threading.Event()
    worker = AlignerWorker(a, max_batch=1, busy=lambda: not release.is_set(), max_defer_s=60.0)
    try:
        futs = [worker.submit(*audio(n), t, "English") for n, t in zip(names, texts)]
        release.set()
        assert a.align(*audio("d"), texts[2], "English") == want[2]  # beside the worker's passes
        assert [f.result(timeout=120) for f in futs] == want
    finally:
        worker.close()
    assert order == ["start"] + ["start", "hand out"] * (len(names) - 1) + ["hand out"]


@pytest.mark.gpu
def test_audio_on_the_device_gives_the_words_of_host_audio(monkeypatch):
    """Waveforms already on the aligner's device (a synthesis's own audio) are read there, copied device to device
    into the pass: the words of the same samples from the host, alone, batched and mixed with host rows; non-finite
    samples are refused by name; the worker takes them too (through a host copy: they come from another stream)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    a = ForcedAligner.from_pretrained(checkpoint(), device="cuda", dtype=torch.float32, graphs=True)
    uploaded = []
    orig = align_mod._PaddedPass._upload
    monkeypatch.setattr(align_mod._PaddedPass, "_upload", lambda self, wavs, out: (
        uploaded.append([isinstance(w, torch.Tensor) and w.is_cuda for w in wavs]), orig(self, wavs, out))[1])
    names = ["c", "b", "d", "long"]
    texts = [CASES["en"]["text"][0], "one two three four", CASES["en_24k"]["text"][0], CASES["long_windowed"]["text"][0]]
    wavs = [audio(n) for n in names]
    want = _rows_alone(a, names, texts)
    dev = [torch.from_numpy(w).cuda() for w, _ in wavs]
    rates = [sr for _, sr in wavs]  # 16, 16, 24 and 8 kHz
    uploaded.clear()
    assert a.align(dev[:2], rates[:2], texts[:2], "English", rows_alone=True) == want[:2]
    assert a.align(dev[2], rates[2], texts[2], "English") == want[2]  # resampled on the device
    assert uploaded == [[True, True], [True]]  # one input rate: the rows went in as they lay, on the device
    assert a.align(dev, rates, texts, "English", rows_alone=True) == want  # rates mixed: prepared on the CPU
    mixed = [d if i % 2 else w for i, (d, (w, _)) in enumerate(zip(dev, wavs))]
    assert a.align(mixed, rates, texts, "English", rows_alone=True) == want
    assert a.align(dev[1], rates[1], texts[1], "English") == want[1]
    bad = dev[2].clone()
    bad[100] = float("nan")
    with pytest.raises(ValueError, match="item 2: audio has NaN"):
        a.align([dev[0], dev[1], bad], rates[:3], texts[:3], "English", rows_alone=True)
    worker = AlignerWorker(a)
    try:
        assert worker.submit(dev[3], rates[3], texts[3], "English").result(timeout=120) == want[3]
    finally:
        worker.close()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_audio_is_refused_by_the_padded_pass(bad, padded_calls):
    """align() leaves the samples' finiteness to the padded pass, which checks it on the device beside the pass
    (the samples go there as they are: resampled there): the same clear error as the host's check."""
    a = ForcedAligner.from_pretrained(checkpoint(), device="cpu", graphs=True, resample_on_device=True)
    for name in ("a", "d"):  # 16 and 24 kHz
        wav, sr = audio(name)
        wav = wav.copy()
        wav[wav.shape[0] // 2] = bad
        with pytest.raises(ValueError, match="^audio has NaN or infinite samples"):
            a.align(wav, sr, "hello there", "English")
        assert padded_calls and padded_calls[-1] is not None
        padded_calls.clear()


@pytest.mark.parametrize("graphs", [False, True])
def test_a_batchs_first_error_is_its_first_bad_rows_text_before_audio(graphs):
    """align() checks a batch's audio first and leaves the texts to the pass (checked while the samples are
    written): the error is still the first bad row's, its text's before its audio's, as each row checked in turn."""
    a = fast() if graphs else aligner()
    wav, sr = audio("d")
    short = np.zeros(100, np.float32)
    cases = [  # (wavs, texts, the error)
        ([wav, wav, wav, short], ["one", "two", "", "four"], "^item 2: text must be"),
        ([wav, short, wav, wav], ["one", "two", "", "four"], "^item 1: audio of .* too short"),
        ([wav, wav, short, wav], ["one", "two", "  ", "four"], "^item 2: text must be"),
        ([wav, wav, wav, wav], ["one", "two", "three", 4], "^item 3: text must be"),
    ]
    for wavs, texts, match in cases:
        with pytest.raises(ValueError, match=match):
            a.align(wavs, sr, texts, "English", rows_alone=True)
    with pytest.raises(ValueError, match="^language 'Klingon' is not supported"):
        a.align(short, sr, "one", "Klingon")


def test_a_bad_text_fails_while_the_samples_are_written_and_nothing_runs(monkeypatch):
    """The padded pass checks align()'s texts after the rows' samples start on their way (their writes overlap
    the checks); a bad one fails the batch with its clear error, its samples waited for and not copied on, no pass
    run; the next batch of the bucket gets its words."""
    a = ForcedAligner.from_pretrained(checkpoint(), device="cpu", graphs=True, resample_on_device=True)
    finished, passes = [], []
    orig_upload, orig_pass = align_mod._PaddedPass._upload, align_mod._PaddedPass._pass

    def upload(self, wavs, out):
        finish = orig_upload(self, wavs, out)
        return lambda copy=True: finished.append(copy) or finish(copy)
    monkeypatch.setattr(align_mod._PaddedPass, "_upload", upload)
    monkeypatch.setattr(align_mod._PaddedPass, "_pass", lambda self, x: passes.append(1) or orig_pass(self, x))
    names, texts = ["c", "b", "a"], [CASES["en"]["text"][0], "one two three four", "five six"]  # (one rate)
    with pytest.raises(ValueError, match="^item 1: text must be"):
        _rows_alone(a, names, [texts[0], " ", texts[2]])
    assert finished == [False] and passes == []
    assert _rows_alone(a, names, texts) == _rows_alone(fast(), names, texts)
    assert finished[-1] is True and passes
