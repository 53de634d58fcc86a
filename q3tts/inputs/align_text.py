"""The forced aligner's text side: words, the prompt, and timestamp classes -> word times.

As qwen-asr 0.0.6's `Qwen3ForceAlignProcessor`:
- words: Japanese by nagisa (the optional extra `q3tts[aligner-ja-ko]`), Korean refused (see split_words), any
  other language split on white space, each piece stripped to letters, digits and apostrophes, CJK ideographs split
  off one by one.
- prompt: `<|audio_start|><|audio_pad|><|audio_end|>` + each word followed by `<timestamp><timestamp>`; the one
  audio_pad stands for the N audio tokens.
- times: the class at the 2W timestamp slots times timestamp_segment_time ms, made non-decreasing by the official
  fix-up (keep a longest non-decreasing subsequence; runs of <= 2 outliers take the nearer neighbour, longer runs
  are interpolated), then word i = (slot 2i, slot 2i + 1), in seconds rounded to ms.
"""

from __future__ import annotations

import unicodedata
from itertools import repeat
from typing import NamedTuple

import numpy as np

from .request import InputError

EXTRA = "q3tts[aligner-ja-ko]"


class WordTime(NamedTuple):
    """One aligned word (a CJK character for Chinese), its start and end in seconds from the audio's start. (A named
    tuple: immutable, and a batch's thousands are made at a tuple's cost, where a frozen dataclass's __init__ costs
    several times that on the aligner's critical path.)"""

    word: str
    start_s: float
    end_s: float


def _kept(ch: str) -> bool:
    return ch == "'" or unicodedata.category(ch)[0] in "LN"


def clean(token: str) -> str:
    return "".join(ch for ch in token if _kept(ch))


def is_cjk(ch: str) -> bool:
    c = ord(ch)
    return (0x4E00 <= c <= 0x9FFF or 0x3400 <= c <= 0x4DBF or 0x20000 <= c <= 0x2A6DF or 0x2A700 <= c <= 0x2B73F
            or 0x2B740 <= c <= 0x2B81F or 0x2B820 <= c <= 0x2CEAF or 0xF900 <= c <= 0xFAFF)


# an ASCII text's characters that clean() drops and split() does not split on: one str.translate cleans it
_ASCII_DROP = {c: None for c in range(128) if not (chr(c).isspace() or _kept(chr(c)))}


def _split_cjk(piece: str) -> list[str]:
    out, buf = [], ""
    for ch in piece:
        if is_cjk(ch):
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        else:
            buf += ch
    return out + ([buf] if buf else [])


def split_words(text: str, language: str) -> list[str]:
    """The aligned units of text (see the module doc)."""
    lang = language.lower()
    if lang == "japanese":
        try:
            import nagisa
        except ImportError as e:
            raise InputError(f"language 'Japanese': word splitting needs nagisa; install the extra {EXTRA}") from e
        pieces = nagisa.tagging(text).words
        return [c for c in map(clean, pieces) if c]
    if lang == "korean":
        # NOTE(aligner): the official splits Korean with soynlp's LTokenizer scored by a dictionary that ships inside
        # qwen-asr (assets/korean_dict_jieba.dict); without that word list the words (and so the times) would differ
        raise InputError("language 'Korean' is not supported by the aligner yet (its word splitting needs qwen-asr's "
                         "Korean dictionary); accepted: any space-delimited language, Chinese, Japanese (extra "
                         f"{EXTRA})")
    if text.isascii():  # no CJK: the pieces below are the white-space pieces cleaned, the empty ones dropped
        return text.translate(_ASCII_DROP).split()
    words: list[str] = []
    for seg in text.split():
        c = clean(seg)
        if c:
            words.extend(_split_cjk(c))
    return words


def aligner_language(tts_language: str | None) -> str:
    """The aligner's language for a synthesis language: none / auto -> "Auto" (the default splitting), the Chinese
    dialects (beijing_dialect, sichuan_dialect) -> "Chinese" (per character), others as they are."""
    if not tts_language or tts_language.lower() == "auto":
        return "Auto"
    return "Chinese" if tts_language.lower().endswith("_dialect") else tts_language


def prompt_text(words: list[str]) -> str:
    return "<|audio_start|><|audio_pad|><|audio_end|>" + "".join(w + "<timestamp><timestamp>" for w in words)


