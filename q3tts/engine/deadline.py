"""Deadline-aware streaming, pure Python: which chunks to vocode now, how large a first chunk, how many newcomers.

Every streaming request keeps a playback clock: a listener starts playing at its first chunk, so at time t it has
played (t - first_sent_at) s of its audio_sent_s s. Its slack = audio_sent_s - (t - first_sent_at) is how long the
engine may leave it without a new chunk before its listener stalls. A step costs

    prefill (its newcomers) + frame (every running row) + vocode (the chunks due)

and the engine measures each part as a moving average (`StepTimes`). The policy (`DeadlinePolicy`):
  - vocode: a row whose slack would run out before the next step's chunks come (slack < horizon: two steps and a
    margin) is vocoded now with whatever frames it has; a row with more slack waits for its full chunk (the
    request's StreamOptions), and full chunks go nearest deadline first within a frame budget per step, so when many
    chunks fall due in one step, those that can wait go in the next steps instead of lengthening this one;
  - first chunk: enough frames to outlast a step and a prefill (one frame while steps are short), never fewer than
    the request asked for;
  - admission: a prefill delays every running row by its time, so newcomers go while their estimated prefill fits
    into the smallest slack left after this step (`admission_budget`); the first goes whenever no row is at risk,
    and a request that has waited max_wait_s goes anyway, one per step (nothing starves).
Rows that cannot run (streamed text not yet there) and offline requests have no deadline the engine can keep and
constrain nothing. Scheduling order never changes a row's codes (sampling noise is per request, frame, codebook).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import EngineRequest

FRAME_S = 0.08  # seconds of audio per frame (1920 samples at 24 kHz)


@dataclass(slots=True)
class MovingAverage:
    """Exponential moving average; `value` is 0.0 until the first sample, which it takes whole."""

    alpha: float = 0.25  # weight of a new sample
    value: float = 0.0
    samples: int = 0

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else self.value + self.alpha * (x - self.value)
        self.samples += 1


@dataclass(slots=True)
class StepTimes:
    """The engine's measured costs (seconds), updated after every step."""

    frame: MovingAverage = field(default_factory=MovingAverage)  # one frame of every running row
    vocode: MovingAverage = field(default_factory=MovingAverage)  # a step's vocoding, in steps that vocode
    prefill: MovingAverage = field(default_factory=MovingAverage)  # the admission of one newcomer

    @property
    def step_s(self) -> float:
        """A step without newcomers: its frame and its chunks."""
        return self.frame.value + self.vocode.value

    def record(self, prefill_s: float, admitted: int, frame_s: float | None, vocode_s: float | None) -> None:
        """One step's measured phases: prefill_s for `admitted` newcomers; frame_s None if no row ran; vocode_s None
        if nothing was vocoded."""
        if admitted:
            self.prefill.add(prefill_s / admitted)
        if frame_s is not None:
            self.frame.add(frame_s)
        if vocode_s is not None:
            self.vocode.add(vocode_s)


@dataclass(slots=True)
class DeadlinePolicy:
    """Args:
        margin_s: safety added to every estimate (the delivery to the client, a step longer than its average).
        max_wait_s: a ready request waiting this long is admitted even while rows are at risk (one per step).
        min_vocode_frames: the per-step frame budget of chunks that could wait is max(this, 2 x streaming rows):
            twice what the rows make per step, so a backlog drains.
    """

    margin_s: float = 0.02
    max_wait_s: float = 1.0
    min_vocode_frames: int = 64
    times: StepTimes = field(default_factory=StepTimes)

    @property
    def horizon_s(self) -> float:
        """A row with less slack than this (after its frame) would run dry before the next step's chunks come."""
        return 2 * self.times.step_s + self.margin_s

    def first_chunk_frames(self, req: EngineRequest) -> int:
        """Frames of req's first chunk: enough audio to cover the next step and a prefill; at least what it asked
        for, at most its largest chunk."""
        s = req.stream
        need = math.ceil((self.times.step_s + self.times.prefill.value + self.margin_s) / FRAME_S)
        return max(s.first_chunk_frames, min(s.chunk_frames, need))

    def chunk_target(self, req: EngineRequest) -> int:
        """Frames that make req's next chunk full (the first sized by load, then the request's own doubling)."""
        return self.first_chunk_frames(req) if req.chunks_emitted == 0 else req.next_chunk_size()

    # ------------------------------------------------------------------ admission
    def admission_budget(self, running: list[EngineRequest], now: float) -> float:
        """Seconds of prefill this step can take without a playing row stalling: the smallest slack of the rows
        that play and can run, less this step and the margin (inf with none; < 0: a row is at risk)."""
        slacks = [r.slack(now) for r in running if r.can_run and r.first_sent_at is not None]
        return min(slacks) - self.times.step_s - self.margin_s if slacks else math.inf

    def admits(self, req: EngineRequest, admitted: int, budget: float, now: float) -> bool:
        """Whether req may join the `admitted` newcomers already chosen this step under `budget` (seconds)."""
        if now - req.arrival_time >= self.max_wait_s and admitted == 0:
            return True  # waited long enough: it goes, whatever the others' slack
        if admitted == 0:
            return budget >= 0  # the first whenever nobody is at risk
        return (admitted + 1) * self.times.prefill.value <= budget

    # ------------------------------------------------------------------ vocoding
    def plan_chunks(self, reqs: list[EngineRequest], now: float) -> list[tuple[EngineRequest, int]]:
        """The chunks to vocode now, as (request, frames), nearest deadline first. A finished request's remainder
        always goes (n may be 0: its empty last chunk; nothing for a cancelled one); a row not yet playing goes once
        it has its first chunk's frames; a playing row goes with all it has when its slack is under the horizon,
        else once its chunk is full, within the step's frame budget."""
        must, may = [], []  # (deadline, order, request, frames)
        streaming = 0
        for i, r in enumerate(reqs):
            pending = r.num_frames - r.frames_vocoded
            if r.status.finished:
                n = 0 if r.status.reason == "abort" else pending
                must.append((-math.inf, i, r, n))
                continue
            streaming += 1
            if pending <= 0:
                continue
            slack = r.slack(now)
            if slack is None:  # not playing yet: its first chunk as soon as it is full
                if pending >= self.first_chunk_frames(r):
                    must.append((now, i, r, pending))
            elif slack < self.horizon_s:
                must.append((now + slack, i, r, pending))
            elif pending >= self.chunk_target(r):
                may.append((now + slack, i, r, pending))
        budget = max(self.min_vocode_frames, 2 * streaming) - sum(n for *_, n in must)
        chosen = list(must)
        for item in sorted(may, key=lambda x: x[:2]):
            if item[3] > budget and chosen:
                break  # the rest have later deadlines: they go in a later step
            chosen.append(item)
            budget -= item[3]
        return [(r, n) for _, _, r, n in sorted(chosen, key=lambda x: x[:2])]
