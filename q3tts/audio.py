"""Reference-audio input (voice cloning) and WAV output.

Input, accepted wherever a reference is taken:
  - a file path (str or os.PathLike), unless allow_paths=False (a server should pass False)
  - raw bytes of an audio file (bytes, bytearray, memoryview)
  - a base64 string, or a data URL ("data:audio/wav;base64,...")
  - an http(s) URL, fetched only when allow_urls=True (never by default: a server must not fetch
    arbitrary URLs for its clients)
  - a `(waveform, sample_rate)` tuple; the waveform a numpy array or torch tensor, [N] or 2-D with a
    channel axis; integer PCM is scaled to [-1, 1]
Decoding is libsndfile through `soundfile` (WAV, FLAC, OGG/Vorbis, OGG/Opus, MP3, AIFF, ...), the
library upstream reads with. Multi-channel audio is mixed to mono by the mean over channels, as upstream.
Resampling is `soxr` at quality "soxr_hq" followed by librosa's length fix (ceil(N * ratio) samples):
exactly what upstream's `librosa.resample(y, orig_sr=sr, target_sr=24000)` computes, without librosa.

Validation (`AudioLimits`, all configurable) raises ValueError naming the problem: undecodable data,
too many bytes, a header that states no length, more than 2 channels, a rate past 192 kHz or a duration past
max_seconds (all refused from the header, before decoding; decoding then reads blocks under that bound),
NaN/inf samples, shorter than min_seconds (1 s) or longer than max_seconds (60 s), silent (RMS below min_rms,
-80 dBFS by default).
"""

from __future__ import annotations

import base64
import io
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import numpy as np

TARGET_SR = 24000
RESAMPLE_QUALITY = "soxr_hq"  # librosa.resample's default res_type


@dataclass(slots=True)
class AudioLimits:
    """What a reference clip may be; every check raises ValueError with the reason."""

    min_seconds: float = 1.0  # shorter clips give a poor x-vector and almost no ICL context
    max_seconds: float = 60.0  # longer clips cost prefill time and memory, with no gain in similarity
    max_bytes: int = 50 * 1024 * 1024  # encoded input (file, bytes, base64 payload, URL body)
    max_channels: int = 2  # mono or stereo; more is refused from the header, before decoding
    max_sample_rate: int = 192_000  # Hz; with max_seconds and max_channels it bounds the decoded samples
    min_rms: float = 1e-4  # -80 dBFS: below this the clip is taken as silent


DEFAULT_LIMITS = AudioLimits()
_B64_RE = re.compile(r"^[A-Za-z0-9+/_\-\s]+={0,2}\s*$")


# --------------------------------------------------------------------------- decoding
def _soundfile():
    try:
        import soundfile
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("reading reference audio needs the 'soundfile' package: pip install soundfile") from e
    return soundfile


def _decode(src, limits: AudioLimits, what: str, name: str) -> tuple[np.ndarray, int]:
    """Decode an open-able source (a path or a file object) under the limits -> (float32 [N] or [N, C], rate).

    The header is read first: a length the file does not state, more than max_channels channels, a rate past
    max_sample_rate or a duration past max_seconds are refused before a sample is decoded (a few hundred KB of
    FLAC can hold an hour of 8-channel audio). Samples are then read in blocks, and reading stops once the
    stated length plus one block, or max_seconds plus one second, is passed (a header that lies)."""
    sf = _soundfile()
    try:
        f = sf.SoundFile(src)
    except Exception as e:
        raise ValueError(f"{what}: could not decode {name}: {type(e).__name__}: {e}. "
                         "Supported: WAV, FLAC, OGG (Vorbis/Opus), MP3, AIFF.") from e
    with f:
        sr, channels, frames = int(f.samplerate), int(f.channels), int(f.frames)
        if not 0 < sr <= limits.max_sample_rate:
            raise ValueError(f"{what}: sample rate {sr} Hz; at most {limits.max_sample_rate} Hz (max_sample_rate)")
        if channels > limits.max_channels:
            raise ValueError(f"{what}: {channels} channels; a reference clip has at most {limits.max_channels} "
                             "(mono or stereo, max_channels)")
        if frames < 0 or frames >= 1 << 62:  # libsndfile's "unknown" (SF_COUNT_MAX), e.g. a streamed FLAC
            raise ValueError(f"{what}: {name} does not state its length (a recording saved while streaming?); "
                             "save it again as a complete WAV or FLAC file")
        budget = int((limits.max_seconds + 1) * sr)  # frames: the exact max_seconds check is validate_audio's
        if frames > budget:
            raise ValueError(f"{what}: {frames / sr:.1f} s is too long; at most {limits.max_seconds:g} s "
                             "(max_seconds). Trim it: 3-15 s of clean speech is plenty")
        blocks, total, block = [], 0, 1 << 16
        try:
            while True:
                b = f.read(block, dtype="float32", always_2d=True)  # [n <= block, C]
                if b.shape[0] == 0:
                    break
                blocks.append(b)
                total += b.shape[0]
                if total > min(budget, frames + block):
                    raise ValueError(f"{what}: {name} holds more audio than its header states, or more than "
                                     f"max_seconds={limits.max_seconds:g}")
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"{what}: could not decode {name}: {type(e).__name__}: {e}") from e
    wav = np.concatenate(blocks) if blocks else np.zeros((0, channels), np.float32)
    return (wav[:, 0] if channels == 1 else wav), sr


