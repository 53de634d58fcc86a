"""q3tts.ForcedAligner against the official qwen-asr 0.0.6 (tests/golden/make_golden_aligner.py): the same words and
times, alone and batched, on the tiny random checkpoint the fixtures were made with."""

from __future__ import annotations

import json
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from q3tts import randomckpt
from q3tts.align import ForcedAligner, WordTime

FIX = Path(__file__).resolve().parent / "golden" / "fixtures" / "aligner"
REFERENCE = Path(__file__).resolve().parents[1] / "q3tts" / "reference"
MANIFEST = json.loads((FIX / "aligner.json").read_text())
TENSORS = load_file(str(FIX / "tensors.safetensors"))
CASES = {c["name"]: c for c in MANIFEST["cases"]}
# the official's cases our aligner reproduces: not long_sdpa (the official's default attention crosses the audio
# encoder's windows; we window as its flash-attention and vLLM paths do, recorded as long_windowed), and Japanese /
# Korean on their own
PARITY = [n for n in CASES if n not in ("ja", "ko", "long_sdpa")]


@lru_cache(maxsize=1)
def checkpoint() -> Path:
    m = MANIFEST
    out = Path(tempfile.mkdtemp(prefix="q3tts-aligner-")) / "ckpt"
    digest = randomckpt.write_aligner_checkpoint(out, m["config"], m["shapes"], REFERENCE / "tokenizer",
                                                 m["preprocessor"], seed=m["seed"], tweaks=m["tweaks"])
    assert digest == m["digest"], "rebuilt aligner checkpoint differs from the fixture's (recipe or RNG drift)"
    return out


@lru_cache(maxsize=1)
def aligner() -> ForcedAligner:
    return ForcedAligner.from_pretrained(checkpoint(), device="cpu")


def audio(name: str) -> tuple[np.ndarray, int]:
    return TENSORS[f"audio.{name}"].numpy(), MANIFEST["audio"][name]["sample_rate"]


def expected(case: dict) -> list[list[WordTime]]:
    return [[WordTime(w, s, e) for w, s, e in r] for r in case["results"]]


def run_case(case: dict):
    return run_case_with(aligner(), case)


def run_case_with(a: ForcedAligner, case: dict):
    items = [audio(n) for n in case["audio"]]
    if len(items) == 1:
        return [a.align(items[0][0], items[0][1], case["text"][0], case["language"][0])]
    lang = case["language"] if len(case["language"]) > 1 else case["language"][0]
    return a.align([w for w, _ in items], [sr for _, sr in items], case["text"], lang)


@pytest.mark.parametrize("name", PARITY)
def test_words_and_times_equal_the_official(name):
    case = CASES[name]
    got = run_case(case)
    assert got == expected(case)


@pytest.mark.parametrize("name", ["en", "zh", "mixed", "en_24k"])
def test_features_and_prompt_ids_equal_the_official(name):
    """The parts under the times: the log-mel of the official feature extractor and the token ids of its processor."""
    from q3tts.models.audio_encoder import log_mel, valid_frames
    a = aligner()
    case = CASES[name]
    item = a._item(*audio(case["audio"][0]), case["text"][0], case["language"][0], -1)
    mel = log_mel(torch.from_numpy(item.wav)[None], a._filters)[0]
    mel = mel[:, :valid_frames(item.wav.shape[0], item.wav.shape[0])]
    ref = TENSORS[f"{name}.0.features"]
    assert mel.shape == ref.shape
    torch.testing.assert_close(mel, ref, atol=2e-5, rtol=0)
    captured = {}
    orig = a.thinker.forward

    def spy(ids, rows, audio, select):
        captured["ids"] = ids[:rows.lengths[0]]
        return orig(ids, rows, audio, select)

    a.thinker.forward = spy
    try:
        a.align(*audio(case["audio"][0]), case["text"][0], case["language"][0])
    finally:
        del a.thinker.forward
    assert captured["ids"].tolist() == TENSORS[f"{name}.0.input_ids"].tolist()


def test_rows_alone_features_are_each_rows_own_in_one_pass():
    """The batch's log-mel in one STFT (each row reflect-padded at its own ends, floored over its own frames) equals
    each row's log-mel alone."""
    from q3tts.models.audio_encoder import log_mel
    a = aligner()
    items = [a._item(*audio(n), "hi", "English", -1) for n in CASES["batch"]["audio"]]
    assert len({it.wav.shape[0] for it in items}) > 1
    mel, frames = a._features(items, rows_alone=True)
    for i, it in enumerate(items):
        alone = log_mel(torch.from_numpy(it.wav)[None], a._filters)[0]
        assert frames[i] == alone.shape[1] == it.wav.shape[0] // 160
        torch.testing.assert_close(mel[i, :, :frames[i]], alone, atol=1e-6, rtol=0)


def test_batched_rows_equal_the_official_alone_where_no_padding_reaches_them():
    """The longest row of a batch sees no padding: its times equal the official's for it alone."""
    got = run_case(CASES["batch"])
    assert got[0] == expected(CASES["en"])[0]