def _longest_run_kept(data: list[float]) -> list[bool]:
    """The slots of the official's longest non-decreasing subsequence: dp[i] = 1 + the largest dp[j] over j < i with
    data[j] <= data[i], its parent the first such j; the chain back from the first i of the largest dp. The
    official scans every j (O(n^2)); a Fenwick tree over the values' ranks keeps, per prefix of ranks, the largest
    (dp, -j) seen so far: the same dp and the same first j, in O(n log n)."""
    n = len(data)
    values = sorted(set(data))
    rank = {v: k + 1 for k, v in enumerate(values)}  # 1-based: data[j] <= data[i] <=> rank[j] <= rank[i]
    tree: list[tuple[int, int]] = [(0, 0)] * (len(values) + 1)  # (dp, -j); (0, 0): none yet
    dp, parent = [0] * n, [-1] * n
    for i, v in enumerate(data):
        best, k = (0, 0), rank[v]
        while k > 0:
            best, k = max(best, tree[k]), k & (k - 1)
        dp[i], parent[i] = (best[0] + 1, -best[1]) if best[0] else (1, -1)
        k, item = rank[v], (dp[i], -i)
        while k < len(tree):
            if item > tree[k]:
                tree[k] = item
            k += k & -k
    kept = [False] * n
    idx = dp.index(max(dp))
    while idx != -1:
        kept[idx] = True
        idx = parent[idx]
    return kept


BATCH_DP_MAX = 256  # slots: rows up to this long share one vectorized scan and fix-up (fix_timestamps_padded)
DP_CHUNK = 1 << 21  # rows x slots x slots of one vectorized scan at most (its [i, j, rows] comparisons)


