"""Reference-audio input: every accepted form gives the same waveform; every bad clip is refused with a
message that says why; WAV output."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from q3tts.audio import (
    AudioLimits,
    Base64TooLarge,
    decode_base64,
    load_audio,
    resample,
    to_mono,
    to_s16,
)

CLIPS = Path(__file__).resolve().parent / "golden" / "fixtures_voice" / "clips"


def tone(seconds: float = 2.0, sr: int = 16000, amp: float = 0.3, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    x = (amp * np.sin(2 * np.pi * 220 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    return x if channels == 1 else np.stack([x, 0.5 * x], axis=1)


def encode(x: np.ndarray, sr: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


# --------------------------------------------------------------------------- accepted inputs
@pytest.mark.parametrize("name,sr,channels", [
    ("es16m.wav", 16000, 1), ("sy16s.flac", 16000, 2), ("es22s.flac", 22050, 2),
    ("sy48m.wav", 48000, 1), ("es24m.mp3", 24000, 1), ("sy48s.ogg", 48000, 2)])
def test_formats_decode(name, sr, channels):
    """WAV (16-bit, float), FLAC, MP3, OGG/Opus; stereo is averaged to mono."""
    wav, got_sr = load_audio(CLIPS / name)
    assert got_sr == sr and wav.dtype == np.float32 and wav.ndim == 1
    assert abs(len(wav) / sr - 1.3) < 0.01
    raw, _ = sf.read(str(CLIPS / name), dtype="float32", always_2d=True)
    # lossy decoders (mpg123) may differ in the last bit between read calls; the stereo mean is one float32
    # add and halving (<= 1 ulp); |x| < 1 so an ulp is <= 2^-24 and 1e-6 is ~16 ulps of decoder slack
    np.testing.assert_allclose(wav, raw.mean(axis=1) if channels == 2 else raw[:, 0], rtol=0, atol=1e-6)


def test_every_input_form_gives_the_same_waveform():
    path = CLIPS / "es22s.flac"
    data = path.read_bytes()
    ref, sr = load_audio(str(path))
    stereo, _ = sf.read(str(path), dtype="float32")
    b64 = base64.b64encode(data).decode()
    forms = {
        "str path": str(path), "Path": path, "bytes": data, "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "base64": b64, "base64 with newlines": "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)),
        "data URL": "data:audio/flac;base64," + b64, "urlsafe base64": base64.urlsafe_b64encode(data).decode(),
        "tuple [N, C]": (stereo, sr), "tuple [C, N]": (stereo.T.copy(), sr),
        "tuple torch": (torch.from_numpy(stereo), sr),
        "tuple float64": (stereo.astype(np.float64), np.int64(sr)),
    }
    for what, src in forms.items():
        wav, got_sr = load_audio(src)
        assert got_sr == sr, what
        # the same bytes through the same decoder; the array forms are the float32 samples (float64 -> float32
        # rounds to the same values), averaged as stereo: <= 1 ulp of |x| < 0.5, i.e. <= 2^-25 < 1e-7
        np.testing.assert_allclose(wav, ref, atol=1e-7, err_msg=what)


def test_integer_pcm_tuples_are_scaled():
    x = tone()
    i16 = np.round(x * 32767).astype(np.int16)
    wav, _ = load_audio((i16, 16000))
    # quantisation, not rounding: round(x * 32767) / 32768 differs from x by <= 0.5/32768 (rounding) +
    # |x|/32768 (scale 32767 vs 32768) <= (0.5 + 0.39)/32768 = 2.7e-5 for this tone (|x| <= 0.39)
    np.testing.assert_allclose(wav, x, atol=1e-4)
    u8 = np.round(x * 127 + 128).astype(np.uint8)
    wav, _ = load_audio((u8, 16000))
    # likewise for 8 bits: <= (0.5 + |x|)/128 <= 0.89/128 = 7e-3
    np.testing.assert_allclose(wav, x, atol=1e-2)


def test_integer_pcm_torch_tensors_are_scaled_as_numpy_arrays():
    i16 = np.tile(np.array([16384, -16384], np.int16), 8000)  # 1 s at 16 kHz
    wav, _ = load_audio((torch.from_numpy(i16), 16000))
    np.testing.assert_array_equal(wav, np.tile(np.array([0.5, -0.5], np.float32), 8000))
    x = tone()
    for a in (np.round(x * 32767).astype(np.int16), np.round(x * 127 + 128).astype(np.uint8)):
        ref, _ = load_audio((a, 16000))
        wav, _ = load_audio((torch.from_numpy(a), 16000))
        np.testing.assert_array_equal(wav, ref, err_msg=str(a.dtype))


def test_to_mono_takes_the_channel_axis():
    x = tone(channels=2)
    np.testing.assert_array_equal(to_mono(x), to_mono(x.T.copy()))
    # (x + 0.5 x) / 2 vs 0.75 x in float32: two roundings of values < 0.4, <= 2 ulps = 2^-24 < 1e-7
    np.testing.assert_allclose(to_mono(x), 0.75 * x[:, 0], atol=1e-7)


def test_resample_lengths_and_identity():
    x = tone(1.3, 22050)
    assert resample(x, 22050, 24000).shape[0] == 31201  # librosa: ceil(N * (24000 / 22050)) in float
    assert resample(x, 24000, 24000) is not None and np.array_equal(resample(x, 24000, 24000), x)
    y = resample(*load_audio((tone(2.0, 48000), 48000)), 24000)
    assert y.shape == (48000,) and y.dtype == np.float32
    # band-limited: a 220 Hz tone keeps its level (soxr_hq's passband ripple is < 0.01 dB, i.e. < 1.2e-3
    # relative, times a peak of 0.39 = 4.5e-4 < 1e-3; the peak sample also moves with the new sampling grid by
    # at most 1 - cos(pi * 220 / 24000) of it = 1.6e-4)
    assert abs(np.abs(y[4000:-4000]).max() - np.abs(tone(2.0, 48000)).max()) < 1e-3


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


def test_urls_only_with_allow_urls():
    _Handler.body = encode(tone(), 16000)
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{srv.server_port}/ref.wav"
        with pytest.raises(ValueError, match="URL; URLs are fetched only with allow_urls=True"):
            load_audio(url)
        wav, sr = load_audio(url, allow_urls=True)
        assert sr == 16000 and len(wav) == 32000
        with pytest.raises(ValueError, match="more than max_bytes"):
            load_audio(url, allow_urls=True, limits=AudioLimits(max_bytes=1000))
    finally:
        srv.shutdown()
        srv.server_close()


def test_paths_can_be_disallowed():
    with pytest.raises(ValueError, match="file paths are not allowed here"):
        load_audio(str(CLIPS / "es16m.wav"), allow_paths=False)
    load_audio((CLIPS / "es16m.wav").read_bytes(), allow_paths=False)


# --------------------------------------------------------------------------- refused inputs, one per case
def test_undecodable_bytes():
    with pytest.raises(ValueError, match="could not decode the audio data"):
        load_audio(b"RIFF\x00\x00\x00\x00WAVEjunk" + bytes(200))


def test_undecodable_file(tmp_path):
    p = tmp_path / "notaudio.wav"
    p.write_text("hello, I am text")
    with pytest.raises(ValueError, match="could not decode"):
        load_audio(p)


def test_missing_file():
    with pytest.raises(ValueError, match="no such file"):
        load_audio("/nonexistent/ref.wav")


def test_invalid_base64():
    with pytest.raises(ValueError, match="invalid base64"):
        load_audio("data:audio/wav;base64,@@@not*base64@@@")


def test_decode_base64_forms_and_limit():
    data = bytes(range(256)) * 3 + b"\xfb\xff"  # '+' and '/' in standard base64, '-' and '_' in URL-safe
    b64 = base64.b64encode(data).decode()
    wrapped = " \n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
    urlsafe = base64.urlsafe_b64encode(data).decode().rstrip("=")
    for s in (b64, b64.rstrip("="), "data:audio/wav;base64," + b64, wrapped, urlsafe):
        assert decode_base64(s) == data
    assert decode_base64(b64, max_bytes=len(data) + 2) == data
    with pytest.raises(Base64TooLarge) as e:
        decode_base64(b64, max_bytes=len(data) - 1)
    assert e.value.size == len(b64) * 3 // 4
    with pytest.raises(ValueError):
        decode_base64("@@@not*base64@@@")


def test_silent():
    with pytest.raises(ValueError, match="silent"):
        load_audio((np.zeros(48000, np.float32), 24000))
    with pytest.raises(ValueError, match="silent"):
        load_audio(encode(tone(amp=1e-5), 16000, subtype="FLOAT"))


def test_nan():
    x = tone()
    x[100] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        load_audio((x, 16000))


def test_inf():
    x = tone()
    x[5:9] = np.inf
    with pytest.raises(ValueError, match="4 of 32000 samples are NaN or infinite"):
        load_audio(encode(x, 16000, subtype="FLOAT"))


def test_too_short():
    with pytest.raises(ValueError, match=r"0\.50 s is too short.*at least 1 s"):
        load_audio((tone(0.5), 16000))


def test_too_long():
    with pytest.raises(ValueError, match=r"61\.0 s is too long.*at most 60 s"):
        load_audio((tone(61.0, 8000), 8000))


def test_limits_are_configurable():
    load_audio((tone(0.5), 16000), limits=AudioLimits(min_seconds=0.25))
    with pytest.raises(ValueError, match="at most 1.5 s"):
        load_audio((tone(2.0), 16000), limits=AudioLimits(max_seconds=1.5))


def test_huge_bytes():
    data = encode(tone(), 16000)
    with pytest.raises(ValueError, match=f"{len(data)} bytes of audio, more than max_bytes=1000"):
        load_audio(data, limits=AudioLimits(max_bytes=1000))
    with pytest.raises(ValueError, match="base64 input decodes to about .* more than max_bytes=1000"):
        load_audio(base64.b64encode(data).decode(), limits=AudioLimits(max_bytes=1000))


def test_huge_file(tmp_path):
    p = tmp_path / "big.wav"
    p.write_bytes(encode(tone(), 16000))
    with pytest.raises(ValueError, match="more than max_bytes=2000"):
        load_audio(p, limits=AudioLimits(max_bytes=2000))


def test_long_file_refused_before_decoding(tmp_path):
    p = tmp_path / "long.flac"
    sf.write(str(p), np.zeros(8000 * 200, np.float32) + 0.1, 8000, format="FLAC")
    with pytest.raises(ValueError, match=r"200\.0 s is too long.*at most 60 s"):
        load_audio(p)


def flac_bomb(channels: int = 8, seconds: int = 3600, sr: int = 8000) -> bytes:
    """An hour of a constant signal: FLAC compresses it to a few hundred KB, decoded it is ~1 GB of float32."""
    buf = io.BytesIO()
    block = np.full((sr * 60, channels), 0.25, np.float32)
    with sf.SoundFile(buf, "w", samplerate=sr, channels=channels, format="FLAC", subtype="PCM_16") as f:
        for _ in range(seconds // 60):
            f.write(block)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bomb8() -> bytes:
    return flac_bomb()


def _refusal_cost(fn) -> tuple[str, float, int]:
    """fn's ValueError message, its wall time and the peak of the memory Python allocated meanwhile."""
    import time
    import tracemalloc
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ValueError) as e:
            fn()
        return str(e.value), time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("form", ["bytes", "base64", "path"])
