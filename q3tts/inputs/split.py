"""Splitting a long text into segments that are spoken one request each (long form), pure Python.

    split_text("Dr. Smith paid $3.50. Then he left!")  ->  ["Dr. Smith paid $3.50.", "Then he left!"]

A segment ends after sentence-final punctuation (. ! ? … and CJK 。！？, with the closing quotes and brackets
that follow it) or at a paragraph break; "clause" also ends one after , ; : and CJK 、，；：. A period does not
end a sentence inside a number ("3.5"), after a known abbreviation ("Dr.", "e.g.") or a single initial ("J."),
or when the next word starts in lower case. A segment longer than `max_chars` is cut at clauses, then between
words, then (a run with neither, e.g. CJK without punctuation) between characters. A fragment shorter than
`min_chars` joins a neighbour. Segments are slices of the text with their outer whitespace stripped, so no
character other than whitespace is lost or added, and the order is kept.

Lengths are weights, not characters: a CJK character counts CJK_WEIGHT, because it carries as much speech as
a short word (about one text token), while a Latin letter carries a fraction of one.
"""

from __future__ import annotations

import re

GRANULARITIES = ("sentence", "clause")
MAX_CHARS = 600  # the longest segment (weight): ~100 English words, ~40 s of speech: far from max_seq_len
MIN_CHARS = 10  # shorter fragments ("Hi.", "1.") join a neighbour: alone they are spoken with odd prosody
CJK_WEIGHT = 3

_CLOSERS = "\"'”’»」』）)]】〉》"
_SENTENCE_ASCII = ".!?…"
_SENTENCE_CJK = "。！？"  # no space follows these
_CLAUSE_ASCII = ",;:"
_CLAUSE_CJK = "、，；："
_STOPS = set(_CLOSERS + "(")  # with whitespace: where the look back for the word before a period stops
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")

# abbreviations that end in "." without ending a sentence (lower case, without their final period)
_ABBREVIATIONS = {
    "english": {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "cf", "no", "vol",
                "fig", "approx", "dept", "inc", "ltd", "co", "corp", "mt", "ave", "gen", "gov", "sgt", "capt",
                "lt", "col", "rev", "hon", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct",
                "nov", "dec", "a.m", "p.m", "u.s", "u.k", "ph.d"},
    "german": {"z.b", "d.h", "u.a", "usw", "bzw", "ca", "nr", "s", "hr", "fr", "dr", "prof", "vgl", "inkl", "ggf"},
    "french": {"m", "mm", "mme", "mlle", "dr", "p.ex", "cf", "etc", "env", "av", "st", "ste"},
    "spanish": {"sr", "sra", "srta", "dr", "dra", "ud", "uds", "p.ej", "etc", "av", "pág"},
    "italian": {"sig", "sig.ra", "dott", "prof", "ecc", "p.es", "pag"},
    "portuguese": {"sr", "sra", "dr", "dra", "etc", "p.ex", "pág", "av"},
    "russian": {"т.е", "т.д", "т.п", "г", "гг", "см", "стр", "им", "др"},
}
_ALL_ABBREVIATIONS = set().union(*_ABBREVIATIONS.values())


def weight(text: str) -> int:
    """The length of a piece of text in segment units: non-space characters, a CJK one counting CJK_WEIGHT."""
    n = sum(1 for c in text if not c.isspace())
    return n + (CJK_WEIGHT - 1) * len(_CJK.findall(text))


def split_text(text: str, granularity: str = "sentence", language: str | None = None, max_chars: int = MAX_CHARS,
               min_chars: int = MIN_CHARS) -> list[str]:
    """Split `text` into segments to be spoken one request each (see the module's docstring).

    Args:
        text: any text; whitespace-only text gives [].
        granularity: "sentence" or "clause" (also at commas, semicolons, colons).
        language: picks the abbreviations that do not end a sentence (e.g. "German": "z.B."); None or "auto": those
            of every supported language.
        max_chars: the longest segment, in weight (CJK characters count CJK_WEIGHT each).
        min_chars: shorter fragments join a neighbour (as long as the result is not longer than max_chars).
    Returns:
        the segments, in order, each stripped of outer whitespace.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str to be split, got {type(text).__name__}")  # noqa: TRY004 (user input)
    abbrevs = _options(granularity, language, max_chars, min_chars)
    spans = _spans(text, _boundaries(text, abbrevs, clause=granularity == "clause"))
    pieces = []
    for a, b in spans:
        pieces += _fit(text, a, b, max_chars, abbrevs)
    pieces = _merge_tiny(text, pieces, max_chars, min_chars)
    return [text[a:b].strip() for a, b in pieces]


def _options(granularity: str, language: str | None, max_chars: int, min_chars: int) -> set[str]:
    """Check split_text's options -> the abbreviations that do not end a sentence in `language`."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"split_granularity must be one of {['none', *GRANULARITIES]}, got {granularity!r}")
    if max_chars < 1 or min_chars < 0:
        raise ValueError("max_chars must be >= 1 and min_chars >= 0")
    lang = (language or "auto").strip().lower()
    return _ABBREVIATIONS.get(lang, _ALL_ABBREVIATIONS) | _ABBREVIATIONS["english"]


