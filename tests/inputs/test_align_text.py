"""The aligner's text side: word splitting and the monotonic fix-up (the golden cases in tests/test_align.py run them
on real texts; these pin each rule on its own)."""

import json
import random
from pathlib import Path

import pytest

from q3tts.inputs.align_text import (
    InputError,
    WordTime,
    _split_cjk,
    aligner_language,
    clean,
    fix_timestamps,
    prompt_text,
    split_words,
    word_times,
)

FIXTURE = Path(__file__).resolve().parents[1] / "golden" / "fixtures" / "aligner" / "aligner.json"


@pytest.mark.parametrize("text,language,words", [
    ("Hello,   world! It's 3pm.", "English", ["Hello", "world", "It's", "3pm"]),
    ("你好，世界。", "Chinese", ["你", "好", "世", "界"]),
    ("用Qwen3合成", "Chinese", ["用", "Qwen3", "合", "成"]),
    ("abc中def", "French", ["abc", "中", "def"]),  # CJK split off inside a space-delimited word
    ("— ... !!", "English", []),
    ("naïve café", "english", ["naïve", "café"]),
])
def test_split_words(text, language, words):
    assert split_words(text, language) == words


def test_ascii_texts_split_as_the_general_rule():
    """An ASCII text takes one str.translate; its words equal the rule's: split on white space (the \\x1c-\\x1f
    separators included), each piece cleaned, empty pieces dropped."""
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(128)]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        rule = [w for seg in text.split() if clean(seg) for w in _split_cjk(clean(seg))]
        assert split_words(text, "English") == rule, repr(text)


def test_korean_refused_naming_the_accepted():
    with pytest.raises(InputError, match="Korean.*accepted"):
        split_words("안녕하세요", "korean")


def test_prompt_text():
    assert prompt_text(["a", "b"]) == ("<|audio_start|><|audio_pad|><|audio_end|>"
                                       "a<timestamp><timestamp>b<timestamp><timestamp>")


@pytest.mark.parametrize("data,fixed", [
    ([], []),
    ([0.0, 80.0, 160.0], [0, 80, 160]),  # already monotonic
    ([0.0, 800.0, 160.0, 240.0], [0, 0, 160, 240]),  # one outlier: the nearer neighbour, the left on a tie
    ([0.0, 80.0, 160.0, 90.0, 50.0, 20.0], [0, 80, 160, 160, 160, 160]),  # trailing run: the left neighbour
    ([500.0, 400.0, 300.0, 0.0, 80.0, 160.0], [0, 0, 0, 0, 80, 160]),  # leading run: the right neighbour
    # 3 outliers, interpolated between their neighbours
    ([0.0, 80.0, 900.0, 950.0, 990.0, 240.0, 320.0, 400.0, 480.0], [0, 80, 120, 160, 200, 240, 320, 400, 480]),
])
def test_fix_timestamps(data, fixed):
    assert fix_timestamps(data) == fixed


def test_fix_timestamps_equals_the_official():
    """300 random sequences with ties and runs, and the hand-made ones, through the official fix_timestamp."""
    fixups = json.loads(FIXTURE.read_text())["fixups"]
    assert len(fixups) > 300
    for data, fixed in fixups:
        assert fix_timestamps(data) == fixed, data


def _kept_rows(rows: list[list[float]]) -> list[list[bool]]:
    """The package's kept slots of every row: fix_timestamps_rows' batch scan (_kept_padded) for rows of up to
    BATCH_DP_MAX slots, the Fenwick tree past them."""
    from q3tts.inputs.align_text import BATCH_DP_MAX, _kept_padded, _longest_run_kept, _padded_rows
    out = [_longest_run_kept(r) if len(r) > BATCH_DP_MAX else [] for r in rows]
    short = [b for b, r in enumerate(rows) if 0 < len(r) <= BATCH_DP_MAX]
    if short:
        data, lens = _padded_rows([rows[b] for b in short])
        kept = _kept_padded(data, lens)
        for k, b in enumerate(short):
            out[b] = kept[k, :lens[k]].tolist()
    return out


def official_fixup_kept(data: list[float]) -> list[bool]:
    """The official's O(n^2) longest non-decreasing subsequence (qwen-asr's fix_timestamp): the first j on ties."""
    n = len(data)
    dp, parent = [1] * n, [-1] * n
    for i in range(1, n):
        for j in range(i):
            if data[j] <= data[i] and dp[j] + 1 > dp[i]:
                dp[i], parent[i] = dp[j] + 1, j
    kept, idx = [False] * n, dp.index(max(dp))
    while idx != -1:
        kept[idx], idx = True, parent[idx]
    return kept


