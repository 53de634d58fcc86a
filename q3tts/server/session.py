"""WebSocket speech sessions: text in as it is written (an LLM's tokens), PCM out as it is made.

    GET /v1/audio/speech/stream   (vLLM-Omni's protocol, as LiveKit's Qwen3-TTS client speaks it)
    client  {"type": "session.config", ...}   the /v1/audio/speech fields but input, plus vLLM-Omni's task_type,
                                              response_format, stream_audio, speed, initial_codec_chunk_frames,
                                              split_granularity + pause_ms, timestamp_type "word" (--aligner:
                                              words in audio.done's timestamp_info), word_timestamps (--aligner:
                                              vLLM-Omni's audio.chunk form) (any time; kept until the next one)
            {"type": "input.text", "text": "..."}   any number, split anywhere
            {"type": "input.done"}                  a flush: the utterance's text ends; its audio, then session.done
            {"type": "response.cancel"}             ends the current utterance now
            {"type": "voice.add", name, audio_data, ref_text?, consent?, audio_format?}   Base: clone a voice
            {"type": "voice.list"}
            {"type": "session.close"}               speaks what was given, then ends the session
    server  {"type": "audio.start", "sample_rate": 24000, "format": "pcm_s16le"}, binary PCM s16le messages,
            with word_timestamps the PCM comes in {"type": "audio.chunk", "audio_b64": ..., "timestamps": null, ...}
            messages instead, then one with "audio_b64": "" and "timestamps": [{word, start_ms, end_ms}] (ChunkForm);
            {"type": "audio.done", "frames": N, "finish_reason": "stop" | "length" | "cancelled" | "error"},
            {"type": "session.done"} after each flush (at once for an empty one) and at the end;
            {"type": "voice.list", "voices": [...], "uploaded_voices": [...]}, {"type": "voice.add", "success": true,
            "voice": {...}}; {"type": "error", "code": ..., "message": ...} for a bad message (the session stays
            usable; queue_full errors add "limit": "session" | "client" | "server").

Each utterance is one engine request whose text is appendable (q3tts.inputs.text): its first text starts
it, so it is generated while the utterance before it is still being sent; audio goes out in order. With
split_granularity sentence | clause an utterance is the long-form path's segment requests instead
(q3tts.longform.AsyncSegments, SegmentFeed): each sentence (clause) is submitted once the text after it shows
where it ends, the rest at the flush; they run in parallel and are joined in order with pause_ms between them.
Limits (ServerSettings.ws_*): a new socket's first message within ws_config_timeout, then at most
ws_idle_timeout without a client message while no audio goes out (the session ends, its slots free); at most
ws_max_utterances in flight per session and ws_max_client_utterances per client address. A client that
disconnects cancels its utterances at once (their slots are free at the next step).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field

import numpy as np
from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from q3tts.audio import to_s16
from q3tts.engine import QueueFullError, StreamOptions
from q3tts.inputs.text import TextStream
from q3tts.longform import SegmentFeed

from .protocol import ApiError, SessionConfig, VoiceAddMessage, WordTiming
from .serving import Generation, livekit_alignment, words_ms

log = logging.getLogger("q3tts.server")
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error"}
TASK_TYPES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
MAX_DEPTH = 16  # nesting levels of a client message (the protocol needs 2)
SUBPROTOCOL = "q3tts"  # the page's WebSocket subprotocol (its API key rides in a second one: middleware.py)


@dataclass(eq=False)
class Utterance:
    text: TextStream | SegmentFeed  # (the second: split_granularity sentence | clause)
    gen: Generation
    client: str
    index: int  # the session's utterances, from 0 (vLLM-Omni's utterance_index)
    chars: int = 0
    said: list[str] = field(default_factory=list)  # its text as given (the aligner's words come from it)


FLUSH = object()  # outbox marker: session.done for a flush, once everything before it is sent
REFUSED = object()  # the open utterance was refused at its first text: its later text is dropped


class SpeechSession:
    def __init__(self, serving, ws: WebSocket):
        self.serving, self.ws = serving, ws
        self.config = SessionConfig(type="session.config")
        self.configured = False
        self.current: Utterance | object | None = None  # the utterance whose text is still open (or REFUSED)
        self.outbox: asyncio.Queue[Utterance | object | None] = asyncio.Queue()  # to send, in order; None: end
        self.live: list[Utterance] = []  # started and not yet fully sent, oldest first
        self.client = ws.client.host if ws.client else "?"
        self.last_activity = time.monotonic()  # the last client message or audio sent
        self.num_utterances = 0

    async def run(self) -> None:
        offered = self.ws.scope.get("subprotocols") or []
        await self.ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        sender = asyncio.ensure_future(self._send_all())
        closing = False
        try:
            while not closing:
                try:
                    msg = await asyncio.wait_for(self.ws.receive(), timeout=max(0.0, self._time_left()))
                except asyncio.TimeoutError:
                    if self._time_left() <= 0:
                        await self._idle_close()
                        break
                    continue
                if msg["type"] == "websocket.disconnect":
                    break
                self.last_activity = time.monotonic()
                closing = await self._handle(msg)
            if closing:
                self._close_text()
                await self.outbox.put(None)
                await sender  # speak what was given, then session.done
                await self._send_json({"type": "session.done"})
                await self.ws.close()
        except WebSocketDisconnect:
            pass
        finally:
            sender.cancel()
            for utt in list(self.live):  # gone: free every slot of this session now
                self._forget(utt)

    def _time_left(self) -> float:
        """Seconds until the idle limit; it does not run while the server owes audio (a flushed utterance)."""
        s = self.serving.settings
        limit = s.ws_idle_timeout if self.configured else s.ws_config_timeout
        if any(u is not self.current for u in self.live):
            self.last_activity = time.monotonic()
        return limit - (time.monotonic() - self.last_activity)

    async def _idle_close(self) -> None:
        s = self.serving.settings
        which = (f"no message for {s.ws_idle_timeout:g} s (--ws-idle-timeout)" if self.configured else
                 f"no session.config within {s.ws_config_timeout:g} s (--ws-config-timeout)")
        await self._error("idle_timeout", f"session ended: {which}")
        await self.ws.close(code=1000, reason="idle timeout")

    # ------------------------------------------------------------------ messages in
    async def _handle(self, msg: dict) -> bool:
        """One client message; True when the session is to close."""
        if msg.get("text") is None:
            return await self._error("invalid_message", "binary messages are not accepted: send JSON text messages")
        try:
            data = json.loads(msg["text"])
        except RecursionError:
            return await self._error("invalid_message", "the message is nested too deeply: send flat JSON objects")
        except ValueError as e:
            return await self._error("invalid_json", f"a message must be a JSON object: {e}")
        problem = _check_value(data)
        if problem:
            return await self._error("invalid_message", problem)
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "session.config":
            await self._configure(data)
        elif kind == "input.text":
            text = data.get("text")
            if not isinstance(text, str):
                return await self._error("invalid_message", 'input.text needs "text": a string')
            await self._add_text(text)
        elif kind == "input.done":
            self._close_text()
            self.outbox.put_nowait(FLUSH)
        elif kind == "response.cancel":
            utt = self.current if isinstance(self.current, Utterance) else next(iter(self.live), None)
            self.current = None  # the open one, else the one being spoken
            if utt is not None:
                utt.gen.handle.cancel()
        elif kind == "voice.list":
            await self._send_json(self._voice_list())
        elif kind == "voice.add":
            await self._voice_add(data)
        elif kind == "session.close":
            return True
        else:
            return await self._error("unknown_type", f"unknown message type {kind!r}: expected session.config, "
                                     "input.text, input.done, response.cancel, voice.add, voice.list or "
                                     "session.close")
        return False

    async def _configure(self, data: dict) -> None:
        try:
            cfg = SessionConfig.model_validate(data)
            problem = self._unsupported(cfg)
            if problem:
                await self._error("invalid_config", f"session.config: {problem}")
                return
            await self.serving.prepare(cfg, None)  # voice, language, ... checked now, not at the first text
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err.get("loc", ()))
            what = f"unknown field {field!r}" if err.get("type") == "extra_forbidden" else f"{field}: {err.get('msg')}"
            await self._error("invalid_config", f"session.config: {what}")
            return
        except ApiError as e:
            await self._error(e.info.code or "invalid_config", f"session.config: {e.info.message}")
            return
        self.config, self.configured = cfg, True

    def _unsupported(self, cfg: SessionConfig) -> str | None:
        """vLLM-Omni's fields this server cannot honour as given -> the message naming them."""
        served = TASK_TYPES.get(self.serving.model_type, self.serving.model_type)
        if cfg.task_type is not None and cfg.task_type != served:
            return (f"task_type {cfg.task_type!r} does not match the served model: this server runs a {served} "
                    f"model (send task_type {served!r} or leave it out)")
        if cfg.response_format not in (None, "pcm"):
            return (f"response_format {cfg.response_format!r} is not available on the socket: it streams pcm "
                    "(16-bit, 24 kHz, mono); other formats over HTTP POST /v1/audio/speech")
        if cfg.speed not in (None, 1.0):
            return (f"speed {cfg.speed} is not available on the socket: it streams at the native tempo (1.0); "
                    "other speeds over HTTP POST /v1/audio/speech")
        self.serving.make_split(cfg.split_granularity, cfg.pause_ms)  # ApiError naming the accepted values
        if cfg.word_timestamps or cfg.timestamp_type is not None or cfg.timestamp_transport_strategy is not None:
            if cfg.timestamp_type is not None or cfg.timestamp_transport_strategy is not None:
                if cfg.timestamp_type != "word" or cfg.timestamp_transport_strategy not in (None, "sync"):
                    return (f"timestamp_type {cfg.timestamp_type!r} / timestamp_transport_strategy "
                            f"{cfg.timestamp_transport_strategy!r}: this server makes word timestamps (timestamp_type "
                            "'word') and sends them in each utterance's audio.done (timestamp_transport_strategy "
                            "'sync'), or with word_timestamps true in a trailing audio.chunk")
            try:
                self.serving.check_words(None, cfg.language)  # an aligner is loaded and knows the language
            except ApiError as e:
                return e.info.message
        return None

    async def _add_text(self, text: str) -> None:
        if self.current is REFUSED:
            return
        if self.current is None:
            if not text:
                return
            try:
                self.current = await self._start()
            except ApiError as e:
                self.current = REFUSED
                extra = {"limit": e.limit} if isinstance(e, Busy) else {}
                await self._error(e.info.code or "invalid_request", e.info.message, **extra)
                return
        utt, s = self.current, self.serving.settings
        split = isinstance(utt.text, SegmentFeed)
        limit = s.max_split_text_length if split else s.max_text_length
        utt.chars += len(text)
        if utt.chars > limit:
            self.current = REFUSED
            utt.gen.handle.cancel()
            flag = "--max-split-text-length" if split else "--max-text-length"
            await self._error("input_too_long", f"the utterance's text is more than {limit} characters "
                              f"({flag}): it was cancelled; send input.done more often")
            return
        utt.text.append(text)
        utt.said.append(text)

    async def _start(self) -> Utterance:
        """A new utterance: its request, with an open text, queued in the engine now (within the caps)."""
        s = self.serving.settings
        clients = self.serving.ws_clients
        if len(self.live) >= s.ws_max_utterances:
            raise Busy(f"this session has {len(self.live)} utterances speaking or queued, its limit "
                       "(--ws-max-utterances): wait for audio.done before flushing more", "session")
        if clients[self.client] >= s.ws_max_client_utterances:
            raise Busy(f"this client ({self.client}) has {clients[self.client]} utterances speaking or queued over "
                       "its sessions, its limit (--ws-max-client-utterances)", "client")
        arrival = time.perf_counter()
        first = self.config.initial_codec_chunk_frames or s.first_chunk_frames
        options = StreamOptions(first, max(first, s.chunk_frames))
        split = self.serving.make_split(self.config.split_granularity, self.config.pause_ms)
        if split is not None:  # segment requests, each submitted once its end is known in the text
            text, gen = self.serving.generate_streamed_long(self.config, split, "speech-ws", arrival, options)
        else:
            prepared = await self.serving.prepare(self.config, None)
            try:
                gen = self.serving.submit(prepared, "pcm", "speech-ws", arrival, options)
            except ApiError as e:
                if e.info.code == "queue_full":
                    raise Busy(f"{e.info.message} (the server's queue, --max-queue)", "server") from e
                raise
            text = prepared.text
        utt = Utterance(text, gen, self.client, self.num_utterances)
        self.num_utterances += 1
        self.live.append(utt)
        clients[self.client] += 1
        self.outbox.put_nowait(utt)
        return utt

    def _forget(self, utt: Utterance) -> None:
        """The utterance is sent or abandoned: its request closed (slot freed), its place in the caps given back."""
        utt.gen.handle.close()
        if utt in self.live:
            self.live.remove(utt)
            clients = self.serving.ws_clients
            clients[utt.client] -= 1
            if clients[utt.client] <= 0:
                del clients[utt.client]

    def _close_text(self) -> None:
        utt, self.current = self.current, None
        if isinstance(utt, Utterance):
            try:
                utt.text.close()
            except ValueError as e:  # nothing but blanks: the engine fails the request; say why
                asyncio.ensure_future(self._error("empty_input", str(e)))

    # ------------------------------------------------------------------ voices
    def _voice_list(self) -> dict:
        voices = self.serving.voices
        uploaded = [v.model_dump(exclude_none=True) for v in voices.list()] if voices.store is not None else []
        return {"type": "voice.list", "voices": voices.builtin(), "uploaded_voices": uploaded}

    async def _voice_add(self, data: dict) -> None:
        voices = self.serving.voices
        try:
            msg = VoiceAddMessage.model_validate(data)
            audio = _decode_audio(msg.audio_data, voices.max_upload_bytes)
            voice = await voices.create(msg.name, audio, msg.ref_text, msg.x_vector_only_mode)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err.get("loc", ()))
            await self._error("invalid_message", f"voice.add: {field}: {err.get('msg')}")
            return
        except ApiError as e:
            await self._error(e.info.code or "invalid_request", f"voice.add: {e.info.message}")
            return
        await self._send_json({"type": "voice.add", "success": True, "voice": voice.model_dump(exclude_none=True)})

    # ------------------------------------------------------------------ audio out
    async def _send_all(self) -> None:
        while (item := await self.outbox.get()) is not None:
            if item is FLUSH:
                await self._send_json({"type": "session.done"})
                continue
            try:
                await self._send_utterance(item)
            finally:
                self._forget(item)

    async def _send_utterance(self, utt: Utterance) -> None:
        sr = self.serving.tts.sample_rate
        await self._send_json({"type": "audio.start", "sample_rate": sr, "format": "pcm_s16le"})
        run, held = utt.gen.run, bytearray()
        livekit = self.config.timestamp_type == "word"  # checked at session.config: an aligner is loaded
        form = ChunkForm(utt.index, sr) if self.config.word_timestamps else None  # vLLM-Omni's audio.chunk form
        audio: list = []  # float32 PCM kept for the aligner, up to the most it aligns at once
        room = round(self.serving.aligner.aligner.max_seconds * sr) if livekit or form else 0
        try:
            async with aclosing(self.serving.stream(utt.gen)) as chunks:  # closed (slot freed, run booked) on any exit
                async for chunk in chunks:
                    if chunk.num_frames:
                        if room > 0:
                            audio.append(chunk.audio)
                        room -= chunk.audio.size
                        pcm = to_s16(chunk.audio).tobytes()
                        if not self.config.stream_audio:
                            held += pcm
                        elif form:
                            await self._send_json(form.audio(pcm))
                        else:
                            await self._send_bytes(pcm)
                    if chunk.is_last and chunk.error:
                        await self._error("generation_failed", chunk.error)
            if held:
                await (self._send_json(form.audio(bytes(held))) if form else self._send_bytes(bytes(held)))
        except QueueFullError as e:  # a split utterance's first segment: the server's queue is full
            await self._error("queue_full", f"{e} (the server's queue, --max-queue)", limit="server")
        except Exception as e:  # an engine failure: this utterance ends, the session goes on
            log.exception("%s failed", run.request_id)
            await self._error("generation_failed", f"{type(e).__name__}: {e}")
        reason = FINISH.get(run.finish_reason, "error") if run.outcome != "failed" else "error"
        done = {"type": "audio.done", "frames": run.frames, "finish_reason": reason}
        found = None
        if (livekit or form) and run.outcome == "completed" and room < 0:
            await self._error("alignment_failed", "word timestamps: the utterance's audio is longer than the aligner "
                              f"takes at once ({self.serving.aligner.aligner.max_seconds:g} s): send input.done "
                              "more often")
        elif (livekit or form) and run.outcome == "completed":
            pcm = np.concatenate(audio) if audio else np.zeros(0, np.float32)
            try:
                found = await self.serving.utterance_words(pcm, sr, "".join(utt.said), self.config.language)
            except Exception as e:  # the audio went out: say the words could not be made, and go on
                log.exception("%s: alignment failed", run.request_id)
                await self._error("alignment_failed", f"word timestamps: {type(e).__name__}: {e}")
        if form:  # vLLM-Omni: a trailing audio.chunk with empty audio: the words, or null (none could be made)
            await self._send_json(form.words(None if found is None else words_ms(found)))
        if livekit and found is not None:  # LiveKit's sync transport: the words in audio.done
            done["timestamp_info"] = {"word_alignment": livekit_alignment(found)}
        # its place in the caps is given back before audio.done goes out: a client that starts its next utterance
        # on audio.done (at its cap) is not refused for the one it just heard end
        self._forget(utt)
        await self._send_json(done)

    async def _send_bytes(self, data: bytes) -> None:
        self.last_activity = time.monotonic()
        await self.ws.send_bytes(data)

    async def _send_json(self, obj: dict) -> None:
        self.last_activity = time.monotonic()
        await self.ws.send_text(json.dumps(obj, separators=(",", ":")))

    async def _error(self, code: str, message: str, **extra) -> bool:
        self.serving.metrics.errors.labels("invalid_request_error", code).inc()
        await self._send_json({"type": "error", "code": code, "message": message, **extra})
        return False


