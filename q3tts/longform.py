"""Long form: one text, split into segments (q3tts.inputs.split), spoken as one engine request per segment.

    wavs, sr = tts.generate_custom_voice(chapter, speaker="Vivian", split_granularity="sentence", pause_ms=200)

The segments are ordinary requests, so the engine decodes as many at once as it has free slots; they are
submitted as slots free up (at most `window` segments prepared and not yet handed out: memory stays bounded
whatever the length of the text), and their audio is handed out in order, with `pause_ms` of silence between
two segments. Each segment is exactly the request its text would be alone: the same voice (speaker, design
instruction, or clone prompt, which is made once), the same sampling parameters, and seed + i for segment i,
so segment i with seed + i alone gives the same audio (greedy: the same audio whatever the seed).

The streaming variants yield each segment's chunks as soon as it is that segment's turn: the chunks of later
segments wait (in their request's buffer) until the earlier ones are out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .engine.engine import AudioChunk, Engine
from .engine.request import EngineRequest, StreamOptions
from .engine.scheduler import QueueFullError
from .inputs.request import InputError, PreparedRequest
from .inputs.split import SplitStream, split_text

if TYPE_CHECKING:
    from .engine.async_engine import AsyncEngine, BlockingHandle

TTS = Any  # q3tts.api.TTS (not imported: the api imports this module)

SPLITS = ("none", "sentence", "clause")
MAX_PAUSE_MS = 10_000
_ids = itertools.count()


@dataclass(slots=True)
class LongFormOptions:
    granularity: str  # "sentence" | "clause"
    pause_ms: int = 0  # silence between two segments


def options(kwargs: dict) -> LongFormOptions | None:
    """Take split_granularity and pause_ms out of a generate_* call's kwargs -> the options, or None to speak the
    text as one request (split_granularity None or "none": the official behaviour)."""
    split = kwargs.pop("split_granularity", None)
    pause = kwargs.pop("pause_ms", None)
    return make_options(split, pause)


def make_options(split: str | None, pause_ms: int | None = None) -> LongFormOptions | None:
    """Checked options (InputError naming the argument) -> LongFormOptions, or None for one request."""
    if split is not None and (not isinstance(split, str) or split.strip().lower() not in SPLITS):
        raise InputError(f"split_granularity must be one of {list(SPLITS)} (or None), got {split!r}",
                         param="split_granularity")
    pause = 0 if pause_ms is None else pause_ms
    if isinstance(pause, bool) or not isinstance(pause, int) or not 0 <= pause <= MAX_PAUSE_MS:
        raise InputError(f"pause_ms must be an integer in [0, {MAX_PAUSE_MS}], got {pause_ms!r}", param="pause_ms")
    if split is None or split.strip().lower() == "none":
        return None
    return LongFormOptions(split.strip().lower(), pause)


def segments(text, opts: LongFormOptions, language=None, max_chars: int | None = None) -> list[str]:
    """The text's segments (InputError if it is not one non-empty str)."""
    if not isinstance(text, str):
        raise InputError("split_granularity needs one text (a str), not a batch: split each text on its own",
                         param="text")
    kw = {} if max_chars is None else {"max_chars": max_chars}
    segs = split_text(text, opts.granularity, language if isinstance(language, str) else None, **kw)
    if not segs:
        raise InputError("text is empty: there is nothing to speak", param="text")
    return segs


def first_seed(seed: int | None) -> int:
    """The seed of segment 0 (segment i uses it + i): the call's, or one drawn once for the whole text."""
    return seed if seed is not None else random.randrange(1 << 31)


class SegmentPreparer:
    """Segment i -> its PreparedRequest: `prepare(text_i, seed=seed + i, **kwargs)`, where the seed is the call's
    (or one drawn once for the whole text)."""

    def __init__(self, prepare: Callable[..., list[PreparedRequest]], texts: list[str], kwargs: dict):
        self.prepare, self.texts = prepare, texts
        self.kwargs = dict(kwargs)
        self.seed = first_seed(self.kwargs.pop("seed", None))

    def __len__(self) -> int:
        return len(self.texts)

    def __call__(self, i: int) -> PreparedRequest:
        return self.prepare(self.texts[i], seed=self.seed + i, **self.kwargs)[0]


