"""Deadline-aware streaming, pure Python: which chunks to vocode now, how large a first chunk, how many newcomers.

Every streaming request keeps a playback clock: a listener starts playing at its first chunk, so at time t it has
played (t - first_sent_at) s of its audio_sent_s s. Its slack = audio_sent_s - held_back_s - (t - first_sent_at) is
how long the engine may leave it without a new chunk before its listener stalls (held_back_s: what the listener's
encoder keeps of the sent audio, StreamOptions). A step costs

    text (streamed text to its rows) + prefill (its newcomers) + frame (every running row) + vocode (the chunks due)

and the engine measures each part as a moving average (`StepTimes`). The policy (`DeadlinePolicy`):
  - vocode: a stream's audio is cut into its StreamOptions chunks (first_chunk_frames doubling up to chunk_frames)
    whatever the timing (`chunk_cut`); the policy chooses when whole chunks go, never where they end, so the
    vocoder decodes the same pieces and the audio keeps its bits under any load. A row whose slack would run out
    before the next step's chunks come (slack < horizon: two steps, a newcomer's prefill and a margin) goes now
    with all its whole chunks; the others go nearest deadline first within a frame budget per step, so when many
    chunks fall due in one step, those that can wait go in the next steps instead of lengthening this one;
  - first chunk: the first audio waits until its whole chunks outlast the steps until its next chunk is whole and two
    prefills (the first chunk alone while steps are short), so a young stream does not hold the next newcomers back
    (admission counts those steps too: a one-frame first send whose two-frame chunk takes two long steps leaves no
    room for any prefill); while requests queue, the prefill of the next wave instead (burst_wave), so a burst goes
    in a few large waves (max_wave a step), the cheapest per newcomer, rather than a few newcomers a step;
  - admission: a prefill delays every running row by its time, so a step's wave of newcomers is the largest whose
    estimated prefill fits into every playing row's slack less the steps until its next whole chunk and the margin
    (`admission_budget`, `wave`): the first goes whenever no row is at risk (one newcomer's prefill would not stall
    any), and a request that has waited max_wait_s goes anyway (nothing starves). The estimate (`PrefillCost`)
    follows the runner's two regimes: up to its alone_max newcomers one prefill graph replay each (N x one), more in
    one batched forward (a + b * N: a launch-bound floor, then a small part per newcomer). Between them lies an
    expensive middle (a wave just past alone_max pays the whole floor for a few more newcomers), so a wave is at most
    alone_max or at least min_batch_wave newcomers, unless those that waited max_wait_s make it one in between.
Rows that cannot run (streamed text not yet there) and offline requests have no deadline the engine can keep and
constrain nothing. Scheduling order never changes a row's codes (sampling noise is per request, frame, codebook).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import EngineRequest, StreamOptions

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
class LineFit:
    """t = a + b * N, fitted by exponentially weighted least squares over (N, t) samples."""

    alpha: float = 0.1  # weight of a new sample
    samples: int = 0
    n: float = 0.0  # weighted means of N, N^2, t, N * t
    nn: float = 0.0
    t: float = 0.0
    nt: float = 0.0

    def add(self, N: int, t: float) -> None:
        w = 1.0 if self.samples == 0 else self.alpha
        self.n, self.nn = self.n + w * (N - self.n), self.nn + w * (N * N - self.nn)
        self.t, self.nt = self.t + w * (t - self.t), self.nt + w * (N * t - self.nt)
        self.samples += 1

    def per_newcomer(self, N: int) -> float:
        """N times the samples' (weighted) time per newcomer: a line through 0."""
        return N * self.t / self.n

    def line(self, N: int) -> float:
        """a + b * N (a, b >= 0). With too little spread in N to fit a line, the most any such line through the
        samples' mean allows: all of it fixed below their N (a few newcomers cost no less), per newcomer above."""
        var = self.nn - self.n * self.n
        if var < 0.25:
            return max(self.t, self.per_newcomer(N))
        b = max(0.0, (self.nt - self.n * self.t) / var)
        a = max(0.0, self.t - b * self.n)
        return a + b * N


