"""One request's state as the engine sees it (no torch import: the scheduler reads it too)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..inputs.request import PreparedRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    # NOTE(finished): everything from here on is a finished status
    FINISHED_STOPPED = 2  # sampled EOS
    FINISHED_LENGTH = 3  # reached max_new_tokens
    FINISHED_ABORTED = 4  # cancelled by the client
    FINISHED_ERROR = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def reason(self) -> str | None:
        return {2: "stop", 3: "length", 4: "abort", 5: "error"}.get(int(self))


@dataclass(slots=True)
class StreamOptions:
    """Chunk k holds min(chunk_frames, first_chunk_frames * 2**k) frames: the first one small for time to
    first audio, then doubling, so each chunk's audio outlasts the making of the next (no stall) while
    the vocoder is called a few times per second, not once per frame. The audio is always cut into these chunks;
    with the deadline policy (q3tts.engine.deadline) one emitted AudioChunk may hold several of them (a first one
    grown by load, a stream left waiting), never part of one but the last."""

    first_chunk_frames: int = 1  # frames in the first audio chunk (80 ms each)
    chunk_frames: int = 16  # the largest chunk
    # seconds of sent audio the listener cannot play yet: what its encoder keeps back (an mp3 encoder's look-ahead);
    # the deadline policy counts it against the stream's slack and its first send
    held_back_s: float = 0.0

    def __post_init__(self) -> None:
        if self.first_chunk_frames < 1 or self.chunk_frames < 1:
            raise ValueError("first_chunk_frames and chunk_frames must be >= 1")
        if not self.held_back_s >= 0:
            raise ValueError(f"held_back_s must be >= 0 seconds, got {self.held_back_s!r}")


@dataclass(slots=True, eq=False)
class EngineRequest:
    request_id: str
    prepared: PreparedRequest  # layout, speaker embedding, ref codes, sampling params
    stream: StreamOptions | None = None  # None: offline (codes only, decoded by the caller)
    arrival_time: float = field(default_factory=time.perf_counter)
    ready_at: float | None = None  # when a schedule() first found its prompt ready (the deadline policy's wait)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    frames: list = field(default_factory=list)  # generated frames, each a [K] int64 tensor on the device
    max_frames: int = 0  # max_new_tokens - 1, capped by the KV cache
    frames_vocoded: int = 0  # frames already turned into audio
    chunks_emitted: int = 0
    vocoder_row: int | None = None  # its row of the StreamingVocoder's state pool while streaming
    blocks: list[int] = field(default_factory=list)  # paged KV cache: its blocks, in position order
    text_fed: int = 0  # streamed text: trailing text tokens handed to its row so far
    text_done: bool = False  # streamed text: all of it (and tts_eos) handed over
    stream_done: bool = False  # its last chunk has been emitted
    first_sent_at: float | None = None  # streaming: when its first chunk was emitted (perf_counter): playback starts
    audio_sent_s: float = 0.0  # streaming: seconds of audio emitted so far
    error: str | None = None

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prepared.layout)  # prefill positions L

    @property
    def prompt_ready(self) -> bool:
        return self.prepared.layout is not None  # a streamed text builds it once enough text has come

    @property
    def can_run(self) -> bool:
        """Its next frame may run: frame k reads trailing text token k, so with streamed text that token must
        have arrived, or the text be complete (then tts_eos and tts_pad follow)."""
        return self.prepared.text is None or self.text_done or self.text_fed > self.num_frames

    @property
    def next_position(self) -> int:
        """The cache position its next frame writes (the prefill wrote 0..L-1; frame k writes L + k)."""
        return self.num_prompt_tokens + self.num_frames

    def sent(self, n: int, audio_s: float, now: float) -> None:
        """A chunk of n frames (audio_s seconds) was emitted at `now`: its playback clock starts at the first."""
        self.frames_vocoded += n
        self.chunks_emitted += 1
        if n > 0 and self.first_sent_at is None:
            self.first_sent_at = now
        self.audio_sent_s += audio_s

    def slack(self, now: float) -> float | None:
        """Seconds of emitted audio its listener has not played yet at `now` (a player that started at the first
        chunk; < 0: it stalled), less what the listener's encoder still holds back (StreamOptions.held_back_s); None
        before the first chunk (and for offline requests)."""
        if self.first_sent_at is None:
            return None
        return self.audio_sent_s - self.stream.held_back_s - (now - self.first_sent_at)