@pytest.mark.parametrize("n,levels", [(1, 3), (7, 2), (60, 5), (400, 40), (400, 4000)])
def test_fix_timestamps_keeps_the_official_subsequence_on_long_inputs(n, levels):
    """The Fenwick-tree scan keeps exactly the slots of the official's quadratic scan (ties included: few levels)
    on sequences far longer than the fixture's, and the fix-up of a long sequence is monotonic."""
    from q3tts.inputs.align_text import _longest_run_kept
    rng = random.Random(n * levels)
    rows = [[80.0 * rng.randrange(levels) for _ in range(n)] for _ in range(20)]
    want = [official_fixup_kept(data) for data in rows]
    assert [_longest_run_kept(data) for data in rows] == want
    assert _kept_rows(rows) == want  # the batch's vectorized scan
    for data in rows:
        fixed = fix_timestamps(data)
        assert all(a <= b for a, b in zip(fixed, fixed[1:]))


def test_fix_timestamps_of_a_batch_is_each_rows():
    """A batch of rows of every length (empty, monotonic, ties, runs of outliers at both ends and inside, past
    BATCH_DP_MAX: the Fenwick tree's) fixed at once equals each row fixed alone, each row's kept slots are the
    official's, and the batch's vectorized fix-up equals the per-row one (_fix) on the official's kept slots."""
    from q3tts.inputs.align_text import BATCH_DP_MAX, _fix, fix_timestamps_rows
    rng = random.Random(1)
    rows = [[], [80.0], [0.0, 80.0, 80.0, 160.0], [800.0, 720.0, 0.0, 80.0], [0.0, 80.0, 900.0, 880.0, 860.0]]
    rows += [[80.0 * rng.randrange(12) for _ in range(rng.randrange(2, 70))] for _ in range(30)]
    rows += [[80.0 * rng.randrange(5000) for _ in range(30)] for _ in range(64)]  # a random head's batch
    rows += [[80.0 * rng.randrange(300) for _ in range(BATCH_DP_MAX + 9)]]
    assert _kept_rows(rows) == [official_fixup_kept(r) if r else [] for r in rows]
    assert fix_timestamps_rows(rows) == [_fix(r, official_fixup_kept(r)) if r else [] for r in rows]
    assert fix_timestamps_rows(rows) == [fix_timestamps(r) for r in rows]
    fixups = json.loads(FIXTURE.read_text())["fixups"]
    assert fix_timestamps_rows([d for d, _ in fixups]) == [f for _, f in fixups]


def test_whole_ms_in_seconds_are_their_own_3_decimal_rounding():
    """word_times skips the official's round(s, 3): k / 1000.0 is already what it returns, for every k ms up to
    ten minutes (past the aligner's 400 s) and a sample beyond."""
    ks = list(range(600_001)) + [2 ** 40 + 7, 123_456_789_012]
    assert all(round(k / 1000.0, 3) == k / 1000.0 for k in ks)


def test_word_times_pairs_slots_and_rounds_to_ms():
    assert word_times(["a", "b"], [80.0, 160.0, 160.0, 1234.0]) == [WordTime("a", 0.08, 0.16),
                                                                    WordTime("b", 0.16, 1.234)]


@pytest.mark.parametrize("tts,aligner", [(None, "Auto"), ("auto", "Auto"), ("English", "English"),
                                         ("beijing_dialect", "Chinese"), ("sichuan_dialect", "Chinese")])
def test_aligner_language_of_a_synthesis_language(tts, aligner):
    assert aligner_language(tts) == aligner


def test_word_times_of_a_padded_batch_read_only_each_rows_slots(monkeypatch):
    """word_times_padded (the aligner's results: a [rows, slots] array, each row's 2 x words slots first, anything
    past them) equals word_times of each row alone on its own slots, with NaN and junk past them, rows of no words,
    rows already monotonic (not scanned), a row past BATCH_DP_MAX (the Fenwick tree), and the short rows' scan split
    into chunks of a few rows (DP_CHUNK); its items are WordTime."""
    import numpy as np

    import q3tts.inputs.align_text as at
    rng = random.Random(2)
    nwords = [0, 1, 3, 15, 15, 15, 40, at.BATCH_DP_MAX // 2 + 5, 0, 2]
    rows = [[80.0 * rng.randrange(60) for _ in range(2 * k)] for k in nwords]
    rows[4] = sorted(rows[4])  # monotonic
    rows[5] = [80.0 * (i // 3) for i in range(30)]  # monotonic with ties
    words = [[f"w{b}_{i}" for i in range(k)] for b, k in enumerate(nwords)]
    want = [word_times(w, r) for w, r in zip(words, rows)]
    width = 2 * max(nwords) + 3
    padded = np.array([r + [float("nan"), -80.0, 1e9][:1] * (width - len(r)) for r in rows], np.float32)
    padded[:, -2:] = -5.0
    for chunk in (at.DP_CHUNK, 2 * 30 * 30 + 1):  # all short rows in one scan; two rows of 30 slots a scan
        monkeypatch.setattr(at, "DP_CHUNK", chunk)
        got = at.word_times_padded(words, padded)
        assert got == want
        assert all(type(w) is WordTime and w.word == words[b][i] for b, r in enumerate(got) for i, w in enumerate(r))