@dataclass(slots=True)
class PrefillCost:
    """The prefill time of a step's N newcomers in the runner's two regimes (ModelRunner.prefill_alone_max):
    up to alone_max newcomers each is prefilled alone, one graph replay after another: N x one, learnt per newcomer
    (`alone`); more go in one batched forward, with a fixed part (a launch-bound floor): a + b * N (`batched`). A
    regime without a sample yet is estimated by the other's fit. alone_max 0 (no replays: CPU, paged cache): one
    line for every N."""

    alone_max: float = 0  # set by the engine from its runner (inf: every wave alone)
    alone: LineFit = field(default_factory=LineFit)  # samples of waves of at most alone_max newcomers
    batched: LineFit = field(default_factory=LineFit)  # the larger waves

    @property
    def samples(self) -> int:
        return self.alone.samples + self.batched.samples

    def add(self, N: int, t: float) -> None:
        """One step's prefill of N newcomers took t s (its regime: N <= alone_max)."""
        (self.alone if N <= self.alone_max else self.batched).add(N, t)

    def estimate(self, N: int) -> float:
        """Seconds to prefill N newcomers (0.0 before any sample)."""
        if self.samples == 0 or N == 0:
            return 0.0
        if N <= self.alone_max:
            return self.alone.per_newcomer(N) if self.alone.samples else self.batched.line(N)
        return self.batched.line(N) if self.batched.samples else self.alone.per_newcomer(N)


@dataclass(slots=True)
class StepTimes:
    """The engine's measured costs (seconds), updated after every step."""

    frame: MovingAverage = field(default_factory=MovingAverage)  # one frame of every running row
    vocode: MovingAverage = field(default_factory=MovingAverage)  # a step's vocoding, in steps that vocode
    prefill: PrefillCost = field(default_factory=PrefillCost)  # a step's admission of N newcomers
    text: MovingAverage = field(default_factory=MovingAverage)  # a step's streamed text handed to its rows

    @property
    def step_s(self) -> float:
        """A step without newcomers: its text, its frame and its chunks."""
        return self.text.value + self.frame.value + self.vocode.value

    def record(self, prefill_s: float, admitted: int, frame_s: float | None, vocode_s: float | None,
               text_s: float | None = None) -> None:
        """One step's measured phases: prefill_s for `admitted` newcomers (its regime by prefill.alone_max);
        frame_s None if no row ran; vocode_s None if nothing was vocoded; text_s: its streamed text's feed (every
        step's, 0 without streamed text: a cost of the step like its frame, not of its newcomers)."""
        if admitted:
            self.prefill.add(admitted, prefill_s)
        if frame_s is not None:
            self.frame.add(frame_s)
        if vocode_s is not None:
            self.vocode.add(vocode_s)
        if text_s is not None:
            self.text.add(text_s)


ENV = "Q3TTS_DEADLINE"  # the policy on (one of ON) or off (one of OFF); unset or empty: the device's default
ON, OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def wanted(environ, device_type: str) -> bool:
    """Whether $Q3TTS_DEADLINE asks for the policy; unset: on for a CUDA engine, off on a CPU (an engine slower than
    real time keeps no stream ahead, and there the policy would hold a first send back until its whole chunks reach
    the largest chunk's frames); ValueError naming the accepted values for anything else."""
    raw = environ.get(ENV, "").strip().lower()
    if raw == "":
        return device_type == "cuda"
    if raw in ON:
        return True
    if raw in OFF:
        return False
    raise ValueError(f"${ENV}={environ[ENV]!r}: expected one of {', '.join(ON)} (the policy on) or "
                     f"{', '.join(OFF)} (off); unset: on for CUDA, off on a CPU")