def _padded_rows(rows: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of slot times -> (data [R, n] float64, inf past each row's end; lengths [R])."""
    lens = np.array([len(r) for r in rows], np.int64)
    data = np.full((len(rows), max(int(lens.max(initial=0)), 1)), np.inf)
    for k, r in enumerate(rows):
        data[k, :lens[k]] = r
    return data, lens


def _kept_padded(data: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """data [R, n] float64 (inf past each row's end), lens [R] in 1..n -> kept [R, n]: each row's longest
    non-decreasing subsequence as the official finds it (dp[i] = 1 + the largest dp[j] over j < i with data[j] <=
    data[i], its parent the first such j; the chain back from the first i of the largest dp), False past its end.
    The official's scan over j vectorized across rows and j: n numpy steps for the batch, not n^2 / 2 Python steps a
    row (the Fenwick tree's n log n beats the batch's n^2 past BATCH_DP_MAX). A row already non-decreasing keeps
    every slot (its dp is 1..len, each slot's parent the one before it) and is not scanned."""
    R, n = data.shape
    valid = np.arange(n)[None, :] < lens[:, None]
    kept = valid.copy()
    scan = np.flatnonzero((np.diff(data, axis=1) < 0).any(1))  # (inf - inf is NaN: padding never decreases)
    if scan.size == 0:
        return kept
    data, lens, valid = data[scan], lens[scan], valid[scan]
    d = data.T  # [n, R']: the rows last, so that each step reads contiguous memory
    le = (d[None, :, :] <= d[:, None, :]).astype(np.int32)  # [i, j, R']: data[j] <= data[i]; padding: never a j
    dp = np.ones(d.shape, np.int32)  # [n, R']
    for i in range(1, n):
        dp[i] += (le[i, :i] * dp[:i]).max(0)
    # the parent: the first j < i with data[j] <= data[i] whose dp is the largest, dp[i] - 1 (none where dp[i] is 1)
    match = (le > 0) & np.tri(n, k=-1, dtype=bool)[:, :, None] & (dp[None, :, :] == dp[:, None, :] - 1)  # [i, j, R']
    parent = np.where(dp > 1, match.argmax(1), -1).T  # [R', n]
    dp = dp.T
    at = np.where(valid, dp, 0).argmax(1)  # each row's first slot of the largest dp; its chain back, all rows at once
    chain = np.zeros(data.shape, bool)
    live = np.arange(len(scan))
    while live.size:
        chain[live, at[live]] = True
        at[live] = parent[live, at[live]]
        live = live[at[live] >= 0]
    kept[scan] = chain
    return kept


def _fix_padded(data: np.ndarray, lens: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """_fix of rows of 1..BATCH_DP_MAX slots (data [R, n], inf past each row's end; lens [R]) with their kept
    subsequences, all slots of the batch at once: a slot outside it lies in the run between the kept slots left and
    right of it (either may be missing: the row's ends), and takes the value _fix gives it there, by the same float
    operations in the same order. -> int64 [R, n], 0 past each row's end."""
    R, n = data.shape
    pos = np.broadcast_to(np.arange(n), (R, n))
    left = np.maximum.accumulate(np.where(kept, pos, -1), axis=1)  # the last kept slot at or before, -1: none
    right = np.minimum.accumulate(np.where(kept, pos, n)[:, ::-1], axis=1)[:, ::-1]  # the first at or after, n: none
    has_l, has_r = left >= 0, right < lens[:, None]
    rows_ix = np.arange(R)[:, None]
    lv = data[rows_ix, np.maximum(left, 0)]
    rv = data[rows_ix, np.minimum(right, lens[:, None] - 1)]
    i = left + 1  # the run i..j-1 between them, as _fix names it
    j = np.where(has_r, right, lens[:, None])
    near = np.where(~has_l, rv, np.where(~has_r, lv, np.where(pos - left <= j - pos, lv, rv)))  # runs of 1 or 2
    with np.errstate(invalid="ignore", divide="ignore"):  # (slots where the interpolation is not the one taken)
        step = (rv - lv) / (j - i + 1)
        between = lv + step * (pos - i + 1)
    far = np.where(has_l & has_r, between, np.where(has_l, lv, rv))
    fixed = np.where(kept, data, np.where(j - i <= 2, near, far))
    return np.where(pos < lens[:, None], fixed, 0.0).astype(np.int64)  # (padding slots: not cast from inf)


def fix_timestamps(data: list[float]) -> list[int]:
    """The official monotonic fix-up of the 2W slot times (ms), truncated to int ms."""
    return fix_timestamps_rows([data])[0]


def fix_timestamps_rows(rows: list[list[float]]) -> list[list[int]]:
    """fix_timestamps of every row (fix_timestamps_padded)."""
    data, lens = _padded_rows(rows)
    return [r[:m].tolist() for r, m in zip(fix_timestamps_padded(data, lens), lens.tolist())]


def fix_timestamps_padded(data: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """fix_timestamps of every row of data [R, n] float64 (ms; row r's slots are its first lens[r], what lies past
    them is not read) -> int64 [R, n], 0 past each row's end. Rows of up to BATCH_DP_MAX slots at once, a few
    hundred rows a scan (DP_CHUNK; trimmed to their own longest), longer rows by the Fenwick tree and _fix."""
    R, n = data.shape
    fixed = np.zeros((R, n), np.int64)
    for b in np.flatnonzero(lens > BATCH_DP_MAX):
        row = data[b, :lens[b]].tolist()
        fixed[b, :lens[b]] = _fix(row, _longest_run_kept(row))
    short = np.flatnonzero((lens > 0) & (lens <= BATCH_DP_MAX))
    if short.size:
        m = int(lens[short].max())
        sub = np.where(np.arange(m)[None, :] < lens[short, None], data[short, :m], np.inf)  # [R', m]
        sub_lens = lens[short]
        step = max(1, DP_CHUNK // (m * m))
        for lo in range(0, short.size, step):
            d, k = sub[lo:lo + step], sub_lens[lo:lo + step]
            fixed[short[lo:lo + step], :m] = _fix_padded(d, k, _kept_padded(d, k))
    return fixed


def _fix(data: list[float], normal: list[bool]) -> list[int]:
    """The official's fix-up of the slots outside the kept subsequence `normal`."""
    n = len(data)
    out = list(data)
    i = 0
    while i < n:
        if normal[i]:
            i += 1
            continue
        j = i
        while j < n and not normal[j]:
            j += 1
        # the run i..j-1 lies between kept slots (i - 1 and j), whose values are never changed
        left = out[i - 1] if i > 0 else None
        right = out[j] if j < n else None
        if j - i <= 2:
            for k in range(i, j):
                if left is None:
                    out[k] = right
                elif right is None:
                    out[k] = left
                else:
                    out[k] = left if (k - (i - 1)) <= (j - k) else right
        elif left is not None and right is not None:
            step = (right - left) / (j - i + 1)
            for k in range(i, j):
                out[k] = left + step * (k - i + 1)
        elif left is not None or right is not None:
            for k in range(i, j):
                out[k] = left if left is not None else right
        i = j
    return [int(v) for v in out]


def word_times(words: list[str], slot_ms: list[float]) -> list[WordTime]:
    """words and their 2W slot times (ms) -> WordTimes in seconds (rounded to 3 decimals, as the official)."""
    return word_times_rows([words], [slot_ms])[0]


def word_times_rows(words: list[list[str]], slot_ms: list[list[float]]) -> list[list[WordTime]]:
    """word_times of every row of a batch (word_times_padded)."""
    data, _ = _padded_rows(slot_ms)
    return word_times_padded(words, data)


def word_times_padded(words: list[list[str]], slot_ms: np.ndarray) -> list[list[WordTime]]:
    """word_times of every row of a batch: row r's words and its slot times (ms), the first 2 len(words[r]) of
    slot_ms [R, >= 2 max words] (float; what lies past them is not read). The fix-up, the seconds and their pairing
    are numpy over the whole batch; each WordTime is made by tuple.__new__ from zip's tuple (what the named tuple's
    own constructor does, without its Python frame). (The official rounds the seconds to 3 decimals; a whole number
    of ms over 1000.0 is the double nearest to a 3-decimal number, which that rounding returns unchanged.)"""
    lens = np.array([2 * len(ws) for ws in words], np.int64)
    assert slot_ms.shape[0] == len(words) and slot_ms.shape[1] >= lens.max(initial=0), (slot_ms.shape, lens)
    secs = fix_timestamps_padded(np.asarray(slot_ms, np.float64), lens) / 1000.0  # [R, n]
    starts, ends = secs[:, 0::2].tolist(), secs[:, 1::2].tolist()  # (zip stops at each row's words)
    return [list(map(tuple.__new__, repeat(WordTime), zip(ws, s, e))) for ws, s, e in zip(words, starts, ends)]