def decode_bytes(data: bytes, what: str = "reference audio",
                 limits: AudioLimits | None = None) -> tuple[np.ndarray, int]:
    """An encoded audio file in memory -> (float32 [N] or [N, C], sample rate), bounded by the limits (see _decode)."""
    head = bytes(data[:12])
    with io.BytesIO(data) as f:
        return _decode(f, limits or DEFAULT_LIMITS, what, f"the audio data ({len(data)} bytes, starting {head!r})")


def _read_path(path: str, limits: AudioLimits, what: str) -> tuple[np.ndarray, int]:
    if not os.path.isfile(path):
        raise ValueError(f"{what}: no such file: {path!r}")
    size = os.path.getsize(path)
    if size > limits.max_bytes:
        raise ValueError(f"{what}: file {path!r} is {size} bytes, more than max_bytes={limits.max_bytes}")
    return _decode(path, limits, what, repr(path))


def _fetch_url(url: str, limits: AudioLimits, what: str, timeout: float) -> bytes:
    import urllib.request
    req = urllib.request.Request(url, headers={"User-Agent": "q3tts"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = resp.read(limits.max_bytes + 1)
    except Exception as e:
        raise ValueError(f"{what}: could not fetch {url!r}: {type(e).__name__}: {e}") from e
    if len(data) > limits.max_bytes:
        raise ValueError(f"{what}: {url!r} is more than max_bytes={limits.max_bytes} bytes")
    return data


class Base64TooLarge(ValueError):
    """decode_base64's refusal, before decoding, of data that would decode to more than its max_bytes."""

    def __init__(self, size: int, max_bytes: int):
        super().__init__(f"base64 input decodes to about {size} bytes, more than {max_bytes}")
        self.size, self.max_bytes = size, max_bytes


def decode_base64(s: str, max_bytes: int | None = None) -> bytes:
    """Base64 text or a data URL ("data:audio/wav;base64,...") -> bytes. Whitespace is ignored, the URL-safe
    alphabet ('-', '_') is accepted and padding may be left out.

    Raises Base64TooLarge (before decoding) where the payload would decode to more than max_bytes bytes
    (estimated as 3/4 of its length), ValueError (binascii.Error) where it is not base64."""
    payload = s.split(",", 1)[1] if s.startswith("data:") else s
    payload = re.sub(r"\s+", "", payload)
    if max_bytes is not None and len(payload) * 3 // 4 > max_bytes:
        raise Base64TooLarge(len(payload) * 3 // 4, max_bytes)
    padding = "=" * (-len(payload) % 4)
    if "-" in payload or "_" in payload:
        return base64.urlsafe_b64decode(payload + padding)
    return base64.b64decode(payload + padding, validate=True)


def _b64decode(s: str, limits: AudioLimits, what: str) -> bytes:
    # the size estimate counts the payload as given, whitespace included (stricter than decode_base64's)
    size = len(s.split(",", 1)[1] if s.startswith("data:") else s) * 3 // 4
    if size > limits.max_bytes:
        raise ValueError(f"{what}: base64 input decodes to about {size} bytes, more than max_bytes={limits.max_bytes}")
    try:
        return decode_base64(s)
    except ValueError as e:  # binascii.Error included
        raise ValueError(f"{what}: invalid base64 data: {e}") from e


def _is_url(s: str) -> bool:
    try:
        u = urlparse(s)
    except ValueError:
        return False
    return u.scheme in ("http", "https") and bool(u.netloc)


def _array_input(x: Any, sr: Any, what: str) -> tuple[np.ndarray, int]:
    if hasattr(x, "detach"):  # torch.Tensor: integer PCM keeps its dtype, to be scaled below as numpy's is
        import torch
        x = x.detach().cpu()
        integer = not (x.is_floating_point() or x.is_complex()) and x.dtype != torch.bool
        x = (x if integer else x.float()).numpy()
    a = np.asarray(x)
    if a.dtype.kind in "iu":  # integer PCM -> [-1, 1)
        info = np.iinfo(a.dtype)
        if a.dtype.kind == "u":
            a = (a.astype(np.float64) - (info.max + 1) / 2) / ((info.max + 1) / 2)
        else:
            a = a.astype(np.float64) / (-float(info.min))
    elif a.dtype.kind != "f":
        raise ValueError(f"{what}: waveform must be a float or integer array, got dtype {a.dtype}")
    if a.ndim not in (1, 2):
        raise ValueError(f"{what}: waveform must be 1-D [samples] or 2-D with a channel axis, got shape {a.shape}")
    try:
        sr = int(sr)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: sample rate must be an integer, got {sr!r}") from None
    return a.astype(np.float32), sr


def to_mono(wav: np.ndarray) -> np.ndarray:
    """[N] as is; 2-D: mean over the channel axis, taken as the smaller one ([N, C] from soundfile, or
    [C, N] as torch audio uses), as upstream's np.mean(..., axis=-1) for [N, C]."""
    if wav.ndim == 1:
        return wav
    axis = 0 if wav.shape[0] < wav.shape[1] else 1
    return np.mean(wav, axis=axis).astype(np.float32)


def load_audio(src: Any, *, allow_urls: bool = False, allow_paths: bool = True,
               limits: AudioLimits | None = None, what: str = "reference audio",
               url_timeout: float = 10.0) -> tuple[np.ndarray, int]:
    """Read and validate one reference clip -> (mono float32 waveform [N], original sample rate).

    Args:
        src: a path, bytes, a base64 string or data URL, an http(s) URL (allow_urls=True only) or a
            (waveform, sample_rate) tuple. A bare array without its rate is refused, as upstream.
        allow_urls: fetch http(s) URLs (off by default: a server must not fetch arbitrary URLs).
        allow_paths: read local files (a server taking client input should pass False).
        limits: AudioLimits; defaults: 1 s to 60 s, 50 MiB, not silent.
        what: how the clip is named in error messages (e.g. "ref_audio[2]").
    """
    limits = limits or DEFAULT_LIMITS
    if isinstance(src, tuple):
        if len(src) != 2:
            raise ValueError(f"{what}: a tuple must be (waveform, sample_rate), got {len(src)} items")
        wav, sr = _array_input(src[0], src[1], what)
    elif isinstance(src, (bytes, bytearray, memoryview)):
        if len(src) > limits.max_bytes:
            raise ValueError(f"{what}: {len(src)} bytes of audio, more than max_bytes={limits.max_bytes}")
        wav, sr = decode_bytes(bytes(src), what, limits)
    elif isinstance(src, (str, os.PathLike)):
        s = os.fspath(src)
        if isinstance(s, bytes):
            s = s.decode()
        if s.startswith("data:"):
            wav, sr = decode_bytes(_b64decode(s, limits, what), what, limits)
        elif _is_url(s):
            if not allow_urls:
                raise ValueError(f"{what}: {s[:100]!r} is a URL; URLs are fetched only with allow_urls=True "
                                 "(download it yourself, or pass its bytes)")
            wav, sr = decode_bytes(_fetch_url(s, limits, what, url_timeout), what, limits)
        elif allow_paths and (isinstance(src, os.PathLike) or os.path.exists(s)):
            wav, sr = _read_path(s, limits, what)
        elif len(s) >= 64 and _B64_RE.match(s):
            wav, sr = decode_bytes(_b64decode(s, limits, what), what, limits)
        elif allow_paths:
            raise ValueError(f"{what}: no such file: {s[:200]!r} (nor is it base64 audio or a data URL)")
        else:
            raise ValueError(f"{what}: expected audio bytes, base64 or a data URL (file paths are not allowed here)")
    elif isinstance(src, np.ndarray) or hasattr(src, "detach"):
        raise ValueError(f"{what}: for a waveform, pass a tuple (waveform, sample_rate)")
    else:
        raise ValueError(f"{what}: unsupported input type {type(src).__name__}; expected a path, bytes, base64, "
                         "a data URL or a (waveform, sample_rate) tuple")
    wav = to_mono(np.asarray(wav, dtype=np.float32))
    validate_audio(wav, sr, limits, what)
    return wav, sr


def validate_audio(wav: np.ndarray, sr: int, limits: AudioLimits | None = None, what: str = "reference audio") -> None:
    """Raise ValueError if the clip is unusable: bad rate, NaN/inf, too short/long, silent."""
    limits = limits or DEFAULT_LIMITS
    if sr <= 0:
        raise ValueError(f"{what}: sample rate must be positive, got {sr}")
    if wav.size == 0:
        raise ValueError(f"{what}: the audio is empty (0 samples)")
    finite = np.isfinite(wav)
    if not finite.all():
        bad = int(wav.size - finite.sum())
        raise ValueError(f"{what}: {bad} of {wav.size} samples are NaN or infinite (a broken decode or an "
                         "overflowed conversion); fix the audio before cloning")
    seconds = wav.shape[0] / sr
    if seconds < limits.min_seconds:
        raise ValueError(f"{what}: {seconds:.2f} s is too short; a reference needs at least "
                         f"{limits.min_seconds:g} s (min_seconds), ideally 3-15 s of clean speech")
    if seconds > limits.max_seconds:
        raise ValueError(f"{what}: {seconds:.1f} s is too long; at most {limits.max_seconds:g} s (max_seconds). "
                         "Trim it: 3-15 s of clean speech is plenty")
    rms = float(np.sqrt(np.mean(np.square(wav, dtype=np.float64))))
    if rms < limits.min_rms:
        db = 20 * math.log10(rms) if rms > 0 else float("-inf")
        raise ValueError(f"{what}: the audio is silent (RMS {db:.1f} dBFS, below {20 * math.log10(limits.min_rms):.0f} "
                         "dBFS, min_rms); check the recording")


# --------------------------------------------------------------------------- resampling
def resampled_length(num_samples: int, orig_sr: int, target_sr: int = TARGET_SR) -> int:
    """Samples resample() returns for num_samples at orig_sr. NOTE(resample-length): librosa's float expression,
    ceil(N * (target / orig)) (22050 -> 24000 rounds up)."""
    return int(np.ceil(num_samples * (float(target_sr) / orig_sr)))


def resample(wav: np.ndarray, orig_sr: int, target_sr: int = TARGET_SR) -> np.ndarray:
    """Band-limited resampling, identical to `librosa.resample(wav, orig_sr=, target_sr=)` (librosa 0.11
    defaults: soxr "soxr_hq", then fixed to ceil(N * target / orig) samples). float32 in, float32 out."""
    wav = np.asarray(wav, dtype=np.float32)
    if orig_sr == target_sr:
        return wav
    try:
        import soxr
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("resampling needs the 'soxr' package: pip install soxr") from e
    n = resampled_length(wav.shape[-1], orig_sr, target_sr)
    y = soxr.resample(wav, orig_sr, target_sr, quality=RESAMPLE_QUALITY)
    if y.shape[-1] > n:
        y = y[..., :n]
    elif y.shape[-1] < n:
        y = np.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, n - y.shape[-1])])
    return np.asarray(y, dtype=np.float32)