# --------------------------------------------------------------------------- boundaries
def _boundaries(text: str, abbrevs: set[str], clause: bool, start: int = 0, end: int | None = None) -> list[int]:
    """Offsets in [start, end) where a segment may end (exclusive end of the segment), in order."""
    end = len(text) if end is None else end
    ascii_marks = _SENTENCE_ASCII + (_CLAUSE_ASCII if clause else "")
    cjk_marks = _SENTENCE_CJK + (_CLAUSE_CJK if clause else "")
    out = []
    i = start
    while i < end:
        c = text[i]
        if c == "\n":  # a paragraph break: a line with nothing but whitespace between two lines
            j = i + 1
            while j < end and text[j].isspace() and text[j] != "\n":
                j += 1
            if j < end and text[j] == "\n":
                out.append(i)
                while j < end and text[j].isspace():
                    j += 1
                i = j
                continue
        if c in ascii_marks or c in cjk_marks:
            j = i + 1
            while j < end and (text[j] in ascii_marks or text[j] in cjk_marks):
                j += 1  # "?!", "...", "。」"
            while j < end and text[j] in _CLOSERS:
                j += 1
            if c in cjk_marks or text[j - 1] in cjk_marks or (
                    (j >= end or text[j].isspace()) and _ends_here(text, i, j, end, abbrevs)):
                out.append(j)
            i = j
            continue
        i += 1
    return out


def _ends_here(text: str, i: int, j: int, end: int, abbrevs: set[str]) -> bool:
    """An ASCII mark run text[i:j] followed by whitespace (or the end): does the sentence (or clause) end?"""
    if text[i] != "." or j - i > 1 and text[i + 1] in ".…":
        return True  # ! ? … , ; : and ellipses end it
    k = i
    while k > 0 and not text[k - 1].isspace() and text[k - 1] not in _STOPS:
        k -= 1
    word = text[k:i].lower()
    if word in abbrevs or (len(word) == 1 and text[k].isupper()):
        return False  # "Dr.", "e.g.", an initial "J."
    n = j
    while n < end and text[n].isspace():
        n += 1
    nxt = text[n] if n < end else ""
    return not nxt.islower()  # "... the end. and then": no sentence starts in lower case