# $Q3TTS_DEADLINE_<NAME>: DeadlinePolicy's field, the value's unit and its least value (an unset variable: the default)
DEADLINE_ENV = {"MARGIN_MS": ("margin_s", 1e-3, 0.0), "MAX_WAIT_MS": ("max_wait_s", 1e-3, 0.0),
                "MIN_VOCODE_FRAMES": ("min_vocode_frames", 1, 1),
                "FIRST_CHUNK_PREFILLS": ("first_chunk_prefills", 1, 0.0),
                "BURST_WAVE": ("burst_wave", 1, 0), "PREFILL_CAP": ("prefill_cap", 1, 1.0),
                "MIN_BATCH_WAVE": ("min_batch_wave", 1, 0), "MAX_WAVE": ("max_wave", 1, 0),
                "COVER_NEXT_CHUNK": ("cover_next_chunk", 1, 0)}


@dataclass(slots=True)
class DeadlinePolicy:
    """Args:
        margin_s: safety added to every estimate (the delivery to the client, a step longer than its average).
        max_wait_s: a ready request waiting this long is admitted even while rows are at risk.
        min_vocode_frames: the per-step frame budget of chunks that could wait is max(this, 2 x streaming rows):
            twice what the rows make per step, so a backlog drains.
        first_chunk_prefills: the prefills (of one newcomer) a first send covers while the engine is contended.
        burst_wave: > 0: while requests wait for admission, a first send covers instead the prefill of the next
            wave, min(waiting, burst_wave) newcomers (as `wave` would size it), so the young rows' slack lets that
            wave in at once rather than a few newcomers per step (0: off).
        prefill_cap: a step's measured prefill enters the estimate as at most this many times the estimate for its
            newcomers (inf: as measured), so one slow step (the GIL held by a burst of requests arriving) does
            not hold admission back for the many steps the average takes to forget it.
        min_batch_wave: where the runner replays prefill graphs (PrefillCost.alone_max >= 1), a wave larger than
            alone_max has at least this many newcomers (the batched forward's floor is paid for enough of them);
            from alone_max + 1 to here a wave goes only as far as max_wait_s forces it (<= alone_max + 1: no gap).
        max_wave: the most newcomers of one step (0: the scheduler's max_prefills_per_step): with burst_wave, a
            burst goes in a few large waves, the cheapest per newcomer.
        cover_next_chunk: 1: a first send's audio outlasts the steps until the stream's next chunk is whole (as
            admission_budget counts them), its prefills and the margin; 0: one step, its prefills and the margin.
    """

    margin_s: float = 0.02
    max_wait_s: float = 1.0
    min_vocode_frames: int = 64
    first_chunk_prefills: float = 2.0
    burst_wave: int = 64
    prefill_cap: float = math.inf
    min_batch_wave: int = 16
    max_wave: int = 64
    cover_next_chunk: int = 1
    times: StepTimes = field(default_factory=StepTimes)

    @classmethod
    def from_env(cls, environ) -> DeadlinePolicy:
        """A policy with the fields that $Q3TTS_DEADLINE_<NAME> variables set (DEADLINE_ENV); ValueError
        naming the variable for a value that is not a number of its kind or is below its least value."""
        fields = {}
        for name, (attr, unit, least) in DEADLINE_ENV.items():
            raw = environ.get(f"Q3TTS_DEADLINE_{name}")
            if raw is None or raw.strip() == "":
                continue
            kind = int if isinstance(least, int) else float
            try:
                value = kind(raw)
            except ValueError:
                value = None
            if value is None or value != value or value < least:  # (value != value: nan)
                what = "an integer" if kind is int else "a number"
                raise ValueError(f"$Q3TTS_DEADLINE_{name}={raw!r}: expected {what} >= {least}")
            fields[attr] = value * unit
        return cls(**fields)

    def record(self, prefill_s: float, admitted: int, frame_s: float | None, vocode_s: float | None,
               alone_max: float | None = None, text_s: float | None = None) -> None:
        """One step's measured phases into `times` (StepTimes.record), the prefill capped by prefill_cap.
        alone_max: the runner's (ModelRunner.prefill_alone_max): the regime of this and later estimates."""
        if alone_max is not None:
            self.times.prefill.alone_max = alone_max
        if admitted and self.times.prefill.samples and math.isfinite(self.prefill_cap):
            prefill_s = min(prefill_s, self.prefill_cap * self.times.prefill.estimate(admitted))
        self.times.record(prefill_s, admitted, frame_s, vocode_s, text_s)

    @property
    def horizon_s(self) -> float:
        """A row with less slack than this (after its frame) may run dry before the next step's chunks come (that
        step may prefill a newcomer)."""
        return 2 * self.times.step_s + self.times.prefill.estimate(1) + self.margin_s

    def first_chunk_frames(self, req: EngineRequest, contended: bool = True, waiting: int = 0) -> int:
        """The least audio (frames) of req's first send: enough to cover the steps until its next chunk is whole
        (cover_next_chunk; else the next step) and, while other requests share the engine (`contended`),
        first_chunk_prefills prefills, or with burst_wave and `waiting` requests queued the next wave's prefill; at
        least its first chunk, at most its largest. The audio its listener's encoder holds back
        (StreamOptions.held_back_s) does not count: a player has only what came out of the encoder."""
        s = req.stream
        if self.burst_wave > 0 and waiting > 0:
            prefills = self.times.prefill.estimate(self.wave(min(waiting, self.burst_wave), 0, math.inf))
        else:
            prefills = self.first_chunk_prefills * self.times.prefill.estimate(1) if contended else 0.0
        if not self.cover_next_chunk:
            need = math.ceil((self.times.step_s + prefills + self.margin_s + s.held_back_s) / FRAME_S)
            return max(s.first_chunk_frames, min(s.chunk_frames, need))
        # whole chunks whose audio outlasts the steps until the next one is whole (admission_budget's count)
        sent = 0
        while sent < s.chunk_frames:
            sent += chunk_size_at(s, sent)
            if sent * FRAME_S - s.held_back_s >= chunk_size_at(s, sent) * self.times.step_s + prefills + self.margin_s:
                break
        return min(s.chunk_frames, sent)

    # ------------------------------------------------------------------ admission
    def admission_budget(self, running: list[EngineRequest], now: float) -> float:
        """Seconds of prefill this step can take without a playing row stalling: over the rows that play and can
        run, the smallest slack less the steps until its next whole chunk can go (this one if it has one, else one
        per missing frame) and the margin (inf with none; < 0: a row is at risk)."""
        budgets = [r.slack(now) - steps_to_chunk(r) * self.times.step_s - self.margin_s
                   for r in running if r.can_run and r.first_sent_at is not None]
        return min(budgets) if budgets else math.inf

    def waited(self, req: EngineRequest, now: float) -> bool:
        """Whether req has waited max_wait_s: it goes, whatever the others' slack."""
        # (the wait runs from when its prompt was ready: a long text's later segment or a streamed text's request
        # may be queued long after its arrival_time)
        return now - (req.arrival_time if req.ready_at is None else req.ready_at) >= self.max_wait_s

    def in_gap(self, n: int) -> bool:
        """Whether a wave of n newcomers lies in the expensive middle: past the runner's replays (alone_max >= 1),
        short of min_batch_wave."""
        alone_max = self.times.prefill.alone_max
        return 1 <= alone_max < n < self.min_batch_wave

    def wave(self, candidates: int, forced: int, budget: float) -> int:
        """How many of `candidates` newcomers (first come, first served; the first `forced` of them include every
        one that waited max_wait_s) go this step: the most whose estimated prefill fits `budget` (seconds), a wave
        in the gap (`in_gap`) never, then at least `forced`."""
        # NOTE(first): with no row at risk (budget >= 0) and nothing measured yet, the estimate is 0: the first goes
        best = 0
        for n in range(1, candidates + 1):  # (the cost is not monotone across the regimes: every n is tried)
            if not self.in_gap(n) and self.times.prefill.estimate(n) <= budget:
                best = n
        return max(best, forced)

    # ------------------------------------------------------------------ vocoding
    def plan_chunks(self, reqs: list[EngineRequest], now: float,
                    waiting: int = 0) -> list[tuple[EngineRequest, int]]:
        """The chunks to vocode now, as (request, frames), nearest deadline first; frames are whole StreamOptions
        chunks (`whole_chunks`). A finished request's remainder always goes (n may be 0: its empty last chunk;
        nothing for a cancelled one); a row not yet playing goes once its whole chunks reach its first chunk's
        frames; a playing row with whole chunks goes when its slack is under the horizon, else within the step's
        frame budget. waiting: requests queued for a slot, their prompts ready (with them or other rows, first chunks
        grow by load)."""
        must, may = [], []  # (deadline, order, request, frames)
        contended = waiting > 0 or sum(not r.status.finished for r in reqs) > 1
        streaming = 0
        for i, r in enumerate(reqs):
            pending = r.num_frames - r.frames_vocoded
            if r.status.finished:
                n = 0 if r.status.reason == "abort" else pending
                must.append((-math.inf, i, r, n))
                continue
            streaming += 1
            n = sum(whole_chunks(r.stream, r.frames_vocoded, pending))
            if n == 0:
                continue
            slack = r.slack(now)
            if slack is None:  # not playing yet: its first audio as soon as it is long enough (or its text stalls it)
                if n >= self.first_chunk_frames(r, contended, waiting) or not r.can_run:
                    must.append((now, i, r, n))
            elif slack < self.horizon_s:
                must.append((now + slack, i, r, n))
            else:
                may.append((now + slack, i, r, n))
        budget = max(self.min_vocode_frames, 2 * streaming) - sum(n for *_, n in must)
        chosen = list(must)
        for item in sorted(may, key=lambda x: x[:2]):
            if item[3] > budget and chosen:
                break  # the rest have later deadlines: they go in a later step
            chosen.append(item)
            budget -= item[3]
        return [(r, n) for _, _, r, n in sorted(chosen, key=lambda x: x[:2])]


