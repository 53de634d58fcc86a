"""The request types of the input side: what the engine is handed, and a voice-clone prompt item."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..models.talker import NONE
from ..sampling import SamplingParams


class InputError(ValueError):
    """Input that cannot be served. `param` names the offending argument (its message starts with that name where
    the message is about it) and `code` the kind of problem, so the server can answer in its own field names."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(slots=True)
class PromptLayout:
    """One request's talker prompt, position by position.

    text_ids[i]  : text token at prefill position i, or NONE
    codec_ids[i] : codec id at position i, or NONE, SPEAKER (x-vector) or REF (next ICL ref frame)
    trailing_ids : text tokens fed one per frame after the prefill (streaming-text mode), then tts_pad
    """

    text_ids: list[int] = field(default_factory=list)
    codec_ids: list[int] = field(default_factory=list)
    trailing_ids: list[int] = field(default_factory=list)

    def add(self, text: int = NONE, codec: int = NONE) -> None:
        self.text_ids.append(text)
        self.codec_ids.append(codec)

    def __len__(self) -> int:
        return len(self.text_ids)


class StreamedText(Protocol):
    """The contract of a request's text as it is written (q3tts.inputs.text.TextStream implements it): the caller
    appends pieces and closes it; the engine lays out the prompt once the text suffices, then takes the committed
    text tokens as they come."""

    closed: bool
    num_tokens: int  # text tokens so far (all of them once closed)
    error: str | None  # a closed text that cannot be spoken: the engine fails the request with it
    on_change: Callable[[], None]  # set by the engine: called after every append and the close

    def append(self, text: str) -> None: ...

    def close(self) -> None: ...

    def layout(self) -> PromptLayout | None:
        """The prompt once the text fills it (None before)."""

    def take(self) -> tuple[list[int], bool]:
        """The text tokens committed since the last take, and whether the text is complete with them."""


@dataclass
class VoiceClonePromptItem:
    """One voice-clone prompt, field for field as `qwen_tts.VoiceClonePromptItem`."""

    ref_code: torch.Tensor | None  # [T, 16] codec frames of the reference audio (ICL), or None
    ref_spk_embedding: torch.Tensor  # [D] x-vector
    x_vector_only_mode: bool
    icl_mode: bool
    ref_text: str | None = None


@dataclass(eq=False)
class PreparedRequest:
    """A request ready for the engine: its prompt layout and what fills the layout's slots."""

    layout: PromptLayout | None  # None until a streamed text has filled the prompt (the engine builds it)
    speaker_embedding: torch.Tensor | None  # [D] x-vector (voice clone)
    ref_codes: torch.Tensor | None  # [T, 16] ICL reference frames (decoded in front, then cut)
    params: SamplingParams
    text: StreamedText | None = None  # the text streamed in: append pieces to it, then close it
    # the runaway guard (a model that never samples EOS): at most max(MIN_FRAME_CAP, max_frames_per_token x text
    # tokens) frames; 0: none (max_new_tokens given by the caller is the cap)
    max_frames_per_token: float = 0.0
    num_text_tokens: int = 0  # of the whole text (a streamed one counts its own, once closed)

    def frame_cap(self) -> int | None:
        """The most frames its text may take, or None: no guard, or a streamed text not yet complete."""
        if not self.max_frames_per_token or (self.text is not None and not self.text.closed):
            return None
        n = self.text.num_tokens if self.text is not None else self.num_text_tokens
        return max(MIN_FRAME_CAP, math.ceil(self.max_frames_per_token * n))


# The runaway guard's bounds. Speech runs ~3-4 frames (80 ms each) per text token of the Qwen tokenizer (English:
# ~4 characters and ~0.3 s per token; Chinese: ~1.5 characters per token, ~4 characters per second; digits are
# one token each and take ~0.3 s): 16 frames per token leaves 4x for slow, instructed or pausing speech, and no
# text, however short, is cut before 64 frames (5 s).
MAX_FRAMES_PER_TOKEN = 16.0
MIN_FRAME_CAP = 64