def clone_prompt_once(tts: TTS, ref_audio, ref_text, x_vector_only_mode, voice_clone_prompt, kwargs: dict):
    """The voice-clone prompt of a split call, made once for all segments (the audio arguments leave kwargs)."""
    audio_kw = {k: kwargs.pop(k) for k in ("append_silence", "allow_urls", "allow_paths", "limits") if k in kwargs}
    if voice_clone_prompt is not None or ref_audio is None:
        return voice_clone_prompt  # (none at all: the processor names what is missing)
    tts.processor.require("base", "generate_voice_clone")
    return tts.create_voice_clone_prompt(ref_audio, ref_text, x_vector_only_mode, **audio_kw)


# --------------------------------------------------------------------------- segments through the engine's loop
def run_segments(engine: Engine, prepare: Callable[[int], PreparedRequest], num_segments: int,
                 stream: StreamOptions | None = None, window: int | None = None,
                 ) -> Iterator[tuple[int, EngineRequest, list[AudioChunk]]]:
    """Submit the segments through the engine's one loop (q3tts.engine.AsyncEngine) -> (i, its request, its new
    chunks) in segment order: offline (stream None) once per segment when it has finished, streaming whenever
    segment i (the one due) has chunks.

    Segments are added while fewer than max_slots of them are unfinished and fewer than `window` (default twice
    the slots) are unconsumed. Leaving early aborts the unfinished ones (finished when this returns)."""
    from .engine.async_engine import AsyncEngine
    driver = AsyncEngine.of(engine)
    slots = engine.scheduler.max_slots
    window = window or 2 * slots
    outputs: queue.Queue = queue.Queue()  # every segment's chunks (or finished request, or a step's exception)
    handles: dict[int, BlockingHandle] = {}
    index: dict[str, int] = {}
    buffered: dict[int, list[AudioChunk]] = {}
    ended: set[int] = set()
    submitted = due = 0
    try:
        while due < num_segments:
            while (submitted < num_segments and submitted < due + window
                   and sum(i not in ended for i in handles) < slots):
                h = driver.submit_blocking(prepare(submitted), stream, q=outputs)
                handles[submitted], index[h.request_id], buffered[submitted] = h, submitted, []
                submitted += 1
            item = handles[min(handles)].get()
            if isinstance(item, BaseException):
                raise item
            i = index[item.request_id]
            if isinstance(item, AudioChunk):
                buffered[i].append(item)
            if isinstance(item, EngineRequest) or item.is_last:
                ended.add(i)
            while due < num_segments and due in handles:
                h, out = handles[due], buffered[due]
                done = due in ended
                if stream is not None and out or done:
                    buffered[due] = []
                    yield due, h.req, out
                if not done:
                    break
                del handles[due], buffered[due], index[h.request_id]
                due += 1
    finally:
        for h in handles.values():
            h.close()


class Joiner:
    """Segment chunks -> the chunks of one long request: a pause before each segment's first audio but the first
    one's, frame indices and elapsed time counted over the whole text, one last chunk whose finish_reason is
    "length" if any segment hit a length cap (max_new_tokens, the runaway guard), else the last segment's.
    num_segments None: not known yet (a streamed text); the last chunk is then made by end() once it is."""

    def __init__(self, request_id: str, num_segments: int | None, sample_rate: int, pause_ms: int,
                 start: float | None = None):
        self.request_id, self.num_segments, self.sample_rate = request_id, num_segments, sample_rate
        self.pause = np.zeros(round(pause_ms * sample_rate / 1000), dtype=np.float32)
        self.start = time.perf_counter() if start is None else start
        self.frames = 0  # frames handed out so far
        self.segments_done = 0
        self.finish_reasons: list[str | None] = []  # per finished segment
        self._opened = -1  # the last segment whose first chunk went out

    def chunk(self, i: int, c: AudioChunk) -> AudioChunk:
        audio = c.audio
        if i != self._opened:
            self._opened = i
            if i > 0 and self.pause.size:
                audio = np.concatenate([self.pause, audio])
        last = c.is_last and self.num_segments is not None and i == self.num_segments - 1
        reason = None
        if c.is_last:
            self.segments_done += 1
            self.finish_reasons.append(c.finish_reason)
            if last:
                reason = "length" if "length" in self.finish_reasons else c.finish_reason
        out = dataclasses.replace(c, request_id=self.request_id, audio=audio, frame_index=self.frames,
                                  is_last=last, finish_reason=c.finish_reason if c.error else reason,
                                  elapsed_s=time.perf_counter() - self.start)
        self.frames += c.num_frames
        return out

    def end(self, reason: str | None = None) -> AudioChunk:
        """An empty last chunk, for a text whose end became known after its last segment's last chunk went out:
        its finish_reason is `reason`, else as chunk()'s; with no segment at all, an error."""
        error = None if self.finish_reasons or reason else "the text is empty: there is nothing to speak"
        reason = reason or ("error" if error else "length" if "length" in self.finish_reasons
                            else self.finish_reasons[-1] or "stop")
        return AudioChunk(self.request_id, np.zeros(0, np.float32), self.sample_rate, self.frames, 0, True, reason,
                          time.perf_counter() - self.start, error)

    def join(self, wavs: list[np.ndarray]) -> np.ndarray:
        """Whole segments' waveforms -> one, with the pauses."""
        parts = []
        for i, w in enumerate(wavs):
            if i and self.pause.size:
                parts.append(self.pause)
            parts.append(w)
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)


