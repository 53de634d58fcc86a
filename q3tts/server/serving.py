"""Speech serving: a validated SpeechRequest -> PreparedRequest -> AsyncEngine.generate -> encoded bytes.

The mode follows the model type:
  custom_voice  voice = a built-in speaker, instructions = style instruction (1.7B)
  voice_design  instructions = the voice in words (required); voice is ignored
  base          voice = a stored voice (id or name), or ref_audio (+ ref_text) inline
Everything that can fail on the request's content fails before the response starts (a 400), and so does
a full queue (503): the first chunk is awaited before the response is returned.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import logging
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from q3tts import longform
from q3tts.engine import (
    AsyncEngine,
    AudioChunk,
    QueueFullError,
    RequestHandle,
    StreamOptions,
    compile_counts,
    describe_counts,
)
from q3tts.inputs.align_text import WordTime, aligner_language
from q3tts.inputs.request import InputError, PreparedRequest

from .encode import HELD_BACK_S, AudioEncoder, EncoderPool, RemoteEncoder, default_encode_workers
from .metrics import Metrics
from .protocol import (
    ApiError,
    SpeechAudioDelta,
    SpeechAudioDone,
    SpeechOptions,
    SpeechRequest,
    SpeechWordTimestamps,
    Usage,
    WordTiming,
)
from .settings import ServerSettings
from .voices import VoiceService

log = logging.getLogger("q3tts.server")
# Retry-After on a 503 (queue full): a slot frees when a stream ends, and streams last seconds, so one
# second is the soonest a retry can find room; clients back off further on repeated 503s.
RETRY_AFTER_S = 1

# the library's argument names -> this API's field names
API_FIELDS = {"text": "input", "speaker": "voice", "instruct": "instructions"}


def queue_full(e: QueueFullError) -> ApiError:
    """The engine's queue is full: 503 with Retry-After."""
    return ApiError(503, str(e), type="server_busy", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})


@dataclass(slots=True)
class SpeechStream:
    request_id: str
    media_type: str
    body: AsyncIterator[bytes]  # closing it early cancels the generation
    headers: dict[str, str] = field(default_factory=dict)  # X-Q3TTS-Split, X-Finish-Reason, X-Word-Timestamps


@dataclass(slots=True)
class Run:
    """One generation's bookkeeping for metrics and usage (HTTP and WebSocket alike: SpeechServing.stream)."""

    request_id: str
    fmt: str
    arrival: float
    input_tokens: int
    frames: int = 0
    first_audio: float | None = None
    finish_reason: str | None = None  # the engine's: "stop" | "length" | "abort" | "error"
    outcome: str = "cancelled"  # until it completes or fails
    errors: list[str] = field(default_factory=list)

    def record(self, chunk: AudioChunk) -> None:
        """One chunk's frames and, for the first audible one, the time; the last one sets the outcome."""
        if chunk.num_frames and self.first_audio is None:
            self.first_audio = time.perf_counter()
        self.frames += chunk.num_frames
        if chunk.is_last:
            self.finish_reason = chunk.finish_reason
            if chunk.error:
                self.errors.append(chunk.error)
            self.outcome = {"abort": "cancelled", "error": "failed"}.get(chunk.finish_reason, "completed")

    def fail(self, e: BaseException) -> None:
        self.outcome = "failed"
        self.errors.append(f"{type(e).__name__}: {e}")


@dataclass(slots=True, eq=False)
class Generation:
    """A submitted request: its bookkeeping and its engine handle."""

    run: Run
    handle: RequestHandle | longform.AsyncSegments  # (the second: a split utterance's segments)


