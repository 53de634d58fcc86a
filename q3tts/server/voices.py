"""Voices: what `voice` may name, and the store of cloned voices (Base models).

CustomVoice models: the built-in speakers are the voices (listed, not deletable, nothing to upload).
VoiceDesign models: no voices (the voice is described in `instructions`).
Base models: uploaded reference clips are cloned once (speaker encoder + codec encoder) and stored as
one voice file each (`<id>.safetensors`, q3tts.inputs.voice.Voice's format) plus a row in an SQLite index
(`voices.sqlite3`) in the voice directory, so they survive restarts. A voice is named by its id
(`voice_<16 hex>`) or its name (unique per model size); only voices made for this model's size are shown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import re
import secrets
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from q3tts.audio import Base64TooLarge, decode_base64
from q3tts.inputs.voice import Voice

from .protocol import ApiError, VoiceDeleted, VoiceObject

log = logging.getLogger("q3tts.server")

NAME_RE = re.compile(r"^[\w][\w .\-]{0,63}$")
ID_RE = re.compile(r"^voice_[0-9a-f]{16}$")


# --------------------------------------------------------------------------- the store
@dataclass(slots=True)
class VoiceRecord:
    id: str
    name: str
    created_at: int  # unix seconds
    mode: str  # "icl" | "x_vector"
    ref_text: str | None
    model_size: str  # "0b6" | "1b7"
    file: str  # file name inside the voice directory

    def to_object(self) -> VoiceObject:
        return VoiceObject(id=self.id, name=self.name, created_at=self.created_at, type="audio_sample",
                           mode=self.mode, ref_text=self.ref_text, model_size=self.model_size, deletable=True)


_SCHEMA = """CREATE TABLE IF NOT EXISTS voices (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, created_at INTEGER NOT NULL, mode TEXT NOT NULL,
    ref_text TEXT, model_size TEXT NOT NULL, file TEXT NOT NULL, UNIQUE (name, model_size))"""
_COLS = "id, name, created_at, mode, ref_text, model_size, file"


class VoiceStore:
    """Voice files + an SQLite index in one directory. Thread-safe (one connection per call)."""

    def __init__(self, root: str | os.PathLike, cfg):
        self.root, self.cfg = Path(root), cfg
        self.root.mkdir(parents=True, exist_ok=True)
        self.db = self.root / "voices.sqlite3"
        self._lock = threading.Lock()
        self._loaded: dict[str, object] = {}  # id -> Voice, loaded on first use
        with self._connect() as c:
            c.execute(_SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.db, timeout=10)

    def _rows(self, where: str = "", args: tuple = ()) -> list[VoiceRecord]:
        with self._lock, self._connect() as c:
            rows = c.execute(f"SELECT {_COLS} FROM voices WHERE model_size = ? {where} ORDER BY created_at, id",
                             (self.cfg.tts_model_size, *args)).fetchall()
        return [VoiceRecord(*r) for r in rows if (self.root / r[6]).exists()]

    def list(self) -> list[VoiceRecord]:
        return self._rows()

    def find(self, key: str) -> VoiceRecord | None:
        """By id, else by name."""
        rows = self._rows("AND (id = ? OR name = ?)", (key, key))
        return next((r for r in rows if r.id == key), rows[0] if rows else None)

    def add(self, name: str, voice) -> VoiceRecord:
        """Write the voice file, then index it; ValueError if the name is taken."""
        rec = VoiceRecord(id=f"voice_{secrets.token_hex(8)}", name=name, created_at=int(time.time()),
                          mode="icl" if voice.icl else "x_vector", ref_text=voice.ref_text, model_size=self.cfg.tts_model_size, file="")
        rec.file = f"{rec.id}.safetensors"
        tmp = self.root / f".{rec.file}.tmp"
        voice.save(tmp)
        os.replace(tmp, self.root / rec.file)
        try:
            with self._lock, self._connect() as c:
                c.execute(f"INSERT INTO voices ({_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                          (rec.id, rec.name, rec.created_at, rec.mode, rec.ref_text, rec.model_size, rec.file))
        except sqlite3.IntegrityError:
            (self.root / rec.file).unlink(missing_ok=True)
            raise ValueError(f"a voice named {name!r} already exists") from None
        self._loaded[rec.id] = voice
        return rec

    def delete(self, voice_id: str) -> bool:
        with self._lock, self._connect() as c:
            row = c.execute("SELECT file FROM voices WHERE id = ?", (voice_id,)).fetchone()
            if row is None:
                return False
            c.execute("DELETE FROM voices WHERE id = ?", (voice_id,))
        (self.root / row[0]).unlink(missing_ok=True)
        self._loaded.pop(voice_id, None)
        return True

    def voice(self, rec: VoiceRecord):
        v = self._loaded.get(rec.id)
        if v is None:
            v = self._loaded[rec.id] = Voice.load(self.root / rec.file, model=self.cfg)
        return v


# --------------------------------------------------------------------------- the service
# "scheme://...": a URL, never base64 (whose alphabet has no ':'); data: URLs have no "//" and are decoded
URL_RE = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.\-]*://")


def check_not_url(s: str, param: str) -> None:
    """400 for an http(s):// (or any scheme://) reference: this server never fetches (no SSRF, no slow or
    huge downloads holding a request), and saying so beats a base64 decoding error."""
    if URL_RE.match(s):
        raise ApiError(400, f"{param}: URLs are not fetched by this server: send the clip as base64 or a data URL "
                       "(data:audio/wav;base64,...)", param=param, code="url_not_supported")


def decode_base64_audio(s: str, max_bytes: int, param: str) -> bytes:
    """base64 or a data URL -> bytes; 413 past max_bytes, 400 if a URL or not base64."""
    check_not_url(s, param)
    try:
        return decode_base64(s, max_bytes + 2)  # + 2: the estimate counts up to 2 bytes of padding
    except Base64TooLarge as e:
        raise ApiError(413, f"{param}: about {e.size} bytes of audio, more than this server's limit of {max_bytes} "
                       "bytes (--max-upload-bytes)", param=param, code="upload_too_large") from None
    except ValueError:  # binascii.Error included
        raise ApiError(400, f"{param}: not valid base64 (give the audio file's bytes as base64 or a data URL "
                       "like data:audio/wav;base64,...)", param=param, code="invalid_base64") from None


class CloneQueue:
    """Cloning work (a reference through the speaker and codec encoders: up to seconds of CPU each) runs on a
    small pool of threads, and at most `max_waiting` more jobs wait for one; past that a 503 with Retry-After,
    rather than a thread per request. A job counts until its thread is done with it (a client that leaves does
    not free its place while its clone still runs); a job that has not started is dropped when its caller is
    cancelled."""

    def __init__(self, workers: int = 2, max_waiting: int = 16):
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="q3tts-clone")
        self.limit = workers + max_waiting
        self.pending = 0  # jobs running or waiting; changed on the event loop only

    async def run(self, fn, *args):
        if self.pending >= self.limit:
            raise ApiError(503, f"{self.pending} voice clones are running or waiting, this server's limit "
                           "(--clone-workers + --clone-queue); retry shortly", type="server_busy",
                           code="clone_queue_full", headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()
        self.pending += 1
        job = self.pool.submit(fn, *args)
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        try:
            return await asyncio.wrap_future(job)
        finally:
            job.cancel()  # a no-op once started

    def _done(self) -> None:
        self.pending -= 1


class VoiceService:
    """What the voice endpoints and the speech endpoint ask about voices."""

    def __init__(self, tts, voice_dir: str | os.PathLike, max_upload_bytes: int, clone_workers: int = 2,
                 clone_queue: int = 16):
        self.tts, self.max_upload_bytes = tts, max_upload_bytes
        self.clones = CloneQueue(clone_workers, clone_queue)
        self.model_type = tts.cfg.tts_model_type
        self.store = VoiceStore(voice_dir, tts.cfg) if self.model_type == "base" else None
        self._inline: OrderedDict[str, object] = OrderedDict()  # recent inline references (LRU)

    # ---- listing and lookup
    def builtin(self) -> list[str]:
        return list(self.tts.get_supported_speakers() or []) if self.model_type == "custom_voice" else []

    def list(self) -> list[VoiceObject]:
        if self.store is not None:
            return [r.to_object() for r in self.store.list()]
        return [VoiceObject(id=s, name=s, created_at=0, type="builtin") for s in self.builtin()]

    def get(self, voice_id: str) -> VoiceObject:
        for v in self.list():
            if v.id == voice_id or v.name == voice_id:
                return v
        raise _not_found(voice_id)

    def names_hint(self) -> str:
        if self.store is None:
            return ", ".join(self.builtin()) or "(none)"
        recs = self.store.list()
        return ", ".join(f"{r.name} ({r.id})" for r in recs) if recs else "(none stored yet)"

    def prompt_item(self, key: str, x_vector_only_mode: bool):
        """A stored voice (id or name) -> VoiceClonePromptItem; 400 listing the voices if unknown."""
        rec = self.store.find(key)
        if rec is None:
            raise ApiError(400, f"unknown voice {key!r}. Stored voices: {self.names_hint()}. Upload one with "
                           "POST /v1/audio/voices, or pass ref_audio (+ ref_text) in the request",
                           param="voice", code="voice_not_found")
        try:
            return self.store.voice(rec).to_prompt_item(True if x_vector_only_mode else None)
        except ValueError as e:
            raise ApiError(400, f"voice {key!r}: {e}", param="voice") from e

    # ---- cloning
    def _clone(self, audio: bytes, ref_text: str | None, xvec: bool, name: str | None = None) -> Voice:
        """Reference clip bytes (their size already checked where they came in) -> a Voice."""
        try:
            return self.tts.voice_cloner().create_voice(audio, ref_text=ref_text or None, x_vector_only_mode=xvec,
                                                        name=name, allow_paths=False, allow_urls=False)
        except ValueError as e:
            raise ApiError(400, str(e), param="ref_audio", code="invalid_reference") from e

    def inline_prompt_item(self, ref_audio: str, ref_text: str | None, xvec: bool):
        """A request's own reference (base64 / data URL), cloned; recent ones are cached. Called for Base models
        only, in a clone thread (serving.prepare's Base branch): the cache takes only single dict operations."""
        audio = decode_base64_audio(ref_audio, self.max_upload_bytes, "ref_audio")
        key = hashlib.sha256(audio + b"\0" + (ref_text or "").encode() + (b"x" if xvec else b"i")).hexdigest()
        voice = self._inline.pop(key, None) or self._clone(audio, ref_text, xvec)
        self._inline[key] = voice  # (again) the most recent
        while len(self._inline) > 32:
            self._inline.popitem(last=False)
        return voice.to_prompt_item(True if xvec else None)

    async def create(self, name: str, audio: bytes, ref_text: str | None, xvec: bool) -> VoiceObject:
        if self.store is None:
            what = ("its voices are the built-in speakers: " + ", ".join(self.builtin())
                    if self.model_type == "custom_voice" else "describe the voice in `instructions` instead")
            raise ApiError(400, f"voice cloning needs a Base model; this server runs a {self.model_type} model "
                           f"({what})", param="voice", code="unsupported_for_model")
        name = (name or "").strip()
        if not NAME_RE.match(name) or ID_RE.match(name):
            raise ApiError(400, f"invalid voice name {name!r}: 1-64 letters, digits, spaces, '_', '.', '-' "
                           "(and not of the form voice_<hex>)", param="name", code="invalid_name")
        if self.store.find(name) is not None:
            raise ApiError(409, f"a voice named {name!r} already exists; delete it first or pick another name",
                           param="name", code="voice_exists")
        voice = await self.clones.run(self._clone, audio, ref_text, xvec, name)
        try:
            return self.store.add(name, voice).to_object()
        except ValueError as e:
            raise ApiError(409, str(e), param="name", code="voice_exists") from e

    def delete(self, voice_id: str) -> VoiceDeleted:
        if self.store is None:
            if voice_id in self.builtin():
                raise ApiError(400, f"{voice_id!r} is a built-in speaker of this model and cannot be deleted",
                               param="voice_id", code="voice_not_deletable")
            raise _not_found(voice_id)
        rec = self.store.find(voice_id)
        if rec is None or not self.store.delete(rec.id):
            raise _not_found(voice_id)
        return VoiceDeleted(id=rec.id)


def _not_found(voice_id: str) -> ApiError:
    return ApiError(404, f"no voice {voice_id!r}", type="not_found_error", param="voice_id", code="voice_not_found")
