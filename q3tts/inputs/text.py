"""Text that arrives in pieces (an LLM's tokens, keystrokes): incremental tokenization and the appendable text of
one request.

Byte-level BPE never merges across the pre-tokenizer's pieces (the Qwen2 split regex runs on NFC-normalized
text), and a piece that ends before the last piece cannot change when text is appended: the regex matches
left to right and only the last match can grow, shrink or split. So the ids of every piece but the last are
final; the last piece (and a tail that could still become a special token such as "<|im_end|>") is held
back until more text or the close. The committed ids always equal a prefix of the whole text's ids
(tests/inputs/test_text.py checks every split of many texts).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .prompt import ROLE, PromptBuilder, PromptSpec, TextTokenizer
from .request import InputError, PromptLayout


class IncrementalTokenizer:
    """push(text) / close() -> the newly committed ids of the segment ROLE + text (see PromptBuilder.text_ids)."""

    def __init__(self, tok: TextTokenizer):
        self.tok = tok
        self.pending = tok.normalize(ROLE)  # NFC text not yet committed (starts at a piece boundary)
        self.spoken = False  # any non-space text yet (an all-blank text is refused at the close, as a whole one)

    def push(self, text: str) -> list[int]:
        # NOTE(nfc): NFC(NFC(a) + b) == NFC(a + b), and the held-back tail starts at a piece boundary, so normalizing
        # what is pending equals normalizing the whole text from there on
        self.pending = self.tok.normalize(self.pending + text)
        self.spoken = self.spoken or bool(text.strip())
        return self._commit(final=False)

    def close(self) -> list[int]:
        if not self.spoken:
            raise InputError("text is empty: give the words to speak", param="text", code="empty_input")
        return self._commit(final=True)

    def _commit(self, final: bool) -> list[int]:
        text = self.pending
        ids, offsets = self.tok.encode_offsets(text)
        if final:
            cut = len(text)
        else:
            starts = self.tok.piece_starts(text)
            cut = min(starts[-1] if starts else 0, self._special_tail(text))
        n = 0
        while n < len(ids) and offsets[n][1] <= cut:  # offsets are in order; a token never spans two pieces
            n += 1
        end = offsets[n - 1][1] if n else 0
        self.pending = text[end:]
        return ids[:n]

    def _special_tail(self, text: str) -> int:
        """Where a tail that may still grow into a special token starts (len(text) if there is none)."""
        for k in range(min(len(text), self.tok.max_special_len - 1), 0, -1):
            if text[-k:] in self.tok.special_prefixes:
                return len(text) - k
        return len(text)


class TextStream:
    """The appendable text of one request. Any thread appends and closes; the engine takes what is committed.

    The prompt is built once enough text has come (PromptBuilder.needed); every id committed after that is
    trailing text, fed one per frame, and closing appends tts_eos, as the whole text's layout ends."""

    def __init__(self, builder: PromptBuilder, spec: PromptSpec):
        self.builder, self.spec = builder, spec
        self.needed = builder.needed(spec)  # None: a non-streaming layout waits for the whole text
        self._tok = IncrementalTokenizer(builder.tok)
        self._ids: list[int] = []  # committed ids of ROLE + text
        self._taken = 0  # how many of them the engine has consumed
        self._eos_taken = False
        self.closed = False
        self.error: str | None = None  # a closed text that cannot be spoken (empty)
        self._lock = threading.Lock()
        self.on_change: Callable[[], None] = lambda: None  # set by the engine: wakes its loop

    def append(self, text: str) -> None:
        if not isinstance(text, str):
            raise InputError(f"text pieces must be strings, got {type(text).__name__}", param="text")
        with self._lock:
            if self.closed:
                raise InputError("the text was closed: no more text can be added", param="text", code="text_closed")
            self._ids += self._tok.push(text)
        self.on_change()

    def close(self) -> None:
        """The text is complete (InputError if it was empty; the engine then fails the request with .error)."""
        try:
            with self._lock:
                if self.closed:
                    return
                self.closed = True
                self._ids += self._tok.close()
        except InputError as e:
            self.error = str(e)
            raise
        finally:
            self.on_change()

    @property
    def num_tokens(self) -> int:
        """Text tokens committed so far (with the few of the role prefix)."""
        return len(self._ids)

    def ready(self) -> bool:
        """Enough text for the prompt."""
        return self.closed or (self.needed is not None and len(self._ids) >= self.needed)

    def layout(self) -> PromptLayout | None:
        """The prompt, with the text committed so far (None until ready()); what follows comes from take()."""
        with self._lock:
            if not self.ready() or self.error:
                return None
            self._taken, self._eos_taken = len(self._ids), self.closed
            return self.builder.build(self.spec, list(self._ids), closed=self.closed)

    def take(self) -> tuple[list[int], bool]:
        """(trailing text ids committed since the last call, whether the text is now complete); tts_eos comes
        once, after the last id."""
        with self._lock:
            new = self._ids[self._taken:]
            self._taken = len(self._ids)
            if self.closed and not self._eos_taken:
                new.append(self.builder.cfg.tts_eos_token_id)
                self._eos_taken = True
            return new, self.closed