class SpeechServing:
    def __init__(self, tts, engine: AsyncEngine, voices: VoiceService, metrics: Metrics, settings: ServerSettings):
        self.tts, self.engine, self.voices, self.metrics, self.settings = tts, engine, voices, metrics, settings
        self.model_type = tts.cfg.tts_model_type
        self.ready = False
        self.warmup_error: str | None = None
        self.ws_clients: Counter[str] = Counter()  # client address -> its WebSocket utterances in flight
        workers = settings.encode_workers
        self.encoders = EncoderPool(default_encode_workers() if workers is None else workers)
        self.aligner = None  # q3tts.align.AlignerWorker when served with --aligner (create_app sets it)
        if settings.max_frames_per_token is not None:  # the runaway guard's default for every request
            tts.processor.max_frames_per_token = settings.max_frames_per_token

    # ------------------------------------------------------------------ request -> PreparedRequest
    async def prepare(self, req: SpeechOptions, text: str | None, voice_cache: dict | None = None) -> PreparedRequest:
        """The request's fields -> one PreparedRequest; the InputProcessor checks them (a 400 naming the field).
        text None: streamed in (prepared.text), laid out for streamed text unless non_streaming_mode is set.
        voice_cache: a dict shared by the segments of one long request: the voice is resolved (cloned) once."""
        if text is not None and len(text) > self.settings.max_text_length:
            raise ApiError(400, f"input is {len(text)} characters; this server accepts at most "
                           f"{self.settings.max_text_length} (--max-text-length)", param="input", code="input_too_long")
        kw = req.gen_kwargs()
        nsm = req.non_streaming_mode if req.non_streaming_mode is not None else (False if text is None else None)
        if nsm is not None:
            kw["non_streaming_mode"] = nsm
        instructions = (req.instructions or "").strip() or None
        voice_name = self.voices.resolve(req.voice_name)  # OpenAI's names through --voice-alias / the defaults
        proc = self.tts.processor
        try:
            proc.check_options(instructions, req.ref_audio, req.ref_text, req.x_vector_only_mode)
            if self.model_type == "custom_voice":
                return proc.custom_voice(text, voice_name, req.language, instructions, **kw)[0]
            if self.model_type == "voice_design":
                if instructions is None:
                    raise ApiError(400, "instructions is required: this server runs a VoiceDesign model, which makes "
                                   "the voice from a description, e.g. \"A warm, low female voice, speaking slowly\"",
                                   param="instructions", code="missing_instructions")
                return proc.voice_design(text, instructions, req.language, **kw)[0]

            def voice():  # the processor calls it once the language has passed: a bad one is answered before cloning
                if voice_cache is not None and "voice" in voice_cache:
                    return voice_cache["voice"]
                if voice_cache is not None:
                    voice_cache["voice"] = resolve()
                    return voice_cache["voice"]
                return resolve()

            def resolve():
                if req.ref_audio:
                    return [self.voices.inline_prompt_item(req.ref_audio, req.ref_text, req.x_vector_only_mode)]
                if voice_name:
                    return [self.voices.prompt_item(voice_name, req.x_vector_only_mode)]
                raise ApiError(400, "voice is required: this server runs a Base (voice clone) model; name a stored "
                               f"voice ({self.voices.names_hint()}) or pass ref_audio (+ ref_text)", param="voice",
                               code="missing_voice")
            if req.ref_audio:  # cloning a reference takes up to seconds of CPU: the bounded clone pool
                return (await self.voices.clones.run(lambda: proc.voice_clone(text, voice, req.language, **kw)))[0]
            # a stored voice is an index lookup (its file read once, then kept): off the event loop, but no clone's
            # place, so a burst of requests in one stored voice is not refused as a flood of clones
            return (await asyncio.to_thread(proc.voice_clone, text, voice, req.language, **kw))[0]
        except InputError as e:  # it names the library's argument: name this API's field instead
            field = API_FIELDS.get(e.param, e.param)
            msg = re.sub(rf"\b{e.param}\b", field, str(e), count=1) if e.param else str(e)
            raise ApiError(400, msg, param=field, code=e.code) from None

    def stream_options(self, fmt: str) -> StreamOptions:
        """The server's chunking, and the audio a `fmt` encoder holds back from the listener (HELD_BACK_S)."""
        s = self.settings
        return StreamOptions(s.first_chunk_frames, s.chunk_frames, held_back_s=HELD_BACK_S.get(fmt, 0.0))

    # ------------------------------------------------------------------ the one submit path
    def submit(self, prepared: PreparedRequest, fmt: str, prefix: str, arrival: float,
               stream: StreamOptions | None = None) -> Generation:
        """Queue a prepared request in the engine (HTTP and WebSocket alike). Raises ApiError: 503 + Retry-After
        when the engine's queue is full, 400 when the engine refuses it (the prompt does not fit --max-seq-len)."""
        layout = prepared.layout
        run = Run(f"{prefix}-{uuid.uuid4().hex[:16]}", fmt, arrival, len(layout) if layout is not None else 0)
        try:
            handle = self.engine.submit(prepared, stream or self.stream_options(fmt),
                                        request_id=run.request_id, arrival_time=arrival)
        except QueueFullError as e:
            raise queue_full(e) from e
        except InputError as e:
            raise ApiError(400, str(e), param="input", code=e.code) from e
        return Generation(run, handle)

    def stream(self, gen: Generation) -> AsyncIterator[AudioChunk]:
        """The generation's chunks, each recorded in its Run, which is booked when the stream ends: at the last
        chunk, on an engine failure (raised), or when the consumer closes it early (the request is aborted and
        its slot is free at the next step)."""
        return self.track(gen.run, gen.handle.chunks(), gen.handle.close)

    async def track(self, run: Run, chunks: AsyncIterator[AudioChunk], release=None) -> AsyncIterator[AudioChunk]:
        """Any chunk stream (one request's, or a long text's joined segments) recorded in run and booked once."""
        try:
            async for chunk in chunks:
                run.record(chunk)
                yield chunk
        except Exception as e:
            run.fail(e)
            raise
        finally:
            if release is not None:
                release()
            await chunks.aclose()  # a no-op after the last chunk; else it cancels what is still running
            self.book(run)

    # ------------------------------------------------------------------ HTTP generation
    async def create_speech(self, req: SpeechRequest) -> SpeechStream:
        """Validate, queue, wait for the first chunk, then hand back the byte stream.

        Raises ApiError (400 bad request, 503 queue full + Retry-After, 500 engine failure before the first
        chunk); cancelling this coroutine (client gone) aborts."""
        arrival = time.perf_counter()
        if req.word_timestamps:
            self.check_words(req.input, req.language)
        split, headers = self.split_options(req), {}
        if split is None:
            prepared = await self.prepare(req, req.input)
            gen = self.submit(prepared, req.response_format, "speech", arrival)
            run, chunks = gen.run, self.stream(gen)
        else:  # segment requests joined in order; recorded and booked as one run all the same
            run = Run(f"speech-{uuid.uuid4().hex[:16]}", req.response_format, arrival, 0)
            joined, num_segments = await self.generate_long(req, req.input, split, run)
            chunks = self.track(run, joined)
            headers["X-Q3TTS-Split"] = f"{num_segments} segments"
        # not streamed: one complete file, whose WAV / FLAC header states its length
        enc = self.encoders.open(req.response_format, self.tts.sample_rate, req.speed, whole=not req.stream)
        try:
            first = await chunks.__anext__()
        except BaseException as e:  # no response: release the encoder and the request
            enc.close()
            await chunks.aclose()
            if isinstance(e, QueueFullError):  # a long text's first segment found the queue full
                raise queue_full(e) from e
            if isinstance(e, Exception):  # an engine step failed while it held this request: ours, not the client's
                raise ApiError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error",
                               code="engine_error") from e
            raise  # cancelled (client gone)
        if req.stream_format == "sse":
            return SpeechStream(run.request_id, "text/event-stream", self._sse(run, first, chunks, enc, req), headers)
        pcm: list[np.ndarray] | None = [] if req.word_timestamps else None  # the synthesized audio, for the aligner
        body = self._encoded(run, first, chunks, enc, pcm)
        if not req.stream or pcm is not None:  # held whole: its finish reason and word times can go in headers
            try:
                data = b"".join([d async for d in body])
            finally:
                await body.aclose()  # (cancelled: the client left) every segment stops
            if run.outcome == "failed":
                raise ApiError(500, f"generation failed: {'; '.join(run.errors)}", type="server_error",
                               code="engine_error")
            headers["X-Finish-Reason"] = run.finish_reason or "stop"
            headers["Content-Length"] = str(len(data))
            if pcm is not None:
                words = await self.response_words(pcm, req)
                headers["X-Word-Timestamps"] = json.dumps([w.model_dump() for w in words], separators=(",", ":"))
            body = _once(data)
        return SpeechStream(run.request_id, enc.media_type, body, headers)

    # ------------------------------------------------------------------ long form
    def split_options(self, req: SpeechRequest) -> longform.LongFormOptions | None:
        """The request's split: its split_granularity (none: one request), or, not given, sentences for a text longer
        than --max-text-length; ApiError for a text over the limit of its kind."""
        n, st = len(req.input), self.settings
        split = self.make_split(req.split_granularity or ("sentence" if n > st.max_text_length else None), req.pause_ms)
        if split is None and n > st.max_text_length:
            raise ApiError(400, f"input is {n} characters; this server accepts at most {st.max_text_length} in one "
                           f"request (--max-text-length), or {st.max_split_text_length} split into segments: send "
                           "split_granularity \"sentence\" or leave it out", param="input", code="input_too_long")
        if split is not None and n > st.max_split_text_length:
            raise ApiError(400, f"input is {n} characters; this server splits at most {st.max_split_text_length} "
                           "(--max-split-text-length)", param="input", code="input_too_long")
        if (not req.stream or req.word_timestamps) and n > max(st.max_text_length, st.max_unstreamed_text_length):
            held = "not streamed (stream false)" if not req.stream else "with word timestamps"
            raise ApiError(400, f"input is {n} characters; a response {held} is held whole, for at most "
                           f"{st.max_unstreamed_text_length} (--max-unstreamed-text-length): stream longer texts "
                           "without word timestamps", param="input", code="input_too_long")
        return split

    async def generate_long(self, req: SpeechOptions, text: str, split: longform.LongFormOptions,
                            run: Run) -> tuple[AsyncIterator[AudioChunk], int]:
        """A long text as segment requests on the engine (q3tts.longform.generate_async): (its joined chunks, the
        number of segments). Segment i is prepared (its text tokenized; the voice is resolved once) when it is
        submitted, so memory is bounded whatever the length; with sampling it uses seed + i. Every argument is
        checked on the first segment before this returns (ApiError); closing the chunks cancels every segment.
        run.input_tokens counts the segments' prompts as they are prepared. (A WebSocket utterance's streamed
        text: generate_streamed_long.)"""
        try:
            texts = longform.segments(text, split, req.language)
        except InputError as e:
            raise ApiError(400, str(e).replace("text", "input", 1), param="input", code=e.code) from None

        async def text_of(i: int) -> str | None:
            return texts[i] if i < len(texts) else None
        prepare = self._segment_preparer(req, text_of, run)
        first = await prepare(0)
        joiner = longform.Joiner(run.request_id, len(texts), self.tts.sample_rate, split.pause_ms, run.arrival)
        options = self.stream_options(run.fmt)
        return longform.generate_async(self.engine, prepare, joiner, options, first=first), len(texts)

    def generate_streamed_long(self, req: SpeechOptions, split: longform.LongFormOptions, prefix: str, arrival: float,
                               options: StreamOptions) -> tuple[longform.SegmentFeed, Generation]:
        """A streamed text (a WebSocket utterance) spoken as segment requests: (the feed its text goes into, the
        generation whose handle is the segments' longform.AsyncSegments: chunks / cancel / close). Each segment is
        submitted once its end is known in the text (q3tts.inputs.split.SplitStream), the rest at the feed's
        close; otherwise as generate_long (the same voice, seed + i, at most a window of segments at once)."""
        run = Run(f"{prefix}-{uuid.uuid4().hex[:16]}", "pcm", arrival, 0)
        feed = longform.SegmentFeed(split.granularity, req.language)
        joiner = longform.Joiner(run.request_id, None, self.tts.sample_rate, split.pause_ms, arrival)
        segments = longform.AsyncSegments(self.engine, self._segment_preparer(req, feed.get, run), joiner, options)
        return feed, Generation(run, segments)

    def _segment_preparer(self, req: SpeechOptions, text_of, run: Run):
        """prepare(i) for the segments of one long request: segment i's text (awaited from text_of(i); None: there
        is none) prepared with seed + i, the voice resolved once; its prompt counted in run.input_tokens."""
        seed = longform.first_seed(req.seed)
        cache: dict = {}

        async def prepare(i: int) -> PreparedRequest | None:
            text = await text_of(i)
            if text is None:
                return None
            p = await self.prepare(req.model_copy(update={"seed": seed + i}), text, cache)
            run.input_tokens += len(p.layout)
            return p
        return prepare

    @staticmethod
    def make_split(split_granularity: str | None, pause_ms: int | None = None) -> longform.LongFormOptions | None:
        """Checked long-form options (ApiError 400 naming the field), or None for one request."""
        try:
            return longform.make_options(split_granularity, pause_ms)
        except InputError as e:
            raise ApiError(400, str(e), param=e.param) from None

    async def _encoded(self, run: Run, first: AudioChunk, chunks: AsyncIterator[AudioChunk],
                       enc: AudioEncoder | RemoteEncoder, pcm: list[np.ndarray] | None = None) -> AsyncIterator[bytes]:
        """Encoded bytes as chunks arrive, then the encoder's tail (the run is booked by self.stream)."""
        try:
            chunk = first
            while True:
                if pcm is not None:  # the synthesized audio, kept for the aligner
                    pcm.append(chunk.audio)
                data = await enc.aencode(chunk.audio)
                if data:
                    yield data
                if chunk.is_last:
                    break
                chunk = await chunks.__anext__()
            tail = await enc.afinish()
            if tail:
                yield tail
        except Exception as e:  # engine failure mid-stream: the response is already started
            if run.outcome != "failed":
                run.fail(e)
            log.exception("%s failed mid-stream", run.request_id)
        finally:
            enc.close()
            await chunks.aclose()  # a no-op after the last chunk; else aborts the request and frees its slot

    async def _sse(self, run, first, chunks, enc, req: SpeechRequest) -> AsyncIterator[bytes]:
        pcm: list[np.ndarray] | None = [] if req.word_timestamps else None
        gen = self._encoded(run, first, chunks, enc, pcm)
        try:
            async for data in gen:
                yield _sse_event(SpeechAudioDelta(audio=base64.b64encode(data).decode()))
        finally:
            await gen.aclose()
        if pcm is not None and run.outcome == "completed":
            words = await self.response_words(pcm, req)
            yield _sse_event(SpeechWordTimestamps(words=words))
        if run.outcome != "cancelled":
            out = run.frames
            yield _sse_event(SpeechAudioDone(usage=Usage(input_tokens=run.input_tokens, output_tokens=out,
                                                         total_tokens=run.input_tokens + out),
                                             finish_reason=run.finish_reason, audio_seconds=round(enc.seconds_out, 4)))

    # ------------------------------------------------------------------ word timestamps
    def check_words(self, text: str | None, language: str | None) -> None:
        """A 400 before any work when word timestamps cannot be made: no aligner, or a language it cannot split
        (text None: a streamed text, its language only)."""
        if self.aligner is None:
            raise ApiError(400, "word_timestamps needs a forced aligner: start the server with "
                           "`q3tts serve --aligner Qwen/Qwen3-ForcedAligner-0.6B` (or a local directory)",
                           param="word_timestamps", code="aligner_not_loaded")
        try:
            self.aligner.aligner.words(text if text and text.strip() else "a", aligner_language(language))
        except ValueError as e:
            raise ApiError(400, f"word_timestamps: {e}", param="language", code="unsupported_language") from None

    async def utterance_words(self, audio: np.ndarray, sample_rate: int, text: str,
                              language: str | None) -> list[WordTime]:
        """The words of one utterance's complete audio (float32 PCM as the engine made it), in seconds from its
        start; [] when the text has no word. Batched with other callers' on the aligner's thread (never on the
        event loop or the engine's). For the WebSocket session: LiveKit's `audio.done.timestamp_info.
        word_alignment` is livekit_alignment(words), vLLM-Omni's trailing `audio.chunk` carries words_ms(words)."""
        if not text or not text.strip() or audio.size < 2 * 160 * sample_rate // 16000:
            return []
        return await self.aligner.align(audio, sample_rate, text, aligner_language(language))

    async def response_words(self, pcm: list[np.ndarray], req: SpeechRequest) -> list[WordTiming]:
        """The response's words in ms; its speed (WSOLA tempo) scales the synthesized audio's times."""
        audio = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
        words = await self.utterance_words(audio, self.tts.sample_rate, req.input, req.language)
        return words_ms(words, req.speed)

    def book(self, run: Run) -> None:
        m = self.metrics
        m.speech.labels(run.outcome, run.fmt).inc()
        seconds = run.frames * self.tts.samples_per_frame / self.tts.sample_rate
        m.audio_seconds.inc(seconds)
        if run.first_audio is not None:
            m.ttfa.observe(run.first_audio - run.arrival)
        if run.outcome == "completed" and seconds > 0:
            m.rtf.observe((time.perf_counter() - run.arrival) / seconds)
        if run.errors:
            log.warning("%s: %s", run.request_id, "; ".join(run.errors))

    # ------------------------------------------------------------------ warm-up
    async def warmup(self) -> None:
        """One short request through the whole path (prefill, decode, vocoder); then ready."""
        t0, counts = time.perf_counter(), compile_counts()
        try:
            async for _ in self.engine.generate(self.tts.warmup_request(), StreamOptions(1, 4), request_id="warmup"):
                pass
        except Exception as e:  # (a cancellation is no Exception: it goes through)
            self.warmup_error = f"{type(e).__name__}: {e}"
            log.exception("warm-up failed")
            return
        freeze_heap()
        self.ready = True
        self.metrics.ready.set(1)
        log.info("warm-up done in %.2f s (%s): ready", time.perf_counter() - t0, describe_counts(counts))