class LongFormStream:
    """The chunks of a split *_stream call, in order (an iterator); num_segments and segments_done tell progress."""

    def __init__(self, chunks: Iterator[AudioChunk], joiner: Joiner):
        self._chunks, self.joiner = chunks, joiner

    @property
    def num_segments(self) -> int:
        return self.joiner.num_segments

    @property
    def segments_done(self) -> int:
        return self.joiner.segments_done

    def __iter__(self) -> LongFormStream:
        return self

    def __next__(self) -> AudioChunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()


def generate(tts: TTS, prepare: Callable[..., list[PreparedRequest]], text, opts: LongFormOptions, kwargs: dict,
             language=None, window: int | None = None) -> tuple[list[np.ndarray], int]:
    """A split generate_* call: ([the joined waveform], sample rate). Each segment is decoded as upstream decodes
    a request (Code2Wav's chunked decode), as soon as it and those before it are done."""
    prep = SegmentPreparer(prepare, segments(text, opts, language), kwargs)
    first = prep(0)  # every argument is checked before any work
    joiner = Joiner("", len(prep), tts.sample_rate, opts.pause_ms)
    wavs = []
    for i, r, _ in run_segments(tts.engine, lambda k: first if k == 0 else prep(k), len(prep), None, window):
        if r.error:
            raise ValueError(r.error)
        wavs += tts.decode([_codes(r, tts.engine)], [r.prepared.ref_codes])
        joiner.finish_reasons.append(r.status.reason)
    return [joiner.join(wavs)], tts.sample_rate


def _codes(r: EngineRequest, engine: Engine) -> torch.Tensor:
    return torch.stack(r.frames).cpu() if r.frames else torch.zeros(0, engine.runner.K, dtype=torch.long)


def stream(tts: TTS, prepare: Callable[..., list[PreparedRequest]], text, opts: LongFormOptions, kwargs: dict,
           options: StreamOptions, language=None, window: int | None = None) -> LongFormStream:
    """A split *_stream call: the chunks of every segment in order (see LongFormStream)."""
    prep = SegmentPreparer(prepare, segments(text, opts, language), kwargs)
    first = prep(0)
    joiner = Joiner(f"long-{next(_ids)}", len(prep), tts.sample_rate, opts.pause_ms)

    def chunks() -> Iterator[AudioChunk]:
        for i, _, out in run_segments(tts.engine, lambda k: first if k == 0 else prep(k), len(prep), options, window):
            for c in out:
                if c.error:
                    raise ValueError(c.error)
                yield joiner.chunk(i, c)
    return LongFormStream(chunks(), joiner)