@dataclass(slots=True)
class ChunkForm:
    """vLLM-Omni's word_timestamps form of one utterance's audio: JSON audio.chunk messages (PCM s16le in base64,
    its place in ms from the utterance's start), then one with empty audio whose timestamps are the utterance's
    words ([{word, start_ms, end_ms}] from its start; [] no word; null: none could be made). One alignment per
    utterance (a flush): sentence_index is 0."""

    utterance: int  # utterance_index
    sample_rate: int
    chunk_id: int = 0
    samples: int = 0  # sent so far

    def _ms(self, samples: int) -> int:
        return round(samples * 1000 / self.sample_rate)

    def audio(self, pcm: bytes, timestamps: list | None = None) -> dict:
        start, self.samples = self.samples, self.samples + len(pcm) // 2
        msg = {"type": "audio.chunk", "utterance_index": self.utterance, "sentence_index": 0,
               "chunk_id": self.chunk_id, "chunk_start_ms": self._ms(start), "chunk_end_ms": self._ms(self.samples),
               "sample_rate": self.sample_rate, "channels": 1, "audio_b64": base64.b64encode(pcm).decode(),
               "timestamps": timestamps}
        self.chunk_id += 1
        return msg

    def words(self, words: list[WordTiming] | None) -> dict:
        msg = self.audio(b"", None if words is None else [w.model_dump() for w in words])
        msg["chunk_start_ms"] = 0  # (the trailing message spans the whole utterance)
        return msg


class Busy(ApiError):
    """A queue_full refusal naming the limit that was hit: "session", "client" or "server"."""

    def __init__(self, message: str, limit: str):
        super().__init__(503, message, type="server_busy", code="queue_full")
        self.limit = limit


def _decode_audio(data: str, max_bytes: int) -> bytes:
    from .voices import decode_base64_audio
    return decode_base64_audio(data, max_bytes, "audio_data")


def _check_value(value, depth: int = 0) -> str | None:
    """What makes a parsed message unusable, or None: nesting past MAX_DEPTH, or a string that cannot be
    encoded (a lone surrogate, which JSON's \\ud800 escapes can carry but no text can hold)."""
    if depth > MAX_DEPTH:
        return f"the message is nested more than {MAX_DEPTH} levels deep: send flat JSON objects"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"a string holds a character that cannot be encoded (U+{ord(value[e.start]):04X}, a lone "
                    f"surrogate, at position {e.start}): send valid Unicode text")
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, v in items:
        problem = _check_value(v, depth + 1)
        if problem:
            return f"{key}: {problem}" if isinstance(key, str) and depth == 0 else problem
    return None