def test_flac_bomb_refused_from_its_header(bomb8, form, tmp_path):
    """The issue's bomb (8 channels, an hour, a few hundred KB): refused before decoding, in every input form."""
    assert len(bomb8) < 1_000_000
    src = {"bytes": bomb8, "base64": "data:audio/flac;base64," + base64.b64encode(bomb8).decode(),
           "path": tmp_path / "bomb.flac"}[form]
    if form == "path":
        src.write_bytes(bomb8)
    msg, seconds, peak = _refusal_cost(lambda: load_audio(src))
    assert "8 channels" in msg and "at most 2" in msg
    assert seconds < 0.1 and peak < 50e6 + 2 * len(bomb8), (seconds, peak)


def test_mono_hour_refused_from_its_header():
    bomb = flac_bomb(channels=1)
    msg, seconds, peak = _refusal_cost(lambda: load_audio(bomb))
    assert "3600.0 s is too long" in msg and "at most 60 s" in msg
    assert seconds < 0.1 and peak < 50e6 + 2 * len(bomb), (seconds, peak)


def test_unknown_length_and_odd_headers_refused():
    # a FLAC whose STREAMINFO says 0 samples ("unknown", as a FLAC written while streaming): STREAMINFO's
    # fields from byte 18 are rate (20 bits), channels - 1 (3), bits - 1 (5) and the total samples (36)
    flac = bytearray(encode(tone(2.0), 16000, "FLAC"))
    assert flac[:4] == b"fLaC" and flac[4] & 0x7F == 0  # STREAMINFO first
    fields = int.from_bytes(flac[18:26], "big") & ~((1 << 36) - 1)
    flac[18:26] = fields.to_bytes(8, "big")
    with pytest.raises(ValueError, match="does not state its length"):
        load_audio(bytes(flac))
    with pytest.raises(ValueError, match="3 channels; a reference clip has at most 2"):
        load_audio(encode(np.stack([tone()] * 3, axis=1), 16000))
    with pytest.raises(ValueError, match="sample rate 384000 Hz; at most 192000"):
        load_audio(encode(tone(2.0, 384000), 384000))
    load_audio(encode(tone(2.0, 384000), 384000), limits=AudioLimits(max_sample_rate=384000))


# --------------------------------------------------------------------------- output
def test_to_s16_rounds_clips_and_zeroes_nan():
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -7.0, np.nan, np.inf, -np.inf, 0.25], dtype=np.float32)
    # 0.5 and 0.25 scale exactly to 16383.5 and 8191.75: half to even (as np.round), and to nearest
    want = [0, 16384, -16384, 32767, -32767, 32767, -32767, 0, 32767, -32767, 8192]
    for dtype in (np.float32, np.float64):
        got = to_s16(x.astype(dtype))
        assert got.dtype == np.dtype("<i2") and got.tolist() == want
    noise = np.random.default_rng(0).uniform(-1.2, 1.2, 4096).astype(np.float32)
    assert np.array_equal(to_s16(noise), np.round(np.clip(noise, -1, 1) * 32767.0).astype("<i2"))
    assert np.array_equal(to_s16(noise), to_s16(noise.copy()))  # the input is left as it was
