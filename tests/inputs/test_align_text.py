"""The aligner's text side: word splitting and the monotonic fix-up (the golden cases in tests/test_align.py run them
on real texts; these pin each rule on its own)."""

import json
from pathlib import Path

import pytest

from q3tts.inputs.align_text import (
    InputError,
    WordTime,
    aligner_language,
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


def test_word_times_pairs_slots_and_rounds_to_ms():
    assert word_times(["a", "b"], [80.0, 160.0, 160.0, 1234.0]) == [WordTime("a", 0.08, 0.16),
                                                                    WordTime("b", 0.16, 1.234)]


@pytest.mark.parametrize("tts,aligner", [(None, "Auto"), ("auto", "Auto"), ("English", "English"),
                                         ("beijing_dialect", "Chinese"), ("sichuan_dialect", "Chinese")])
def test_aligner_language_of_a_synthesis_language(tts, aligner):
    assert aligner_language(tts) == aligner