# --------------------------------------------------------------------------- the async engine (the server)
class AsyncSegments:
    """The server's long request: segment requests on the AsyncEngine, submitted in order by a feeder task while
    fewer than `window` (default twice the engine's slots) are submitted and not yet handed out; their chunks
    joined in order by `chunks()`. A segment that fails ends the stream with its (error) chunk; `cancel()` ends it
    with "abort" (every segment aborted); `close()` (or leaving `chunks()` early) cancels every segment.

    prepare(i) -> segment i's PreparedRequest, or None when there is none (the text ended); it may wait for the
    text (a WebSocket's streamed text: q3tts.longform.SegmentFeed). `first`: segment 0, prepared already (its
    arguments checked before an HTTP response starts). A full queue refuses segment 0 (QueueFullError, raised by
    chunks()); a later segment waits for room."""

    def __init__(self, engine: AsyncEngine, prepare: Callable[[int], Awaitable[PreparedRequest | None]],
                 joiner: Joiner, options: StreamOptions, window: int | None = None,
                 first: PreparedRequest | None = None):
        self.engine, self.prepare, self.joiner, self.options, self.first = engine, prepare, joiner, options, first
        self.window = window or 2 * engine.engine.scheduler.max_slots
        self.ready: asyncio.Queue = asyncio.Queue()  # segment indices as submitted, then None (no more) or an error
        self.live: dict[int, Any] = {}  # segment -> its RequestHandle, submitted and not yet handed out
        self.handed_out = 0  # segments whose chunks are all out
        self.room = asyncio.Event()  # set when a segment is handed out
        self.cancelled = False
        self._feeder: asyncio.Future | None = None

    async def _feed(self) -> None:
        i, n = 0, self.joiner.num_segments
        try:
            while n is None or i < n:
                while i >= self.handed_out + self.window:
                    self.room.clear()
                    await self.room.wait()
                p = self.first if i == 0 and self.first is not None else await self.prepare(i)
                if p is None or self.cancelled:
                    break
                while True:
                    try:
                        self.live[i] = self.engine.submit(p, self.options, f"{self.joiner.request_id}-{i}",
                                                          self.joiner.start)
                        break
                    except QueueFullError:  # other clients filled the queue: the first segment is refused (an
                        if i == 0:  # HTTP 503, a WebSocket error), a later one waits for room
                            raise
                        await asyncio.sleep(0.05)
                self.ready.put_nowait(i)
                i += 1
            if self.joiner.num_segments is None:
                self.joiner.num_segments = i
            self.ready.put_nowait(None)
        except Exception as e:  # (a cancellation is no Exception: the consumer has gone)
            self.ready.put_nowait(e)

    async def chunks(self) -> AsyncIterator[AudioChunk]:
        """The joined chunks, in order; a last chunk always ends them."""
        if self.cancelled:  # cancelled before its turn (a WebSocket utterance queued behind another): none submitted
            yield self.joiner.end("abort")
            return
        self._feeder = asyncio.ensure_future(self._feed())
        try:
            while (i := await self.ready.get()) is not None:
                if isinstance(i, BaseException):
                    raise i
                h = self.live[i]
                async for c in h.chunks():
                    out = self.joiner.chunk(i, c)
                    if c.is_last and c.finish_reason in ("error", "abort") and not out.is_last:
                        yield dataclasses.replace(out, is_last=True, finish_reason=c.finish_reason)
                        return
                    yield out
                    if out.is_last:
                        return
                del self.live[i]
                self.handed_out += 1
                self.room.set()
            yield self.joiner.end("abort" if self.cancelled else None)  # the text ended after its last segment
        finally:
            self.close()

    def cancel(self) -> None:
        """Abort every segment now: chunks() ends with a last chunk, finish_reason "abort"."""
        self.cancelled = True
        for h in self.live.values():
            h.cancel()
        if self._feeder is not None and self._feeder.cancel():
            self.ready.put_nowait(None)

    def close(self) -> None:
        """Cancel the feeder and every segment, dropping what they still send."""
        if self._feeder is not None:
            self._feeder.cancel()
        for h in self.live.values():
            h.close()
        self.live.clear()


def generate_async(engine: AsyncEngine, prepare: Callable[[int], Awaitable[PreparedRequest | None]],
                   joiner: Joiner, options: StreamOptions, window: int | None = None,
                   first: PreparedRequest | None = None) -> AsyncIterator[AudioChunk]:
    """A long request's joined chunks (AsyncSegments(...).chunks())."""
    return AsyncSegments(engine, prepare, joiner, options, window, first).chunks()


class SegmentFeed:
    """A streamed text's segments as they become known (a WebSocket utterance with split_granularity):
    append / close take its text (q3tts.inputs.split.SplitStream), `get(i)` (AsyncSegments' prepare) awaits
    segment i's text, or None once the text has ended before it. Segments are kept only until taken."""

    def __init__(self, granularity: str, language: str | None = None):
        self.splitter = SplitStream(granularity, language if isinstance(language, str) else None)
        self.texts: dict[int, str] = {}
        self.count = 0  # segments known so far
        self.closed = False
        self.changed = asyncio.Event()

    def _add(self, segs: list[str]) -> None:
        for s in segs:
            self.texts[self.count] = s
            self.count += 1
        if segs or self.closed:
            self.changed.set()

    def append(self, text: str) -> None:
        if not self.closed:
            self._add(self.splitter.append(text))

    def close(self) -> None:
        """The text ends (ValueError if it held nothing to speak: no segment comes)."""
        if self.closed:
            return
        self.closed = True
        self._add(self.splitter.close())
        if not self.count:
            raise ValueError("the utterance's text is empty (only whitespace): there is nothing to speak")

    async def get(self, i: int) -> str | None:
        while i >= self.count and not self.closed:
            self.changed.clear()
            await self.changed.wait()
        return self.texts.pop(i, None)
