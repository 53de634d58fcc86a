"""Live servers for the server tests: a real uvicorn on 127.0.0.1 (free port, in a thread) serving a tiny
random checkpoint on CPU, driven by the official `openai` client."""

from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
import openai
import torch
import uvicorn

from tests.golden import fixtures as fx

SR = 24000
SPF = 1920  # samples per 80 ms frame
GREEDY = {"do_sample": False, "subtalker_dosample": False}


@dataclass
class LiveServer:
    base_url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, api_key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=120)

    @property
    def stats(self):
        return self.app.state.engine.stats()

    def metric(self, name: str, **labels) -> float:
        """A sample's value from /metrics (0 if absent)."""
        text = httpx.get(self.base_url + "/metrics").text
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_idle(self, timeout: float = 10.0) -> None:
        t = time.time() + timeout
        while time.time() < t:
            s = self.stats
            if s.active_slots == 0 and s.queue_depth == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle after {timeout} s: {self.stats}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(variant: str, voice_dir, **settings) -> LiveServer:
    from q3tts import TTS
    from q3tts.server.app import create_app
    from q3tts.server.settings import ServerSettings

    tts = TTS.from_pretrained(fx.checkpoint(variant), device="cpu", dtype=torch.float32, max_seq_len=256)
    opts = {"max_concurrent": 4, "max_seq_len": 256, "voice_dir": str(voice_dir)}
    opts.update(settings)
    return serve(create_app(tts, ServerSettings(model=f"tiny-{variant}", **opts)), f"uvicorn-{variant}")


def serve(app, name: str = "uvicorn") -> LiveServer:
    """Serve a q3tts app on a free port of 127.0.0.1 from a thread, once ready."""
    from q3tts.server.app import uvicorn_config

    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, "warning"))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    live = LiveServer(f"http://127.0.0.1:{port}", app, server, thread)
    while (r := httpx.get(live.base_url + "/ready")).status_code != 200:
        if "error" in r.json() or time.time() > deadline:
            live.stop()
            raise AssertionError(f"server never became ready: {r.json()}")
        time.sleep(0.05)
    return live


# --------------------------------------------------------------------------- audio helpers
def _as_float(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "i":
        return a.astype(np.float32) / float(-np.iinfo(a.dtype).min)
    return a.astype(np.float32)


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """Any of our formats (pcm excepted) -> (mono float32 samples, decoded sample rate), via PyAV."""
    import av
    with av.open(io.BytesIO(data)) as c:
        frames = [_as_float(f.to_ndarray().reshape(-1)) for f in c.decode(audio=0)]
        rate = c.streams.audio[0].codec_context.sample_rate
    return (np.concatenate(frames) if frames else np.zeros(0, np.float32)), rate


def declared_rate(fmt: str, data: bytes) -> int:
    """The sample rate a file declares for its content: Opus always decodes at 48 kHz, so for Ogg/Opus read
    the original rate from the OpusHead packet."""
    if fmt == "opus":
        i = data.index(b"OpusHead")
        return int.from_bytes(data[i + 12: i + 16], "little")
    if fmt == "pcm":
        return SR
    return decode(data)[1]


def duration_tolerance(fmt: str) -> float:
    """Decoded minus generated duration allowed: one 80 ms frame; for AAC also one 1024-sample AAC frame, the
    encoder delay that ADTS cannot signal (so decoders keep it: 1024 samples + padding to whole AAC frames)."""
    return 0.08 + (1024 / SR if fmt == "aac" else 0.0)


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")


def speak(client: openai.OpenAI, text: str = "Hello from the server tests.", fmt: str = "pcm",
          max_new_tokens: int = 12, **extra) -> bytes:
    voice = extra.pop("voice", "vivian")
    speed = extra.pop("speed", openai.omit)
    instructions = extra.pop("instructions", openai.omit)
    r = client.audio.speech.create(model="tiny", input=text, voice=voice, response_format=fmt, speed=speed,
                                   instructions=instructions,
                                   extra_body={"max_new_tokens": max_new_tokens, **GREEDY, **extra})
    return r.content


def pieces(text: str, rng) -> list[str]:
    """text cut anywhere (mid-word) into pieces of 1-3 characters, as a streaming client may send it."""
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 3)
        out.append(text[i:i + k])
        i += k
    return out
