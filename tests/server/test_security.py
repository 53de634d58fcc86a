"""The API key guards every route but the probes and the page, WebSockets included; URLs as reference audio
get a clear refusal."""

import httpx
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

KEY = "sekret"


@pytest.fixture
def keyed(cv_server):
    settings = cv_server.app.state.settings
    settings.api_key = KEY
    try:
        yield cv_server
    finally:
        settings.api_key = None


def test_api_key_on_every_route_but_probes_and_page(keyed):
    routes = [("GET", "/v1/models"), ("GET", "/v1/audio/voices"), ("GET", "/v1/audio/voices/vivian"),
              ("DELETE", "/v1/audio/voices/x"), ("POST", "/v1/audio/voices"), ("POST", "/v1/audio/speech"),
              ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/nope"),
              ("POST", "/v1/audio/voice_consents"), ("GET", "/v1/audio/voice_consents"),
              ("GET", "/v1/audio/voice_consents/cons_x"), ("DELETE", "/v1/audio/voice_consents/cons_x")]
    # every documented route of the app is in the list above or open on purpose
    open_paths = {"/health", "/ready", "/"}
    app_paths = set(keyed.app.openapi()["paths"])
    listed = {p for _, p in routes} | open_paths | {"/v1/audio/voices/{voice_id}",
                                                    "/v1/audio/voice_consents/{consent_id}"}
    assert app_paths <= listed, app_paths - listed
    with keyed.http() as h:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": "Api-Key wrong"}):
                r = h.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": f"Bearer {KEY}"}
        assert h.get("/v1/models", headers=ok).status_code == 200
        # LiveKit's Baseten client authenticates as "Api-Key <key>": accepted wherever Bearer is
        assert h.get("/v1/models", headers={"Authorization": f"Api-Key {KEY}"}).status_code == 200
        assert h.get("/metrics", headers=ok).status_code == 200
        assert h.get("/openapi.json", headers=ok).status_code == 200
        for path in sorted(open_paths):  # load balancer probes and the static page need no key
            assert h.get(path).status_code == 200, path


def test_api_key_on_websockets(keyed):
    """A minimal WebSocket route registered here (the speech WebSocket is added by the engine work): without
    the key the handshake is refused before the route runs; with the header or ?api_key= it is accepted."""
    reached = []

    async def echo(ws: WebSocket):
        reached.append(1)
        await ws.accept()
        await ws.send_text("hello")
        await ws.close()

    app = keyed.app
    app.router.add_websocket_route("/v1/test-ws", echo)
    try:
        client = TestClient(app)
        for url, headers in (("/v1/test-ws", {}), ("/v1/test-ws?api_key=wrong", {}),
                             ("/v1/test-ws", {"Authorization": "Bearer wrong"})):
            with pytest.raises(WebSocketDisconnect) as e:
                with client.websocket_connect(url, headers=headers) as ws:
                    ws.receive_text()
            assert e.value.code == 1008
        assert not reached
        for url, headers in (("/v1/test-ws?api_key=" + KEY, {}), ("/v1/test-ws", {"Authorization": f"Bearer {KEY}"})):
            with client.websocket_connect(url, headers=headers) as ws:
                assert ws.receive_text() == "hello"
        assert len(reached) == 2
        # the live server (uvicorn) refuses the upgrade itself: HTTP 403 to the handshake
        r = httpx.get(keyed.base_url + "/v1/test-ws", headers={
            "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
        assert r.status_code == 403
    finally:
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/v1/test-ws"]


@pytest.mark.parametrize("url", ["https://example.com/me.wav", "http://10.0.0.1/clip.mp3", "s3://bucket/a.wav",
                                 "  file:///etc/passwd"])
def test_ref_audio_url_is_refused_clearly(base_server, url):
    with base_server.http() as h:
        r = h.post("/v1/audio/speech", json={"input": "Hi.", "ref_audio": url, "x_vector_only_mode": True,
                                             "response_format": "pcm", "max_new_tokens": 4})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "ref_audio" and err["code"] == "url_not_supported"
        assert err["message"].startswith("ref_audio: URLs are not fetched by this server")
        r = h.post("/v1/audio/voices", json={"name": "web", "audio_sample": url})
        assert r.status_code == 400 and r.json()["error"]["code"] == "url_not_supported"
        r = h.post("/v1/audio/voices", files={"audio_sample": (None, url)}, data={"name": "web"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "url_not_supported"
