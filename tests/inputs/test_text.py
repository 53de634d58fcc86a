"""Incremental tokenization: text given in pieces commits exactly the ids of the whole text (a prefix at every
point), and a TextStream lays out the same prompt as the whole text."""

import random

import pytest

from q3tts.inputs.prompt import ROLE, TextTokenizer
from q3tts.inputs.request import InputError
from q3tts.inputs.text import IncrementalTokenizer
from tests.golden import fixtures as fx

TRICKY = [
    "It's 12:30 -- isn't it?!  Yes...\n\nNew paragraph.", "  leading spaces and trailing   ",
    "Café déjà vu — naïve coöperation", "e\u0301te\u0301 decomposed accents e\u0301", "emoji 😀👍🏽 done",
    "Numbers 1234567 and 3.14159", "Mixed 中文 and English, 日本語もある。한국어도!", "tabs\tand\r\nwindows lines",
    "<|im_end|> a literal special token, <tts_pad> and <|im_st", "'s 't 're 've 'm 'll 'd DON'T we'LL",
    "!!!???...,,,;;;", "a  b   c    d", "\nstarts with a newline", "x", "你好，今天天气真不错。",
]


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer(fx.REFERENCE / "tokenizer")


def fixture_texts():
    out = []
    for v in fx.VARIANTS:
        for case in fx.manifest(v)["cases"]:
            t = case["kw"].get("text")
            out += t if isinstance(t, list) else [t]
    return [t for t in out if t]


def split(text, rng, sizes):
    out, i = [], 0
    while i < len(text):
        k = rng.choice(sizes)
        out.append(text[i:i + k])
        i += k
    return out


@pytest.mark.parametrize("sizes", [(1,), (1, 2, 3), (2, 5, 11)])
def test_pieces_commit_the_whole_texts_ids(tok, sizes):
    rng = random.Random(len(sizes))
    texts = TRICKY + fixture_texts()
    assert len(texts) > 30
    for text in texts:
        whole = tok.encode(ROLE + text)
        for _ in range(20):
            inc, got = IncrementalTokenizer(tok), []
            for piece in split(text, rng, sizes):
                got += inc.push(piece)
                assert got == whole[:len(got)], (text, piece)  # never a token that later text would change
            got += inc.close()
            assert got == whole, text


def test_words_are_committed_once_the_next_begins(tok):
    inc = IncrementalTokenizer(tok)
    assert inc.push("Hello") == tok.encode(ROLE)  # "Hello" may still grow ("Hellos")
    assert inc.push(" wor") == tok.encode("Hello")  # the next piece began: "Hello" is final
    assert inc.push("<|im_") == tok.encode(" wor")  # held: could still become the special token
    assert inc.close() == tok.encode("<|im_")


def test_an_all_blank_text_is_refused_at_the_close(tok):
    inc = IncrementalTokenizer(tok)
    inc.push("   ")
    inc.push("\n")
    with pytest.raises(InputError, match="text is empty"):
        inc.close()


@pytest.mark.parametrize("variant", ["cv06", "cv17", "vd17", "base06"])
def test_text_stream_lays_out_the_whole_texts_prompt(variant):
    """Whatever the pieces, layout() + take() give the whole text's prompt and trailing text (+ tts_eos)."""
    tts = fx.tts(variant)
    for case in fx.manifest(variant)["cases"]:
        kw = dict(case["kw"])
        if not isinstance(kw.get("text"), str) or kw.get("non_streaming_mode") is not False:
            continue
        if "prompt" in case:
            kw["voice_clone_prompt"] = fx.case_prompt_items(variant, case)
        prep = getattr(tts, case["method"].replace("generate_", "prepare_"))
        whole = prep(**kw)[0].layout
        text = kw.pop("text")
        streamed = prep(text=None, **kw)[0]
        rng, lay, trailing = random.Random(7), None, []
        for piece in split(text, rng, (1, 2, 3)):
            streamed.text.append(piece)
            if lay is None:
                lay = streamed.text.layout()
                assert lay is None or len(lay) == len(whole)  # the prefill is built once, as the whole text's
            else:
                trailing += streamed.text.take()[0]
        streamed.text.close()
        if lay is None:
            lay = streamed.text.layout()
        trailing += streamed.text.take()[0]
        assert (lay.text_ids, lay.codec_ids) == (whole.text_ids, whole.codec_ids), case["name"]
        assert lay.trailing_ids + trailing == whole.trailing_ids, case["name"]