GC_SLOW_S = 0.02  # a cycle collection at least this long is logged: every stream's step waits for it (the GIL)


def freeze_heap() -> int:
    """Once start-up's objects exist (modules, weights' wrappers, compiled functions, graphs: a few hundred thousand
    objects): one collection, then every survivor moved to the permanent generation (gc.freeze), so that a full
    collection while serving scans only what serving made since, not the whole heap. A full collection holds the
    interpreter, and so every stream's step and sent chunk, for as long as it scans. Collections that still take
    GC_SLOW_S or more are logged (installed once per process). Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    if _log_slow_collections not in gc.callbacks:
        gc.callbacks.append(_log_slow_collections)
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """freeze_heap undone at shutdown: what the server leaves behind is collectable again, and no longer logged."""
    gc.unfreeze()
    if _log_slow_collections in gc.callbacks:
        gc.callbacks.remove(_log_slow_collections)


_gc_started = [0.0]


def _log_slow_collections(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    elif (dt := time.perf_counter() - _gc_started[0]) >= GC_SLOW_S:
        log.warning("cycle collection of generation %d took %.0f ms (%d collected)", info["generation"], dt * 1e3,
                    info["collected"])


def words_ms(words: list[WordTime], speed: float = 1.0) -> list[WordTiming]:
    """vLLM-Omni's form: [{word, start_ms, end_ms}] (times divided by the tempo factor)."""
    return [WordTiming(word=w.word, start_ms=round(w.start_s * 1000 / speed), end_ms=round(w.end_s * 1000 / speed))
            for w in words]


def livekit_alignment(words: list[WordTime]) -> dict:
    """LiveKit's `timestamp_info.word_alignment`: parallel lists, seconds from the utterance's start."""
    return {"words": [w.word for w in words], "word_start_times_seconds": [w.start_s for w in words],
            "word_end_times_seconds": [w.end_s for w in words]}


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _sse_event(event) -> bytes:
    return f"data: {json.dumps(event.model_dump(), separators=(',', ':'))}\n\n".encode()
