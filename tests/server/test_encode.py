"""Encoders and the streaming time-stretch, without a server."""

import asyncio
import itertools
import os

import numpy as np
import pytest

from q3tts.engine.deadline import chunk_cut
from q3tts.engine.request import StreamOptions
from q3tts.server.encode import HELD_BACK_S, AudioEncoder, AvEncoder, EncoderPool, RemoteEncoder, TimeStretch

SR = 24000
FRAME = 1920  # samples of one 80 ms frame


def tone(seconds=2.0, f0=200.0):
    t = np.arange(int(SR * seconds)) / SR
    return (0.3 * np.sin(2 * np.pi * f0 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def peak_hz(x):
    x = x[2400:-2400]
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return np.argmax(spec) * SR / len(x)


def chunked(fn_process, fn_finish, x, sizes):
    out, i = [], 0
    for n in sizes:
        if i >= len(x):
            break
        out.append(fn_process(x[i:i + n]))
        i += n
    out.append(fn_process(x[i:]))
    out.append(fn_finish())
    return out


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 2.0, 4.0])
def test_time_stretch_streams_exactly_keeps_pitch_and_length(speed):
    x = tone()
    whole = TimeStretch(speed)
    ref = np.concatenate([whole.process(x), whole.finish()])
    sizes = np.random.default_rng(int(speed * 100)).integers(1, 4000, 200)
    ts = TimeStretch(speed)
    got = np.concatenate(chunked(ts.process, ts.finish, x, sizes))
    assert len(ref) == round(len(x) / speed)
    np.testing.assert_array_equal(got, ref)  # chunking never changes the output
    assert abs(peak_hz(ref) - 200.0) < 2.0  # pitch kept
    assert 0.9 < ref[2400:-2400].std() / x.std() < 1.1  # no level change


def test_time_stretch_of_a_codec_stream_chunking():
    """First chunk of one frame, then 8-frame chunks, as the server gets them."""
    x = tone(1.5, 140.0)
    sizes = [1920] + [1920 * 8] * 10
    ts = TimeStretch(1.5)
    got = np.concatenate(chunked(ts.process, ts.finish, x, sizes))
    assert len(got) == round(len(x) / 1.5)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_encoders_incremental(fmt):
    from .live import declared_rate, decode, duration_tolerance
    x = tone(1.2)
    enc = AudioEncoder(fmt, SR)
    data = b"".join(chunked(enc.encode, enc.finish, x, [1920] + [1920 * 8] * 10))
    if fmt != "pcm":  # raw PCM declares no rate
        assert declared_rate(fmt, data) == SR
    if fmt == "pcm":
        y = np.frombuffer(data, "<i2") / 32767.0
        rate = SR
    elif fmt == "wav":
        assert data[:4] == b"RIFF" and data[40:44] == b"\xff\xff\xff\xff"
        y = np.frombuffer(data[44:], "<i2") / 32767.0
        rate = SR
    else:
        y, rate = decode(data)
    assert abs(len(y) / rate - len(x) / SR) <= duration_tolerance(fmt), (fmt, len(y) / rate)
    if fmt in ("pcm", "wav", "flac"):
        np.testing.assert_allclose(y[:len(x)], x, atol=1 / 16000)
    assert enc.seconds_out == pytest.approx(len(x) / SR)


@pytest.mark.parametrize("fmt", ["mp3", "aac", "opus", "flac"])
def test_held_back_bounds_the_audio_each_codec_keeps(fmt):
    """HELD_BACK_S is the most fed audio a codec keeps out of its packets at the server's chunk sizes (first chunks
    of 1, 2 or 3 frames, doubling to 16), over silence, noise, tones and bursts, and it is reached (0 for opus and
    flac): the deadline policy neither trusts audio a player lacks nor waits for more than it needs."""
    rng = np.random.default_rng(0)
    n = 125 * FRAME
    t = np.arange(n) / SR
    signals = [np.zeros(n), 0.3 * rng.standard_normal(n), 0.3 * np.sin(2 * np.pi * 200 * t),
               0.3 * np.sin(2 * np.pi * 3000 * t), 0.5 * rng.standard_normal(n) * ((t * 3) % 1 < 0.3)]
    most = 0.0
    for x, first in itertools.product(signals, (1, 2, 3)):
        enc, fed = AvEncoder(fmt, SR), 0
        for k in chunk_cut(StreamOptions(first, 16), 0, 125):
            enc.encode(x[fed:fed + k * FRAME].astype(np.float32))
            fed += k * FRAME
            most = max(most, fed / SR - enc.coded_s)
        enc.close()
    # packet durations are whole samples: exact to a sample
    assert most <= HELD_BACK_S.get(fmt, 0.0) + 1 / SR, most
    assert most >= HELD_BACK_S.get(fmt, 0.0) - 1 / SR, most


def test_encoder_with_speed_and_no_audio():
    enc = AudioEncoder("pcm", SR, speed=2.0)
    data = enc.encode(tone(1.0)) + enc.finish()
    assert len(data) // 2 == SR // 2
    empty = AudioEncoder("wav", SR)
    assert len(empty.finish()) == 44  # still a (header-only) file
    with pytest.raises(ValueError):
        AudioEncoder("ogg", SR)


