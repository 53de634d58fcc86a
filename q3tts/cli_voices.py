"""What `q3tts voices` talks to: a running server's voice store (HTTP) or a voice directory used directly."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


class ServerVoices:
    """The voice store of a running `q3tts serve` (/v1/audio/voices), as the web page uses it."""

    def __init__(self, url: str, api_key: str | None):
        import httpx
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url, self.http = url.rstrip("/"), httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=300)

    def _call(self, method: str, path: str, **kw):
        import httpx
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach the server at {self.url} ({e}); start one with `q3tts serve`, or use "
                             "--voice-dir DIR --model M for a local voice directory") from None
        if r.status_code >= 400:
            try:
                msg = r.json()["error"]["message"]
            except Exception:
                msg = r.text[:200]
            raise ValueError(f"server: {msg}")
        return r.json()

    def list(self) -> list[dict]:
        return self._call("GET", "/v1/audio/voices")["data"]

    def add(self, name: str, audio: bytes, filename: str, ref_text: str | None, xvec: bool) -> dict:
        data = {"name": name, "x_vector_only_mode": "true" if xvec else "false"}
        if ref_text:
            data["ref_text"] = ref_text
        return self._call("POST", "/v1/audio/voices", data=data, files={"audio_sample": (filename, audio)})

    def delete(self, key: str) -> dict:
        return self._call("DELETE", f"/v1/audio/voices/{key}")


class LocalVoices:
    """A voice directory used directly (the server's store: one safetensors file per voice + an SQLite index)."""

    def __init__(self, voice_dir: str, tts):
        from .server.voices import VoiceService
        self.service = VoiceService(tts, voice_dir, max_upload_bytes=64 * 1024 * 1024)

    def _call(self, fn, *args):
        from .server.protocol import ApiError
        try:
            return fn(*args)
        except ApiError as e:
            raise ValueError(str(e)) from None

    def list(self) -> list[dict]:
        return [v.model_dump() for v in self._call(self.service.list)]

    def add(self, name: str, audio: bytes, filename: str, ref_text: str | None, xvec: bool) -> dict:
        import asyncio
        return self._call(lambda: asyncio.run(self.service.create(name, audio, ref_text, xvec))).model_dump()

    def delete(self, key: str) -> dict:
        return self._call(self.service.delete, key).model_dump()


def run(a, load) -> int:
    """`q3tts voices list | add | delete`: on a running server, or on a voice directory (the model from load(a))."""
    if a.voice_dir:
        if not a.model:
            raise ValueError("--voice-dir needs --model: the Base model the voices are made for")
        store = LocalVoices(a.voice_dir, load(a))
    else:
        store = ServerVoices(a.server, a.api_key)
    if a.action == "list":
        voices = store.list()
        if a.json:
            print(json.dumps(voices, indent=1))
        elif not voices:
            print("(no voices)", file=sys.stderr)
        for v in voices if not a.json else []:
            ref = v.get("ref_text") or ""
            ref = f"  \"{ref[:40]}{'…' if len(ref) > 40 else ''}\"" if ref else ""
            print(f"{v['id']}\t{v['name']}\t{v.get('mode', '')}{ref}")
        return 0
    if a.action == "add":
        ref_text = Path(a.ref_text_file).read_text(encoding="utf-8").strip() if a.ref_text_file else a.ref_text
        audio = Path(a.ref_audio).read_bytes()
        v = store.add(a.name, audio, os.path.basename(a.ref_audio), ref_text, a.x_vector_only)
        print(f"added {v['name']} ({v['id']}, {v['mode']})", file=sys.stderr)
        print(v["id"])
        return 0
    v = store.delete(a.name)
    print(f"deleted {v['id']}", file=sys.stderr)
    return 0
