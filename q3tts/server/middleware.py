"""What runs before routing (one pure ASGI middleware) and how errors are answered.

`GuardMiddleware`: the optional API key on every route but /health, /ready and the page (WebSockets included),
the request body limit (413 before a large upload is read) and the request count for /metrics. The key is
accepted as `Authorization: Bearer <key>` or `Authorization: Api-Key <key>` (LiveKit's Baseten client); on a
WebSocket also as a subprotocol `q3tts-key.<base64url of the key>` (browsers can set no header; the web page
does this) or `?api_key=<key>` (older clients).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import Metrics
from .protocol import ApiError, ErrorInfo, ErrorResponse
from .settings import ServerSettings

log = logging.getLogger("q3tts.server")
KEY_SUBPROTOCOL = "q3tts-key."  # + base64url(key), unpadded


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


def install_error_handlers(app: FastAPI) -> None:
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
    """'Authorization: Bearer <key>' or 'Authorization: Api-Key <key>'; for WebSockets (browsers cannot set their
    headers) also the subprotocol q3tts-key.<base64url(key)> or ?api_key=<key>."""
    want = key.encode()
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() in ("bearer", "api-key") and hmac.compare_digest(token.strip().encode(), want):
        return True
    if query is None:
        return False
    for proto in headers.get("sec-websocket-protocol", "").split(","):
        proto = proto.strip()
        if proto.startswith(KEY_SUBPROTOCOL):
            b64 = proto[len(KEY_SUBPROTOCOL):]
            try:
                given = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
            except (binascii.Error, ValueError):
                continue
            if hmac.compare_digest(given, want):
                return True
    given = parse_qs(query).get("api_key", [])
    return any(hmac.compare_digest(g.encode(), want) for g in given)


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
                    message="Incorrect or missing API key: send the header 'Authorization: Bearer <key>' (or "
                            "'Authorization: Api-Key <key>')",
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
                                   "reason": "Incorrect or missing API key: send 'Authorization: Bearer <key>', "
                                             "the subprotocol q3tts-key.<base64url key> or ?api_key=<key>"})
        await self.app(scope, receive, send)
