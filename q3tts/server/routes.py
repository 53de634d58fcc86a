"""The routes: each parses, calls one serving / voices method and picks the response type; handles live on
`app.state` (create_app in app.py). A client that disconnects cancels its generation: before the first audio
through `with_cancellation`, after it through `AudioStreamingResponse` (closing the byte stream aborts the engine
request and frees its slot).
"""

from __future__ import annotations

import asyncio
import functools

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from .protocol import (
    ApiError,
    CreateVoiceRequest,
    ModelCard,
    ModelList,
    SpeechRequest,
    VoiceConsent,
    VoiceConsentDeleted,
    VoiceConsentList,
    VoiceList,
)
from .session import SpeechSession

router = APIRouter()


# --------------------------------------------------------------------------- cancellation
async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler):
    """Run the handler against a listener for http.disconnect; if the client leaves first, the handler is
    cancelled (which aborts its engine request) and nothing is answered. As vLLM's decorator: reads the
    ASGI receive channel directly, because request.is_disconnected does not work behind middleware."""

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        request: Request = kwargs["raw_request"]
        task = asyncio.ensure_future(handler(*args, **kwargs))
        listener = asyncio.ensure_future(_wait_disconnect(request))
        done, _ = await asyncio.wait((task, listener), return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            listener.cancel()
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)  # nobody is listening

    return wrapper


class AudioStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, also when the client disconnects while a
    chunk is being sent, so the engine request is aborted at once rather than at garbage collection."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


# --------------------------------------------------------------------------- routes
def _state(request: Request):
    return request.app.state


@router.post("/v1/audio/speech")
@with_cancellation
async def create_speech(body: SpeechRequest, raw_request: Request):
    stream = await _state(raw_request).serving.create_speech(body)
    headers = {"X-Request-Id": stream.request_id, "Cache-Control": "no-cache", **stream.headers}
    return AudioStreamingResponse(stream.body, media_type=stream.media_type, headers=headers)


@router.websocket("/v1/audio/speech/stream")
async def speech_stream(websocket: WebSocket):
    """Text in as it is written, PCM out as it is made (q3tts.server.session)."""
    await SpeechSession(websocket.app.state.serving, websocket).run()


@router.get("/v1/audio/voices")
async def list_voices(raw_request: Request) -> VoiceList:
    return VoiceList(data=_state(raw_request).voices.list())


@router.get("/v1/audio/voices/{voice_id}")
async def get_voice(voice_id: str, raw_request: Request):
    return _state(raw_request).voices.get(voice_id)


# the route reads the raw request (multipart or JSON), so its body is described here for clients and fuzzers
_VOICE_UPLOAD_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": CreateVoiceRequest.model_json_schema()},
    "multipart/form-data": {"schema": {"type": "object", "required": ["name", "audio_sample"], "properties": {
        "name": {"type": "string"}, "audio_sample": {"type": "string", "format": "binary"},
        "ref_text": {"type": "string"}, "x_vector_only_mode": {"type": "boolean"}, "consent": {"type": "string"},
        "type": {"type": "string", "enum": ["audio_sample"]}}}},
}}}
_CONSENT_BODY = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "required": ["name", "language", "recording"], "properties": {
        "name": {"type": "string"}, "language": {"type": "string"},
        "recording": {"type": "string", "format": "binary"}}}},
}}}


@router.post("/v1/audio/voices", openapi_extra=_VOICE_UPLOAD_BODY)
async def create_voice(raw_request: Request):
    """multipart/form-data (OpenAI's: name, audio_sample file, consent, type "audio_sample"; plus ref_text,
    x_vector_only_mode) or JSON (CreateVoiceRequest, audio_sample as base64 / data URL)."""
    voices = _state(raw_request).voices
    name, audio, ref_text, xvec = await voices.parse_upload(raw_request)
    return await voices.create(name, audio, ref_text, xvec)


@router.post("/v1/audio/voice_consents", openapi_extra=_CONSENT_BODY)
async def create_voice_consent(raw_request: Request) -> VoiceConsent:
    """OpenAI's consent recording (multipart: name, language, recording): recorded, its id returned."""
    voices = _state(raw_request).voices
    if not raw_request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "send multipart/form-data with name, language and recording (an audio file)",
                       param="recording")
    form = await raw_request.form()
    recording = await voices.read_file(form, "recording")
    return voices.add_consent(str(form.get("name") or ""), str(form.get("language") or ""), recording)


@router.get("/v1/audio/voice_consents")
async def list_voice_consents(raw_request: Request) -> VoiceConsentList:
    return VoiceConsentList(data=_state(raw_request).voices.list_consents())


@router.get("/v1/audio/voice_consents/{consent_id}")
async def get_voice_consent(consent_id: str, raw_request: Request) -> VoiceConsent:
    return _state(raw_request).voices.consent(consent_id)


@router.delete("/v1/audio/voice_consents/{consent_id}")
async def delete_voice_consent(consent_id: str, raw_request: Request) -> VoiceConsentDeleted:
    return VoiceConsentDeleted(id=_state(raw_request).voices.delete_consent(consent_id).id)


@router.delete("/v1/audio/voices/{voice_id}")
async def delete_voice(voice_id: str, raw_request: Request):
    return _state(raw_request).voices.delete(voice_id)


@router.get("/v1/models")
async def list_models(raw_request: Request) -> ModelList:
    s = _state(raw_request)
    tts = s.tts
    card = ModelCard(id=s.settings.model_id, created=s.started, tts_model_type=tts.cfg.tts_model_type,
                     tts_model_size=tts.cfg.tts_model_size,
                     sample_rate=tts.sample_rate, languages=list(tts.get_supported_languages() or []),
                     voices=s.voices.builtin())
    return ModelList(data=[card])


@router.get("/health")
async def health(raw_request: Request):
    """503 once the engine cannot serve (AsyncEngine.healthy); the last failed step is reported either way."""
    engine = _state(raw_request).engine
    ok = engine.healthy()
    body = {"status": "ok" if ok else "unhealthy"}
    if engine.last_error:
        body["last_error"] = engine.last_error
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/ready")
async def ready(raw_request: Request):
    serving = _state(raw_request).serving
    body = {"ready": serving.ready}
    if serving.warmup_error:
        body["error"] = serving.warmup_error
    return JSONResponse(body, status_code=200 if serving.ready else 503)


@router.get("/metrics")
async def metrics(raw_request: Request):
    m = _state(raw_request).metrics
    return Response(m.render(), media_type=m.content_type)


@router.get("/", include_in_schema=False)
async def index(raw_request: Request):
    return HTMLResponse(_state(raw_request).index_html)