def steps_to_chunk(req: EngineRequest) -> int:
    """Steps (frames) until req has a whole chunk to send: 1 if it has one now (it goes at this step's end)."""
    pending = req.num_frames - req.frames_vocoded
    return max(1, chunk_size_at(req.stream, req.frames_vocoded) - pending)


def chunk_size_at(stream: StreamOptions, start: int) -> int:
    """Frames of the stream's chunk that begins at frame `start` (a chunk boundary): first_chunk_frames, doubling
    up to chunk_frames, then chunk_frames."""
    size, at = stream.first_chunk_frames, 0
    while at + size <= start and size < stream.chunk_frames:
        at, size = at + size, size << 1
    return min(size, stream.chunk_frames)


def whole_chunks(stream: StreamOptions, start: int, pending: int) -> list[int]:
    """Sizes of the whole chunks among `pending` frames from boundary `start`."""
    out = []
    while pending >= (n := chunk_size_at(stream, start)):
        out.append(n)
        start, pending = start + n, pending - n
    return out


def chunk_cut(stream: StreamOptions, start: int, n: int) -> list[int]:
    """n frames from boundary `start` as the stream's chunks: its whole chunks, then what is left (a last chunk)."""
    whole = whole_chunks(stream, start, n)
    rest = n - sum(whole)
    return whole + [rest] if rest else whole


def full_chunks(reqs: list[EngineRequest]) -> list[tuple[EngineRequest, int]]:
    """Without a policy: (request, frames) of every full chunk (StreamOptions' sizes) while running and of every
    finished request's remainder (nothing more for a cancelled one), in the given order."""
    plan = []
    for r in reqs:
        last = r.status.finished
        if r.status.reason == "abort":
            n = 0
        else:
            pending = r.num_frames - r.frames_vocoded
            n = pending if last else (whole_chunks(r.stream, r.frames_vocoded, pending)[:1] or [0])[0]
        if n > 0 or last:
            plan.append((r, n))
    return plan