def _spans(text: str, cuts: list[int], start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """[start, end) cut at `cuts` -> spans that hold some non-whitespace character."""
    end = len(text) if end is None else end
    out, a = [], start
    for c in [*cuts, end]:
        if c > a and text[a:c].strip():
            out.append((a, c))
        elif out:  # whitespace only: give it to the previous span, so spans tile the text
            out[-1] = (out[-1][0], c)
        a = max(a, c)
    return out


# --------------------------------------------------------------------------- long and short pieces
def _fit(text: str, a: int, b: int, max_chars: int, abbrevs: set[str]) -> list[tuple[int, int]]:
    """A span longer than max_chars -> spans that fit: cut at clauses, then between words, then characters."""
    if weight(text[a:b]) <= max_chars:
        return [(a, b)]
    for cuts in (lambda: _boundaries(text, abbrevs, True, a, b), lambda: _word_cuts(text, a, b)):
        parts = _spans(text, cuts(), a, b)
        if len(parts) > 1:
            out = []
            for pa, pb in _pack(text, parts, max_chars):
                out += _fit(text, pa, pb, max_chars, abbrevs)
            return out
    return _char_cuts(text, a, b, max_chars)


def _word_cuts(text: str, a: int, b: int) -> list[int]:
    return [a + m.end() for m in re.finditer(r"\s+", text[a:b])]


def _char_cuts(text: str, a: int, b: int, max_chars: int) -> list[tuple[int, int]]:
    out, start, w = [], a, 0
    for i in range(a, b):
        cw = 0 if text[i].isspace() else (CJK_WEIGHT if _CJK.match(text[i]) else 1)
        if w + cw > max_chars and w > 0 and cw:  # (a space weighs nothing: it stays with the piece before it)
            out.append((start, i))
            start, w = i, 0
        w += cw
    out.append((start, b))
    return out


def _pack(text: str, parts: list[tuple[int, int]], max_chars: int) -> list[tuple[int, int]]:
    """Consecutive parts joined greedily while the result fits max_chars (parts longer alone stay alone)."""
    out: list[tuple[int, int]] = []
    for a, b in parts:
        if out and weight(text[out[-1][0]:b]) <= max_chars:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _merge_tiny(text: str, parts: list[tuple[int, int]], max_chars: int, min_chars: int) -> list[tuple[int, int]]:
    """Each part shorter than min_chars joins the next one (the last joins the previous), if the result fits."""
    out, carry = _merge_open(text, parts, max_chars, min_chars)
    if carry is not None:
        if out and weight(text[out[-1][0]:carry[1]]) <= max_chars:
            out[-1] = (out[-1][0], carry[1])
        else:
            out.append(carry)
    return out


def _merge_open(text: str, parts: list[tuple[int, int]], max_chars: int,
                min_chars: int) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
    """_merge_tiny before the text's end: (the parts made so far, the tiny part still waiting for the next one)."""
    out: list[tuple[int, int]] = []
    carry: tuple[int, int] | None = None
    for a, b in parts:
        if carry is not None:
            if weight(text[carry[0]:b]) <= max_chars:
                a = carry[0]
            else:
                out.append(carry)
            carry = None
        if weight(text[a:b]) < min_chars:
            carry = (a, b)
        else:
            out.append((a, b))
    return out, carry


# --------------------------------------------------------------------------- streamed text
_CANDIDATES = set(_SENTENCE_ASCII + _SENTENCE_CJK + _CLAUSE_ASCII + _CLAUSE_CJK + _CLOSERS + "\n")


class SplitStream:
    """split_text for a text that arrives in pieces (an LLM's tokens): each segment as soon as the text after it
    shows where it ends, the same segments as split_text(the whole text) (tests/inputs/test_split.py proves it).

        s = SplitStream("sentence")
        s.append("Dr. Smith paid $3.")  ->  []          ("3." may be "3.50"; the segment may still grow)
        s.append("50. Then he left! And")  ->  ["Dr. Smith paid $3.50."]
        s.close()  ->  ["Then he left! And"]           ("And" is a tiny fragment at the end: it joins)

    A cut is known once a non-space character follows it (the next word decides "3." + "5", "Dr." + "Smith";
    another mark or a closing quote extends the run). A segment is held back until min_chars of text follow its
    end: a tiny fragment at the text's end joins the segment before it. NOTE(wsform): a run of more than `max_pending`
    characters without a known cut is split there as if the text ended (bounded memory and work per piece;
    split_text would cut such a run at clauses or words); below that bound the segments equal split_text's.
    """

    def __init__(self, granularity: str = "sentence", language: str | None = None, max_chars: int = MAX_CHARS,
                 min_chars: int = MIN_CHARS, max_pending: int | None = None):
        self.abbrevs = _options(granularity, language, max_chars, min_chars)
        self.clause, self.max_chars, self.min_chars = granularity == "clause", max_chars, min_chars
        self.max_pending = 2 * max_chars if max_pending is None else max_pending
        self.text = ""  # the text from a little before `base` (what _ends_here may look back at), to its end
        self.base = 0  # in text: where the span holding the first segment not handed out begins
        self.done = 0  # in text: the end of the last segment handed out
        self.last = -1  # in text: the last non-space character
        self.held = False  # a complete part waits for min_chars of text after it

    def append(self, piece: str) -> list[str]:
        """Add text; the segments it completes (often none)."""
        last, self.text = self.last, self.text + piece
        tail = piece.rstrip()
        if not tail:
            return []  # whitespace settles no cut: a cut is known once a non-space character follows it
        self.last = len(self.text) - (len(piece) - len(tail)) - 1
        if len(self.text) - self.done > self.max_pending:
            return self._cut(final=True)
        # a new cut needs a mark (or a closer ending a run, or a paragraph break) after the old last character
        start = max(last, self.base)
        if self.held or any(c in _CANDIDATES for c in self.text[start:self.last]):
            return self._cut(final=False)
        return []

    def close(self) -> list[str]:
        """The text ends: the rest of its segments."""
        return self._cut(final=True)

    def _cut(self, final: bool) -> list[str]:
        text, end = self.text, len(self.text)
        cuts = _boundaries(text, self.abbrevs, self.clause, self.base, end)
        if not final:
            cuts = [c for c in cuts if c <= self.last]  # known: a non-space character follows
            if not cuts:
                return []
        stop = end if final else cuts[-1]
        spans = _spans(text, cuts, self.base, stop)
        parts = [p for a, b in spans for p in _fit(text, a, b, self.max_chars, self.abbrevs) if p[0] >= self.done]
        # the span holding `done` is fitted as before: its parts not handed out start at `done`
        assert not parts or not text[self.done:parts[0][0]].strip(), (parts[0], self.done)
        if final:
            out = _merge_tiny(text, parts, self.max_chars, self.min_chars)
        else:
            # NOTE(wsform): a tiny fragment at the text's end joins the part before it, so that part is final only
            # once min_chars of text follow the cut: then whatever follows makes a part of its own or joins forward
            out, _ = _merge_open(text, parts, self.max_chars, self.min_chars)
            self.held = bool(out) and weight(text[stop:]) < self.min_chars
            if self.held:
                out = out[:-1]
        if not out:
            return []
        segs = [text[a:b].strip() for a, b in out]
        self.done = out[-1][1]
        self.base = max(a for a, _ in spans if a <= self.done) if not final else end
        self._trim()
        return segs

    def _trim(self) -> None:
        """Drop the text before the word that ends before `base` (_ends_here looks back no further)."""
        k = self.base
        while k > 0 and not (self.text[k - 1].isspace() or self.text[k - 1] in _STOPS):
            k -= 1
        k = max(k - 1, 0)
        if k:
            self.text = self.text[k:]
            self.base, self.done, self.last = self.base - k, self.done - k, self.last - k