def test_speech_request_declares_every_sampling_param():
    """SpeechRequest.gen_kwargs reads SamplingParams' fields off the request by name."""
    from q3tts.sampling import SamplingParams
    from q3tts.server.protocol import SpeechRequest
    assert set(SamplingParams.names()) <= set(SpeechRequest.model_fields)
    req = SpeechRequest(input="x", seed=3, temperature=0.5, top_k=0)
    assert req.gen_kwargs() == {"seed": 3, "temperature": 0.5, "top_k": 0}


def test_settings_flags_and_env():
    from q3tts.server.settings import parse_args
    s = parse_args(["--model", "m", "--port", "9000", "--api-key", "k"], environ={
        "Q3TTS_MAX_CONCURRENT": "64", "Q3TTS_PORT": "1", "Q3TTS_VOICE_DIR": "/tmp/v", "Q3TTS_WARMUP": "0"})
    assert (s.model, s.port, s.api_key, s.max_concurrent, s.voice_dir, s.warmup) == ("m", 9000, "k", 64, "/tmp/v", False)
    assert s.model_id == "m"
    with pytest.raises(SystemExit):
        parse_args(["--max-queue", "0"], environ={})
    assert not s.batch_invariant and parse_args(["--batch-invariant"], environ={}).batch_invariant
    assert parse_args([], environ={"Q3TTS_BATCH_INVARIANT": "1"}).batch_invariant
    assert s.encode_workers is None and parse_args(["--encode-workers", "0"], environ={}).encode_workers == 0
    assert parse_args([], environ={"Q3TTS_ENCODE_WORKERS": "3"}).encode_workers == 3
    with pytest.raises(SystemExit):
        parse_args(["--encode-workers", "-1"], environ={})


SIZES = [1920] + [1920 * 8] * 10  # the server's chunks: one frame first, then 8


async def pooled_bytes(pool, fmt, x, speed=1.0):
    enc = pool.open(fmt, SR, speed)
    try:
        parts = [await enc.aencode(x[i:i + n]) for i, n in zip(np.cumsum([0] + SIZES), SIZES + [len(x)])
                 if i < len(x)]
        return b"".join(parts) + await enc.afinish(), enc
    finally:
        enc.close()


@pytest.mark.parametrize(("fmt", "speed"), [("mp3", 1.0), ("aac", 1.0), ("flac", 1.0), ("mp3", 1.25), ("pcm", 0.8)])
def test_an_encoder_process_gives_the_bytes_of_an_encoder_in_place(fmt, speed):
    """A codec's or a speed's stream encodes in a worker process, byte for byte as in this process (the codecs are
    deterministic; opus is not compared: every Ogg stream gets a random serial number)."""
    x = tone(1.2)
    pool = EncoderPool(2)
    try:
        data, enc = asyncio.run(pooled_bytes(pool, fmt, x, speed))
    finally:
        pool.close()
    local = AudioEncoder(fmt, SR, speed)
    assert isinstance(enc, RemoteEncoder) and enc.media_type == local.media_type
    assert data == b"".join(chunked(local.encode, local.finish, x, SIZES))
    assert enc.seconds_out == pytest.approx(local.seconds_out) and enc.seconds_out > 0


def test_pcm_wav_and_no_workers_encode_in_place_and_bad_options_fail_at_open():
    pool = EncoderPool(2)
    assert isinstance(pool.open("pcm", SR), AudioEncoder) and isinstance(pool.open("wav", SR), AudioEncoder)
    assert pool.workers == [None, None]  # no process started for them
    assert isinstance(EncoderPool(0).open("mp3", SR), AudioEncoder)
    with pytest.raises(ValueError, match="response_format"):
        pool.open("ogg", SR)
    with pytest.raises(ValueError, match="speed"):
        pool.open("mp3", SR, speed=5.0)
    assert pool.workers == [None, None]


def test_streams_spread_over_the_workers_and_an_abandoned_call_is_dropped():
    """Each new stream goes to the worker with the fewest open; a stream closed while its call runs (the client gone)
    leaves a reply nobody waits for, and the worker serves the next stream."""
    pool = EncoderPool(2)

    async def run():
        a, b = pool.open("mp3", SR), pool.open("mp3", SR)
        assert a.worker is not b.worker and [w.streams for w in pool.workers] == [1, 1]
        call = asyncio.ensure_future(a.aencode(tone(0.5)))
        await asyncio.sleep(0)
        call.cancel()
        a.close()
        b.close()
        assert [w.streams for w in pool.workers] == [0, 0]
        return await pooled_bytes(pool, "mp3", tone(0.5))

    try:
        data, enc = asyncio.run(run())
        assert data and all(w.alive for w in pool.workers)
    finally:
        pool.close()
    assert pool.workers == [None, None]


def test_an_encoder_process_that_dies_fails_its_streams_and_is_started_again():
    pool = EncoderPool(1)

    async def run():
        enc = pool.open("mp3", SR)
        await enc.aencode(tone(0.2))
        enc.worker.proc.kill()
        with pytest.raises(RuntimeError, match="encoder process exited"):
            for _ in range(50):  # the reader sees the end within a call or two
                await enc.aencode(tone(0.2))
                await asyncio.sleep(0.05)
        enc.close()
        data, again = await pooled_bytes(pool, "mp3", tone(0.5))
        return enc.worker.proc.pid, again.worker.proc.pid, data

    try:
        old, new, data = asyncio.run(run())
    finally:
        pool.close()
    assert old != new and new != os.getpid() and data