def test_japanese_words_need_the_extra_or_match():
    case = CASES.get("ja")
    if case is None:
        pytest.skip("the fixtures have no Japanese case (nagisa was not in the oracle venv)")
    try:
        import nagisa  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="aligner-ja-ko"):
            run_case(case)
        return
    assert run_case(case) == expected(case)


def test_korean_is_refused_clearly():
    with pytest.raises(ValueError, match="Korean"):
        aligner().align(*audio("b"), "안녕하세요 오늘", "Korean")


@pytest.mark.parametrize("kwargs,match", [
    (dict(text=""), "non-empty"),
    (dict(text="   "), "non-empty"),
    (dict(language="Klingon"), "accepted: .*English"),
    (dict(language=""), "language"),
    (dict(sample_rate="fast"), "sample_rate"),
    (dict(sample_rate=100), "8000"),
    (dict(wav=np.zeros(0, np.float32)), "non-empty"),
    (dict(wav=np.full(16000, np.nan, np.float32)), "NaN"),
    (dict(wav=np.r_[np.zeros(8000, np.float32), np.float32(np.inf)]), "infinite"),
    (dict(wav=np.r_[np.zeros(8000, np.float32), np.float32(np.inf), np.float32(-np.inf)]), "infinite"),
    (dict(wav=np.zeros(100, np.float32)), "too short"),
    (dict(wav=np.zeros(16000, np.int16)), "float"),
])
def test_bad_input_is_a_clear_error(kwargs, match):
    wav, sr = audio("a")
    args = dict(wav=wav, sample_rate=sr, text="hello there", language="English") | kwargs
    with pytest.raises(ValueError, match=match):
        aligner().align(args["wav"], args["sample_rate"], args["text"], args["language"])