# --------------------------------------------------------------------------- output
def to_s16(audio: np.ndarray) -> np.ndarray:
    """float samples in [-1, 1] -> 16-bit PCM, little-endian int16 (NaN -> 0, clipped, rounded half to even).
    In place on one temporary: the server converts every chunk of every stream on its event loop."""
    x = np.clip(audio, -1.0, 1.0) * 32767.0
    x[np.isnan(x)] = 0.0
    return np.rint(x, out=x).astype("<i2")


def wav_header(sample_rate: int, data_bytes: int | None, channels: int = 1) -> bytes:
    """The 44-byte RIFF/WAVE header of 16-bit PCM; data_bytes None: a stream of unknown length (RIFF and data
    sizes 0xFFFFFFFF, "until the end of the stream")."""
    riff, data = (0xFFFFFFFF, 0xFFFFFFFF) if data_bytes is None else (36 + data_bytes, data_bytes)
    block = channels * 2
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, 16) +
            b"data" + struct.pack("<I", data))


def wav_bytes(wav: np.ndarray, sr: int) -> bytes:
    """float waveform [N] (or [N, C]) in [-1, 1] -> 16-bit PCM WAV file bytes (clipped, rounded)."""
    a = np.asarray(wav, dtype=np.float32)
    pcm = to_s16(a).tobytes()
    return wav_header(int(sr), len(pcm), 1 if a.ndim == 1 else a.shape[1]) + pcm


def write_wav(path: str | os.PathLike, wav: np.ndarray, sr: int) -> None:
    """Write a float waveform as a 16-bit PCM WAV file (stdlib only)."""
    with open(path, "wb") as f:
        f.write(wav_bytes(wav, sr))
