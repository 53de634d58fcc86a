"""The HTTP layer: FastAPI app factory, routes, and `q3tts serve`.

    router (this file) -> SpeechServing / VoiceService (serving.py, voices.py) -> AsyncEngine

Routes only parse, call one serving method and pick the response type; handles live on `app.state`.
One small ASGI middleware runs before routing: the optional Bearer API key on every route but /health,
/ready and the page (WebSockets included, which may pass it as ?api_key=), the request body
limit (413 before a large upload is read) and the request count for /metrics. A client that disconnects
cancels its generation: before the first audio through `with_cancellation`, after it through
`AudioStreamingResponse` (closing the byte stream aborts the engine request and frees its slot).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from q3tts.engine import AsyncEngine

from . import logfilter
from .metrics import Metrics
from .protocol import (
    ApiError,
    CreateVoiceRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SpeechRequest,
    VoiceList,
)
from .serving import SpeechServing
from .session import SpeechSession
from .settings import ServerSettings
from .voices import VoiceService, check_not_url, decode_base64_audio

log = logging.getLogger("q3tts.server")
STATIC = Path(__file__).resolve().parent / "static"
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
        "ref_text": {"type": "string"}, "x_vector_only_mode": {"type": "boolean"}, "consent": {"type": "string"}}}},
}}}


@router.post("/v1/audio/voices", openapi_extra=_VOICE_UPLOAD_BODY)
async def create_voice(raw_request: Request):
    """multipart/form-data (OpenAI's: name, audio_sample file, consent; plus ref_text, x_vector_only_mode)
    or JSON (CreateVoiceRequest, audio_sample as base64 / data URL)."""
    state = _state(raw_request)
    limit = state.settings.max_upload_bytes
    ctype = raw_request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        form = await raw_request.form()
        upload = form.get("audio_sample") or form.get("file")
        if isinstance(upload, str):
            check_not_url(upload, "audio_sample")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "audio_sample is required: the reference clip as a file field", param="audio_sample")
        audio = await upload.read(limit + 1)
        if len(audio) > limit:
            raise ApiError(413, f"audio_sample is more than this server's limit of {limit} bytes (--max-upload-bytes)",
                           param="audio_sample", code="upload_too_large")
        xvec = str(form.get("x_vector_only_mode", "false")).strip().lower() in ("1", "true", "yes", "on")
        name, ref_text = str(form.get("name") or ""), form.get("ref_text")
        ref_text = str(ref_text) if ref_text is not None else None
    else:
        try:
            req = CreateVoiceRequest.model_validate_json(await raw_request.body())
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        audio = decode_base64_audio(req.audio_sample, limit, "audio_sample")
        name, ref_text, xvec = req.name, req.ref_text, req.x_vector_only_mode
    return await state.voices.create(name, audio, ref_text, xvec)


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


# --------------------------------------------------------------------------- errors
def _error(status: int, info: ErrorInfo, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


def _validation_error(errors: list[dict]) -> JSONResponse:
    """Pydantic errors -> one OpenAI-style 400 naming the first bad field."""
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"] if e.get("type") != "json_invalid" else []
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        msg = f"the request body is not valid JSON: {e.get('msg')}"
    elif not loc:
        msg = "the request body must be a JSON object"
    elif loc[0] == "voice" and e.get("type") == "value_error":  # the name's own check (loc: voice.<union branch>)
        param, msg = "voice", f"invalid value for 'voice': {e.get('msg')}"
    elif loc[0] == "voice":  # a union: pydantic reports each alternative
        param, msg = "voice", 'voice must be a voice name (a string) or an object {"id": "<voice id or name>"}'
    elif e.get("type") == "extra_forbidden":
        msg = f"unknown field {param!r}"
    elif e.get("type") == "missing":
        msg = f"{param} is required"
    else:
        got = e.get("input")
        got = f" (got {json.dumps(got)[:80]})" if isinstance(got, (int, float, str, bool)) else ""
        msg = f"invalid value for {param!r}: {e.get('msg')}{got}"
    fields = {str(next((p for p in x.get("loc", ()) if p != "body"), "")) for x in errors}
    more = f" (and problems with {len(fields) - 1} more field(s))" if len(fields) > 1 else ""
    return _error(400, ErrorInfo(message=msg + more, type="invalid_request_error", param=param,
                                 code=e.get("type")))


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: ApiError):
        request.app.state.metrics.errors.labels(exc.info.type, exc.info.code or "").inc()
        return _error(exc.status, exc.info, exc.headers)

    async def validation_error(request: Request, exc: RequestValidationError):
        request.app.state.metrics.errors.labels("invalid_request_error", "validation").inc()
        return _validation_error(list(exc.errors()))

    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        request.app.state.metrics.errors.labels(kind, str(exc.status_code)).inc()
        return _error(exc.status_code, ErrorInfo(message=str(exc.detail), type=kind), getattr(exc, "headers", None))

    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        request.app.state.metrics.errors.labels("server_error", "").inc()
        return _error(500, ErrorInfo(message=f"internal error: {type(exc).__name__}", type="server_error"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


# --------------------------------------------------------------------------- middleware (pure ASGI)
def _route_label(path: str) -> str:
    for p in ("/v1/audio/speech", "/v1/audio/voices", "/v1/models", "/health", "/ready", "/metrics"):
        if path == p or path.startswith(p + "/"):
            return p
    return "/" if path == "/" else "other"


async def _send_error(send, status: int, info: ErrorInfo, headers: list | None = None) -> None:
    body = json.dumps(ErrorResponse(error=info).model_dump()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


# Open without the API key: the load balancer's probes (they carry no credentials) and the web page itself
# (static HTML; it sends the key the user types on its own /v1 calls). Everything else needs the key:
# /v1/*, /metrics, the OpenAPI schema and docs, and every WebSocket.
OPEN_PATHS = frozenset(("/health", "/ready", "/"))


def _key_ok(key: str, headers: dict[str, str], query: str | None = None) -> bool:
    """'Authorization: Bearer <key>', or for WebSockets (browsers cannot set their headers) ?api_key=<key>."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return True
    if query is not None:
        given = parse_qs(query).get("api_key", [])
        return any(hmac.compare_digest(g.encode(), key.encode()) for g in given)
    return False


class GuardMiddleware:
    """API key on every route but OPEN_PATHS (HTTP and WebSocket), request body limit, and request counting
    (route, status) for /metrics."""

    def __init__(self, app, settings: ServerSettings, metrics: Metrics):
        self.app, self.settings, self.metrics = app, settings, metrics
        # a base64 upload is 4/3 of the clip, plus the rest of the JSON
        self.max_body = settings.max_upload_bytes * 4 // 3 + settings.max_text_length * 4 + 64 * 1024

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = _route_label(scope["path"])
        status_box = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(route, str(status_box[0])).inc()

    async def _guarded(self, scope, receive, send):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self.settings.api_key
        if key and scope["path"] not in OPEN_PATHS:
            if not _key_ok(key, headers):
                self.metrics.errors.labels("invalid_request_error", "invalid_api_key").inc()
                return await _send_error(send, 401, ErrorInfo(
                    message="Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                    type="invalid_request_error", code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            self.metrics.errors.labels("invalid_request_error", "upload_too_large").inc()
            return await _send_error(send, 413, ErrorInfo(
                message=f"request body is {length} bytes, more than this server accepts ({self.max_body} bytes; "
                        f"a reference clip may be at most {self.settings.max_upload_bytes} bytes, --max-upload-bytes)",
                type="invalid_request_error", code="upload_too_large"))
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:  # chunked upload without a content-length
                    raise StarletteHTTPException(413, f"request body is more than {self.max_body} bytes")
            return message

        await self.app(scope, limited_receive, send)

    async def _websocket(self, scope, receive, send):
        """Without the key the handshake is refused before it is accepted: closing at that point makes the
        ASGI server answer the upgrade request with HTTP 403 (code 1008, policy violation, where a close
        frame can be sent), so no route code runs."""
        key = self.settings.api_key
        if key:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            if not _key_ok(key, headers, scope.get("query_string", b"").decode("latin-1")):
                self.metrics.errors.labels("invalid_request_error", "invalid_api_key").inc()
                if (await receive())["type"] != "websocket.connect":  # gone before the handshake
                    return
                return await send({"type": "websocket.close", "code": 1008,
                                   "reason": "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                                             "or ?api_key=<key>"})
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------- the app
def create_app(tts, settings: ServerSettings | None = None) -> FastAPI:
    """The server for a loaded model.

    Args:
        tts: a q3tts.TTS (any model type).
        settings: limits, voice directory, API key, stream chunking (defaults: ServerSettings()).
    """
    settings = settings or ServerSettings()
    logfilter.install()  # no API key (?api_key=) in uvicorn's request logs
    engine = AsyncEngine.of(tts.build_engine(max_slots=settings.max_concurrent, max_seq_len=settings.max_seq_len,
                                          max_queue=settings.max_queue, **settings.memory_budget))
    metrics = Metrics(engine.stats)
    voices = VoiceService(tts, settings.voice_dir, settings.max_upload_bytes, settings.clone_workers,
                          settings.clone_queue)
    serving = SpeechServing(tts, engine, voices, metrics, settings)
    if getattr(tts, "aligner", None) is not None:  # word timestamps: one aligner worker beside the engine
        from q3tts.align import AlignerWorker
        serving.aligner = AlignerWorker(tts.aligner)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        warm = asyncio.ensure_future(serving.warmup()) if settings.warmup else None
        if warm is None:
            serving.ready = True
            metrics.ready.set(1)
        try:
            yield
        finally:
            if warm is not None and not warm.done():
                warm.cancel()
            engine.shutdown()
            if serving.aligner is not None:
                serving.aligner.close()

    app = FastAPI(title="q3tts", description="OpenAI-compatible speech server for Qwen3-TTS", lifespan=lifespan)
    st = app.state
    st.tts, st.engine, st.metrics, st.voices, st.serving, st.settings = tts, engine, metrics, voices, serving, settings
    st.started = int(time.time())
    st.index_html = (STATIC / "index.html").read_text(encoding="utf-8")  # the web page, read once
    _install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics)
    return app


def load_model(settings: ServerSettings):
    """The q3tts.TTS a server with these settings serves (one per process / Ray Serve replica)."""
    from q3tts.api import TTS
    return TTS.from_pretrained(settings.model, device=settings.device, dtype=settings.dtype,
                               quantization=settings.quantization, compile_cache=settings.compile_cache,
                               generation_config=settings.generation_config, aligner=settings.aligner)


def main(settings: ServerSettings) -> int:
    """`q3tts serve [flags]` (cli.cmd_serve parses them): load the model and serve until interrupted."""
    import uvicorn

    t0 = time.perf_counter()
    tts = load_model(settings)
    log.info("loaded %s (%s, %s) on %s in %.1f s", settings.model, tts.cfg.tts_model_type, tts.cfg.tts_model_size,
             tts.device, time.perf_counter() - t0)
    app = create_app(tts, settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                timeout_graceful_shutdown=5)
    return 0
