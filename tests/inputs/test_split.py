"""split_text: properties over generated texts (nothing lost or added, order, bounds) and the cases that must not
split (decimals, abbreviations) or must keep marks with their sentence (closing quotes, CJK)."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from q3tts import split_text
from q3tts.inputs.split import MAX_CHARS, SplitStream, weight

WORDS = ["Dr.", "e.g.", "3.5", "hello", "World", "it's", "J.", "OK!", "why?", "“quoted.”", "(aside)", "1,000",
         "你好", "。", "，", "今天", "！", "「好的。」", "wait...", "a", "\n\n", "\n", "—", ";", ":", "é", "x" * 40]


def squeeze(s: str) -> str:
    return re.sub(r"\s+", "", s)


texts = st.one_of(
    st.text(max_size=400),
    st.lists(st.sampled_from(WORDS), max_size=200).map(" ".join),
    st.lists(st.sampled_from(WORDS), max_size=200).map("".join),
)


@settings(max_examples=300, deadline=None)
@given(text=texts, granularity=st.sampled_from(["sentence", "clause"]), max_chars=st.integers(1, 80))
def test_nothing_lost_or_added_order_kept_and_bounded(text, granularity, max_chars):
    segs = split_text(text, granularity, max_chars=max_chars)
    assert squeeze("".join(segs)) == squeeze(text)  # every non-whitespace character, once, in order
    assert all(s and s == s.strip() for s in segs)
    pos = 0
    for s in segs:  # each segment is a slice of the text, after the previous one
        pos = text.index(s, pos) + len(s)
    assert all(weight(s) <= max_chars for s in segs if len(squeeze(s)) > 1)  # one character may outweigh a bound of 1


@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_tiny_fragments_merge(text):
    segs = split_text(text, "clause", max_chars=MAX_CHARS, min_chars=10)
    # a fragment under min_chars stays alone only where joining a neighbour would pass max_chars, or it is all
    for i, s in enumerate(segs):
        if weight(s) < 10 and len(segs) > 1:
            neighbours = [segs[j] for j in (i - 1, i + 1) if 0 <= j < len(segs)]
            assert all(weight(s) + weight(n) > MAX_CHARS for n in neighbours), (s, segs)


def test_sentences():
    text = "Dr. Smith paid $3.50 for it, e.g. at the shop. Then he left! \"Why?\" she asked.\n\nA new paragraph"
    assert split_text(text) == ["Dr. Smith paid $3.50 for it, e.g. at the shop.", "Then he left!",
                                "\"Why?\" she asked.", "A new paragraph"]


def test_clauses():
    assert split_text("First, we wait; then: we go, really fast.", "clause", min_chars=0) == \
        ["First,", "we wait;", "then:", "we go,", "really fast."]


def test_decimals_abbreviations_initials_lowercase_do_not_split():
    for text in ("The value is 3.5 and it is 4.25 now.", "Ask Dr. Who, Mr. Bean and Prof. X today.",
                 "Use tools, e.g. hammers, i.e. heavy ones.", "J. R. R. Tolkien wrote it.",
                 "The end. and then more words."):
        assert split_text(text, min_chars=0) == [text]
    assert split_text("He was the one who came to a. Then he left.", min_chars=0) == \
        ["He was the one who came to a.", "Then he left."]
    assert split_text("Siehe z.B. Seite drei. Dann weiter.", language="German", min_chars=0) == \
        ["Siehe z.B. Seite drei.", "Dann weiter."]


def test_closing_quotes_and_brackets_stay_with_their_sentence():
    assert split_text('He said "Stop." Then "Go!" (Really.) Done.', min_chars=0) == \
        ['He said "Stop."', 'Then "Go!"', "(Really.)", "Done."]
    assert split_text("“Yes?” “No.” Fine.", min_chars=0) == ["“Yes?”", "“No.”", "Fine."]


def test_cjk():
    assert split_text("你好，今天天气真不错。我们去公园散步吧！「好的。」他说。", min_chars=0) == \
        ["你好，今天天气真不错。", "我们去公园散步吧！", "「好的。」", "他说。"]
    assert split_text("你好，今天天气真不错。", "clause", min_chars=0) == ["你好，", "今天天气真不错。"]
    assert split_text("こんにちは。元気ですか？", min_chars=0) == ["こんにちは。", "元気ですか？"]


def test_long_sentence_split_at_clauses_then_words_then_characters():
    clauses = ", ".join(f"clause number {i} goes on" for i in range(500))  # one 10 000+ character sentence
    text = clauses + "."
    assert len(text) > 10_000
    segs = split_text(text)
    assert len(segs) > 1 and all(weight(s) <= MAX_CHARS for s in segs)
    assert all(s.endswith((",", ".")) for s in segs)  # cut at clauses, not inside one
    words = " ".join(["word"] * 2500)  # no clause mark: cut between words
    segs = split_text(words)
    assert all(weight(s) <= MAX_CHARS for s in segs) and all(set(s.split()) == {"word"} for s in segs)
    segs = split_text("字" * 1000)  # CJK without punctuation: between characters
    assert "".join(segs) == "字" * 1000 and all(weight(s) <= MAX_CHARS for s in segs)


def test_tiny_fragments_join_a_neighbour():
    assert split_text("Hi. This is a sentence.") == ["Hi. This is a sentence."]
    assert split_text("This is a sentence. Ok.") == ["This is a sentence. Ok."]
    assert split_text("Hi.") == ["Hi."]


def test_bad_arguments():
    assert split_text("   \n ") == []
    with pytest.raises(ValueError, match="split_granularity must be one of"):
        split_text("a", "word")
    with pytest.raises(ValueError, match="must be a str"):
        split_text(["a"])


# --------------------------------------------------------------------------- streamed text
def streamed(text: str, cuts: list[int], granularity: str, **kw) -> list[str]:
    s = SplitStream(granularity, **kw)
    out, prev = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        out += s.append(text[prev:c])
        prev = c
    return out + s.close()


@settings(max_examples=400, deadline=None)
@given(text=texts, granularity=st.sampled_from(["sentence", "clause"]), max_chars=st.integers(10, 600),
       cuts=st.lists(st.integers(0, 2000), max_size=40))
def test_streamed_pieces_give_split_texts_segments(text, granularity, max_chars, cuts):
    """Any cut of the text into pieces: the segments handed out as they complete, then at the close, are
    split_text's for the whole text (below max_pending without a known cut)."""
    kw = {"max_chars": max_chars, "max_pending": 10**6}
    assert streamed(text, [c for c in cuts if c < len(text)], granularity, **kw) == split_text(text, granularity,
                                                                                           max_chars=max_chars)


def test_a_segment_is_handed_out_once_its_end_is_known():
    s = SplitStream("sentence")
    assert s.append("Dr. Smith paid $3.") == []  # "3." may be "3.50"
    assert s.append("50. Then") == []  # the first may still take a tiny fragment at the end ("Then.")
    assert s.append(" he left quietly! And the") == ["Dr. Smith paid $3.50."]  # min_chars follow its end
    assert s.close() == ["Then he left quietly! And the"]  # "And the" (tiny) joins its neighbour at the end
    c = SplitStream("clause")
    out = [seg for piece in "The first one is here, the second one follows; and then more text.".split(" ")
           for seg in c.append(piece + " ")]
    assert out + c.close() == split_text("The first one is here, the second one follows; and then more text.",
                                         "clause")
    assert out == ["The first one is here,", "the second one follows;"]  # "and then more text." at the close


def test_a_long_run_without_a_known_cut_is_cut_at_max_pending():
    s = SplitStream("sentence", max_pending=50)
    got = [seg for k in range(30) for seg in s.append("word ")] + s.close()
    assert squeeze("".join(got)) == "word" * 30 and len(got) > 1
    with pytest.raises(ValueError, match="split_granularity"):
        SplitStream("word")