def test_loud_finite_audio_whose_sum_overflows_is_aligned():
    """Samples near float32's largest: their sum overflows to inf, yet every sample is finite (the finiteness check
    falls back to a sample-by-sample look), and the row is scaled back into [-1, 1] as the official does."""
    wav, sr = audio("a")
    loud = np.where(wav >= 0, np.float32(3e38), np.float32(-3e38)).astype(np.float32)
    loud[: loud.shape[0] // 2] = np.float32(3e38)
    assert not np.isfinite(loud.sum())
    assert isinstance(aligner().align(loud, sr, "hello there", "English"), list)


def test_too_long_audio_is_refused_before_any_work():
    a = aligner()
    sr = 8000
    n = int((a.max_seconds + 1) * sr)
    with pytest.raises(ValueError, match="longer than"):
        a.align(np.broadcast_to(np.float32(0.1), (n,)), sr, "hello", "English")


def test_batch_size_mismatch():
    wav, sr = audio("a")
    with pytest.raises(ValueError, match="batch size mismatch"):
        aligner().align([wav, wav], sr, ["one"], "English")


def test_punctuation_only_text_has_no_words():
    wav, sr = audio("a")
    assert aligner().align(wav, sr, "... !?", "English") == []


def test_not_an_aligner_checkpoint(tmp_path):
    ckpt = checkpoint()
    for f in ckpt.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_tts"}))
    with pytest.raises(ValueError, match="not a Qwen3 forced-aligner checkpoint"):
        ForcedAligner.from_pretrained(tmp_path, device="cpu")


@pytest.mark.parametrize("name", PARITY)
def test_raw_timestamp_classes_equal_the_official(name):
    """Before the fix-up (which can hide a differing class): the argmax class at every timestamp slot."""
    a = aligner()
    captured = {}
    orig = a.thinker.forward

    def spy(ids, rows, audio, select):
        logits = orig(ids, rows, audio, select)  # [M, classes] at the timestamp slots, row after row
        per_row = [int((r == a.cfg.timestamp_token_id).sum()) for r in ids.split(rows.lengths)]
        captured["classes"] = logits.argmax(-1).split(per_row)
        return logits

    a.thinker.forward = spy
    try:
        run_case(CASES[name])
    finally:
        del a.thinker.forward
    for i, got in enumerate(captured["classes"]):
        assert got.tolist() == TENSORS[f"{name}.{i}.classes"].tolist()


def test_the_two_official_attention_forms_differ_on_long_audio():
    """Why long_sdpa is not a parity case: on audio longer than a window the official's two attention paths give
    different classes, so the fixture pins which one we follow."""
    assert TENSORS["long_windowed.0.classes"].tolist() != TENSORS["long_sdpa.0.classes"].tolist()


def test_rows_alone_batch_equals_the_official_alone_for_every_row():
    """rows_alone: each row's features as a batch of one, so every row of a mixed batch equals its alone case."""
    case = CASES["batch"]
    items = [audio(n) for n in case["audio"]]
    got = aligner().align([w for w, _ in items], [sr for _, sr in items], case["text"], case["language"],
                          rows_alone=True)
    assert got == [expected(CASES[n])[0] for n in ("en", "zh", "mixed")]


def test_auto_language_splits_as_the_default():
    wav, sr = audio("a")
    c = CASES["mixed"]
    assert aligner().align(wav, sr, c["text"][0], "Auto") == expected(c)[0]


def test_worker_batches_callers_and_fails_bad_items_alone():
    import asyncio

    from q3tts.align import AlignerWorker
    worker = AlignerWorker(aligner(), max_batch=2)
    try:
        futs = [worker.submit(*audio(CASES[n]["audio"][0]), CASES[n]["text"][0], CASES[n]["language"][0])
                for n in ("en", "zh", "mixed")]
        assert [f.result(timeout=60) for f in futs] == [expected(CASES[n])[0] for n in ("en", "zh", "mixed")]
        with pytest.raises(ValueError, match="non-empty"):
            worker.submit(*audio("a"), "", "English")
        got = asyncio.run(worker.align(*audio("b"), CASES["zh"]["text"][0], "Chinese"))
        assert got == expected(CASES["zh"])[0]
    finally:
        worker.close()


def test_worker_checks_at_submit_and_resamples_on_its_thread():
    """submit() only checks (a bad item fails at once, too-short audio included, judged by its resampled length);
    the resampling waits for the worker's thread and gives the same samples as align()'s own preparation."""
    a = aligner()
    wav, sr = audio(CASES["en_24k"]["audio"][0])
    assert sr != 16000
    deferred = a._item(wav, sr, "hello there", "English", -1, ready=False)
    assert not deferred.prepared and deferred.sample_rate == sr
    now = a._item(wav, sr, "hello there", "English", -1)
    assert now.prepared and np.array_equal(deferred.ready().wav, now.wav) and deferred.sample_rate == 16000
    with pytest.raises(ValueError, match="too short"):
        a._item(np.zeros(478, np.float32), 24000, "hi", "English", -1, ready=False)  # 319 samples at 16 kHz
    a._item(np.zeros(479, np.float32), 24000, "hi", "English", -1, ready=False).ready()  # 320: two frames


def test_bf16_runs_and_times_the_same_words():
    """bf16 (the CUDA default) on the CPU: the same words in order, non-decreasing times (bf16 rounding may move
    an argmax, so no time equality is claimed), RoPE frequencies kept in fp32."""
    a = ForcedAligner.from_pretrained(checkpoint(), device="cpu", dtype=torch.bfloat16)
    assert a.thinker.inv_freq.dtype == torch.float32 and a.dtype == torch.bfloat16
    case = CASES["en"]
    got = a.align(*audio("c"), case["text"][0], "English")
    assert [w.word for w in got] == [w.word for w in expected(case)[0]]
    assert all(w.start_s <= w.end_s for w in got)
    assert [w.start_s for w in got] == sorted(w.start_s for w in got)


@pytest.mark.slow
def test_compiled_layers_time_the_words_as_eager():
    """compile=True (the fast path benchmarked on the GPU): torch.compile'd encoder and decoder layers give the
    official's words and times in every parity case, and the warm-up at load leaves nothing to compile for the
    batches that follow (a compile in a server's pass would hold the interpreter and stall the streams)."""
    from torch._dynamo.utils import counters

    from q3tts.models.aligner import lm_layer
    a = ForcedAligner.from_pretrained(checkpoint(), device="cpu", compile=True)
    assert a.compiled and a.thinker.layer_fn is not lm_layer
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for name in PARITY:
        assert run_case_with(a, CASES[name]) == expected(CASES[name]), name
    eager = aligner()
    items = [a._item(*audio(n), "hi", "English", -1) for n in CASES["batch"]["audio"]]
    mel, frames = eager._features(items, rows_alone=True)
    with torch.inference_mode():
        torch.testing.assert_close(a.thinker.audio_tower(mel, frames), eager.thinker.audio_tower(mel, frames),
                                   atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation after the warm-up


def test_worker_passes_wait_while_busy_at_most_max_defer():
    """A pass waits while busy() holds (the server's: the engine admitting newcomers, making first audio), utterances
    submitted meanwhile joining it; past max_defer_s from its oldest submission it goes anyway."""
    import threading
    import time

    from q3tts.align import AlignerWorker
    busy = threading.Event()
    busy.set()
    worker = AlignerWorker(aligner(), busy=busy.is_set, max_defer_s=30.0)
    passes = []
    orig = worker.aligner._start
    worker.aligner._start = lambda items, rows_alone=False: passes.append(len(items)) or orig(items, rows_alone)
    try:
        first = worker.submit(*audio(CASES["en"]["audio"][0]), CASES["en"]["text"][0], "English")
        time.sleep(0.3)
        assert not first.done() and passes == []  # held while busy
        second = worker.submit(*audio(CASES["zh"]["audio"][0]), CASES["zh"]["text"][0], "Chinese")
        busy.clear()
        assert [first.result(timeout=60), second.result(timeout=60)] == [expected(CASES[n])[0] for n in ("en", "zh")]
        assert passes == [2]  # one pass for both
        busy.set()
        worker.max_defer_s = 0.2
        t0 = time.monotonic()
        assert worker.submit(*audio("b"), CASES["zh"]["text"][0], "Chinese").result(timeout=60) == expected(CASES["zh"])[0]
        assert time.monotonic() - t0 >= 0.2 and passes == [2, 1]  # busy all along: it went after max_defer_s
    finally:
        del worker.aligner._start
        worker.close()
