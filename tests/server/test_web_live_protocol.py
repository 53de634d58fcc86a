"""The page's live-typing client against a stand-in of the WebSocket /v1/audio/speech/stream: a small app that
serves the real page and a socket speaking the documented protocol, answering each input.text with one
frame of PCM at once (no model). It checks what the page sends: a session.config with the request fields, the
text as deltas that add up to what was typed, input.done per sentence; and what it does with the answers:
plays and counts the audio, reports a sentence done, shows an error message as the server words it.
The same page against the real socket is test_web_page.py's live-typing test."""

import base64
import json
import shutil
import threading
import time

import numpy as np
import pytest

webdriver = pytest.importorskip("selenium.webdriver")
if not ((shutil.which("chromium") or shutil.which("chromium-browser")) and shutil.which("chromedriver")):
    pytest.skip("no chromium / chromedriver on this machine", allow_module_level=True)

from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from .test_web_page import artifacts, browser, by_id, js, shot  # noqa: E402, F401  (fixtures: Chromium, PNG dir)

SPF = 1920


def stand_in_app(log: list):
    from fastapi import FastAPI, WebSocket, WebSocketDisconnect
    from fastapi.responses import HTMLResponse

    from q3tts.server.app import STATIC

    app = FastAPI()
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    frame = (np.sin(np.arange(SPF) * 0.05) * 8000).astype("<i2").tobytes()  # one 80 ms frame

    @app.get("/")
    async def index():
        return HTMLResponse(page)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stand-in", "object": "model", "created": 0, "owned_by": "test",
                                            "tts_model_type": "custom_voice", "tts_model_size": "0b6",
                                            "sample_rate": 24000, "languages": ["auto", "english"],
                                            "voices": ["vivian"]}]}

    @app.get("/v1/audio/voices")
    async def voices():
        return {"object": "list", "data": [{"id": "vivian", "object": "audio.voice", "name": "vivian",
                                            "created_at": 0, "type": "builtin"}]}

    @app.websocket("/v1/audio/speech/stream")
    async def stream(ws: WebSocket):
        offered = ws.scope.get("subprotocols") or []
        keys = [base64.urlsafe_b64decode(p[len("q3tts-key."):] + "==").decode() for p in offered
                if p.startswith("q3tts-key.")]
        log.append({"type": "connect", "api_key": ws.query_params.get("api_key"), "key": keys[0] if keys else None})
        await ws.accept(subprotocol="q3tts" if "q3tts" in offered else None)
        frames, started = 0, False
        try:
            while True:
                m = json.loads(await ws.receive_text())
                log.append(m)
                if m["type"] == "input.text":
                    if m["text"] == "!":
                        await ws.send_json({"type": "error", "code": "bad_text", "message": "no exclamations, please"})
                        continue
                    if not started:
                        await ws.send_json({"type": "audio.start", "sample_rate": 24000, "format": "pcm_s16le"})
                        started = True
                    await ws.send_bytes(frame)
                    frames += 1
                elif m["type"] == "input.done":
                    await ws.send_json({"type": "audio.done", "frames": frames, "finish_reason": "stop"})
                    frames, started = 0, False
                elif m["type"] == "session.close":
                    await ws.send_json({"type": "session.done"})
                    await ws.close()
                    return
        except WebSocketDisconnect:
            log.append({"type": "disconnect"})

    return app


@pytest.fixture(scope="module")
def stand_in():
    import uvicorn
    log: list = []
    server = uvicorn.Server(uvicorn.Config(stand_in_app(log), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", log
    server.should_exit = True
    thread.join(timeout=10)


def sent(log, kind):
    return [m for m in log if m.get("type") == kind]


def test_page_speaks_the_live_protocol(stand_in, browser, artifacts):  # noqa: F811
    url, log = stand_in
    d = browser
    d.get(url + "/")
    WebDriverWait(d, 30).until(lambda d: by_id(d, "status").text == "Ready.")
    d.find_element("css selector", "details summary").click()  # "Server access" opens
    by_id(d, "apikey").send_keys("sk-test")
    by_id(d, "seed").send_keys("7")

    # the simulated LLM: 4-character tokens at 20 tokens/s; audio comes back while it is still writing
    by_id(d, "llm-rate").clear()
    by_id(d, "llm-rate").send_keys("20")
    total = js(d, "return LLM_TEXT.length")
    by_id(d, "llm-sim").click()
    WebDriverWait(d, 30).until(lambda d: js(d, "return out && out.samples > 0"))
    assert len(by_id(d, "live-text").get_attribute("value")) < total
    WebDriverWait(d, 60).until(lambda d: by_id(d, "status").text.startswith("Live: sentence 1 done"))
    paragraph = js(d, "return LLM_TEXT")
    config = sent(log, "session.config")
    # the key as a subprotocol, never in the URL (which access logs keep)
    assert log[0] == {"type": "connect", "api_key": None, "key": "sk-test"} and len(config) == 1
    assert config[0]["voice"] == "vivian" and config[0]["seed"] == 7 and "input" not in config[0]
    texts = [m["text"] for m in sent(log, "input.text")]
    assert "".join(texts) == paragraph and max(map(len, texts)) <= 4 and len(texts) == -(-total // 4)
    assert len(sent(log, "input.done")) == 1
    # every frame the stand-in sent was received and counted
    assert js(d, "return out.samples") == len(texts) * SPF
    assert by_id(d, "audio-s").text == f"{len(texts) * SPF / 24000:.2f} s" and by_id(d, "ttfa").text.endswith(" ms")
    d.execute_script("document.getElementById('live-h').scrollIntoView()")
    shot(d, artifacts, "live-typing-stand-in")

    # typing by hand: each key is a delta; Enter ends the sentence; the next text starts the next one
    n = len(texts)
    by_id(d, "live-text").send_keys("Hi you", Keys.ENTER)
    WebDriverWait(d, 30).until(lambda d: by_id(d, "status").text.startswith("Live: sentence 2 done"))
    typed = [m["text"] for m in sent(log, "input.text")][n:]
    assert "".join(typed) == "Hi you" and len(typed) == 6 and len(sent(log, "input.done")) == 2

    # a pause ends a sentence too
    by_id(d, "live-pause").clear()
    by_id(d, "live-pause").send_keys("0.5")
    by_id(d, "live-text").send_keys("Then a pause")
    WebDriverWait(d, 30).until(lambda d: by_id(d, "status").text.startswith("Live: sentence 3 done"))
    assert len(sent(log, "input.done")) == 3

    # the server's error, as worded, on the status line. The pause is made long first: when it ends the sentence,
    # the stand-in's audio.done replaces the error on the status line, and a 0.5 s pause is one WebDriverWait poll.
    by_id(d, "live-pause").clear()
    by_id(d, "live-pause").send_keys("10")
    by_id(d, "live-text").send_keys("!")
    WebDriverWait(d, 30).until(lambda d: by_id(d, "status").text.startswith("Error"))
    assert by_id(d, "status").text == "Error: no exclamations, please"

    by_id(d, "live-stop").click()
    WebDriverWait(d, 30).until(lambda d: sent(log, "session.close"))  # (the close frame may beat session.done)
    assert by_id(d, "status").text == "Live: disconnected."
