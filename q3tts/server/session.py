"""WebSocket speech sessions: text in as it is written (an LLM's tokens), PCM out as it is made.

    GET /v1/audio/speech/stream   (message names as vLLM-Omni's)
    client  {"type": "session.config", ...the /v1/audio/speech fields but input}   (any time; for the next utterance)
            {"type": "input.text", "text": "..."}   any number, split anywhere
            {"type": "input.done"}                  ends the utterance's text; more input.text starts the next one
            {"type": "response.cancel"}             ends the current utterance now
            {"type": "session.close"}               speaks what was given, then ends the session
    server  {"type": "audio.start", "sample_rate": 24000, "format": "pcm_s16le"}, binary PCM s16le messages,
            {"type": "audio.done", "frames": N, "finish_reason": "stop" | "length" | "cancelled" | "error"},
            {"type": "session.done"}; {"type": "error", "code": ..., "message": ...} for a bad message (the
            session stays usable).

Each utterance is one engine request whose text is appendable (q3tts.inputs.text): its first text starts
it, so it is generated while the utterance before it is still being sent; audio goes out in order.
A client that disconnects cancels its utterances at once (their slots are free at the next step).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from q3tts.audio import to_s16
from q3tts.engine import QueueFullError, RequestHandle, StreamOptions
from q3tts.inputs.request import InputError
from q3tts.inputs.text import TextStream

from .protocol import ApiError, SessionConfig
from .serving import Run

log = logging.getLogger("q3tts.server")
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error"}


@dataclass(eq=False)
class Utterance:
    text: TextStream
    handle: RequestHandle
    run: Run  # metrics bookkeeping
    chars: int = 0


class SpeechSession:
    def __init__(self, serving, ws: WebSocket):
        self.serving, self.ws = serving, ws
        self.config = SessionConfig(type="session.config")
        self.current: Utterance | None = None  # the utterance whose text is still open
        self.outbox: asyncio.Queue[Utterance | None] = asyncio.Queue()  # utterances to send, in order; None: end
        self.live: list[Utterance] = []  # started and not yet fully sent, oldest first

    async def run(self) -> None:
        await self.ws.accept()
        sender = asyncio.ensure_future(self._send_all())
        closing = False
        try:
            while not closing:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
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
                utt.handle.close()

    # ------------------------------------------------------------------ messages in
    async def _handle(self, msg: dict) -> bool:
        """One client message; True when the session is to close."""
        if msg.get("text") is None:
            return await self._error("invalid_message", "binary messages are not accepted: send JSON text messages")
        try:
            data = json.loads(msg["text"])
            kind = data.get("type") if isinstance(data, dict) else None
        except ValueError as e:
            return await self._error("invalid_json", f"a message must be a JSON object: {e}")
        if kind == "session.config":
            try:
                cfg = SessionConfig.model_validate(data)
                await self.serving.prepare(cfg, None)  # voice, language, ... checked now, not at the first text
            except ValidationError as e:
                err = e.errors()[0]
                field = ".".join(str(p) for p in err.get("loc", ()))
                return await self._error("invalid_config", f"session.config: {field}: {err.get('msg')}")
            except ApiError as e:
                return await self._error(e.info.code or "invalid_config", f"session.config: {e.info.message}")
            self.config = cfg
        elif kind == "input.text":
            text = data.get("text")
            if not isinstance(text, str):
                return await self._error("invalid_message", 'input.text needs "text": a string')
            await self._add_text(text)
        elif kind == "input.done":
            self._close_text()
        elif kind == "response.cancel":
            utt = self.current or next(iter(self.live), None)  # the open one, else the one being spoken
            self.current = None
            if utt is not None:
                utt.handle.cancel()
        elif kind == "session.close":
            return True
        else:
            return await self._error("unknown_type", f"unknown message type {kind!r}: expected session.config, "
                                     "input.text, input.done, response.cancel or session.close")
        return False

    async def _add_text(self, text: str) -> None:
        if self.current is None:
            if not text:
                return
            try:
                self.current = await self._start()
            except ApiError as e:
                await self._error(e.info.code or "invalid_request", e.info.message)
                return
        utt, limit = self.current, self.serving.settings.max_text_length
        utt.chars += len(text)
        if utt.chars > limit:
            self.current = None
            utt.handle.cancel()
            await self._error("input_too_long", f"the utterance's text is more than {limit} characters "
                              "(--max-text-length): it was cancelled; send input.done more often")
            return
        utt.text.append(text)

    async def _start(self) -> Utterance:
        """A new utterance: its request, with an open text, queued in the engine now."""
        arrival = time.perf_counter()
        prepared = await self.serving.prepare(self.config, None)
        s = self.serving.settings
        run = Run(f"speech-ws-{uuid.uuid4().hex[:12]}", "pcm", arrival, 0)
        try:
            handle = self.serving.engine.submit(prepared, StreamOptions(s.first_chunk_frames, s.chunk_frames),
                                                request_id=run.request_id, arrival_time=arrival)
        except QueueFullError as e:
            raise ApiError(503, str(e), type="server_busy", code="queue_full") from e
        except InputError as e:
            raise ApiError(400, str(e), code=e.code) from e
        utt = Utterance(prepared.text, handle, run)
        self.live.append(utt)
        self.outbox.put_nowait(utt)
        return utt

    def _close_text(self) -> None:
        utt, self.current = self.current, None
        if utt is not None:
            try:
                utt.text.close()
            except ValueError as e:  # nothing but blanks: the engine fails the request; say why
                asyncio.ensure_future(self._error("empty_input", str(e)))

    # ------------------------------------------------------------------ audio out
    async def _send_all(self) -> None:
        while (utt := await self.outbox.get()) is not None:
            try:
                await self._send_utterance(utt)
            finally:
                self.live.remove(utt)

    async def _send_utterance(self, utt: Utterance) -> None:
        sr = self.serving.tts.sample_rate
        await self._send_json({"type": "audio.start", "sample_rate": sr, "format": "pcm_s16le"})
        run, reason = utt.run, "error"
        try:
            async for chunk in utt.handle.chunks():
                if chunk.num_frames:
                    run.first_audio = run.first_audio or time.perf_counter()
                    run.frames += chunk.num_frames
                    await self.ws.send_bytes(to_s16(chunk.audio).tobytes())
                if chunk.is_last:
                    reason = FINISH.get(chunk.finish_reason, "error")
                    if chunk.error:
                        await self._error("generation_failed", chunk.error)
            run.finish_reason = reason
            run.outcome = {"cancelled": "cancelled", "error": "failed"}.get(reason, "completed")
        except Exception as e:  # an engine failure: this utterance ends, the session goes on
            log.exception("%s failed", utt.handle.request_id)
            run.outcome = "failed"
            await self._error("generation_failed", f"{type(e).__name__}: {e}")
        finally:
            self.serving.book(run)
        await self._send_json({"type": "audio.done", "frames": run.frames, "finish_reason": reason})

    async def _send_json(self, obj: dict) -> None:
        await self.ws.send_text(json.dumps(obj, separators=(",", ":")))

    async def _error(self, code: str, message: str) -> bool:
        self.serving.metrics.errors.labels("invalid_request_error", code).inc()
        await self._send_json({"type": "error", "code": code, "message": message})
        return False
