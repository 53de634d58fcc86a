"""Incremental audio encoders for every response format, and a streaming time-stretch for `speed`.

    enc = AudioEncoder("mp3", 24000, speed=1.25)
    for chunk in chunks: send(enc.encode(chunk))   # float32 [N] in, bytes out (may be b"" while buffering)
    send(enc.finish())

Formats: pcm = raw s16le mono 24 kHz; wav = a RIFF header whose sizes are 0xFFFFFFFF ("until the end
of the stream": the length is unknown when the header goes out) then s16le; flac, mp3 (MPEG-2 layer
III at 24 kHz), aac (ADTS) and opus (Ogg) come from PyAV's bundled ffmpeg, muxed into an in-memory
sink that is drained after every chunk, with the Ogg page length cut to 20 ms and FLAC blocks to one
codec frame so the first bytes leave early. mp3 and aac add their codec delay (about 50-65 ms) in front,
as those formats always do. So a streamed WAV states no length and a streamed FLAC's STREAMINFO says 0
samples ("unknown"). With whole=True the encoder gives everything at finish() instead, as a complete
file: the WAV header holds the real sizes and FLAC's STREAMINFO the real sample count (the muxer writes
into a seekable buffer and fills the header in at the end).

`speed` is applied by WSOLA (waveform-similarity overlap-add): output frames of 32 ms are laid every
16 ms under a periodic Hann window; frame k is read from the input near k * 16 ms * speed, at the offset
within +-12 ms whose waveform best matches (normalised cross-correlation) the natural continuation of
the frame before. Pitch is kept because every output frame is an unmodified stretch of input. It runs
on a stream: a frame is made as soon as its search region has arrived, and feeding the input in any
chunking gives the same output as feeding it at once.
"""

from __future__ import annotations

import asyncio
import collections
import io
import itertools
import json
import logging
import os
import queue
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import BinaryIO, ClassVar

import numpy as np

from q3tts.audio import to_s16, wav_header

MEDIA_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
               "wav": "audio/wav", "pcm": "audio/pcm"}
# seconds of the audio fed to a format's encoder, at most, that are not yet in the bytes it gave back, at the server's
# chunk sizes (whole 80 ms frames): the encoder's look-ahead and its partial codec frame. A listener cannot play them
# yet, so the deadline policy counts them against the stream's slack (StreamOptions.held_back_s); tests/server/
# test_encode.py measures them from the packets' durations (AvEncoder.coded_s). pcm, wav, flac (a block a frame) and
# opus (Ogg pages of 20 ms) keep none at a chunk's end
HELD_BACK_S = {"mp3": 0.04, "aac": 0.08}


# --------------------------------------------------------------------------- time stretch
class TimeStretch:
    """Streaming WSOLA: tempo x `speed`, pitch unchanged; output length round(len(input) / speed).

    Args:
        speed: 0.25 .. 4.0 (2.0 = twice as fast).
        sample_rate: of the input and output.
    """

    def __init__(self, speed: float, sample_rate: int = 24000, frame_s: float = 0.032, search_s: float = 0.012):
        if not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed must be in [0.25, 4.0], got {speed}")
        self.speed = float(speed)
        self.N = int(frame_s * sample_rate) // 2 * 2  # frame length (768 at 24 kHz)
        self.Hs = self.N // 2  # output hop: 50 % overlap, the periodic Hann windows sum to 1
        self.Ha = self.Hs * self.speed  # nominal input hop
        self.delta = int(search_s * sample_rate)  # search +-delta samples around the nominal position
        self.window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(self.N) / self.N)).astype(np.float64)
        self.x = np.zeros(0, np.float64)  # input kept for frames to come, starting at absolute x_off
        self.x_off = 0
        self.n_in = 0  # input samples received
        self.y = np.zeros(0, np.float64)  # overlap-add accumulator from absolute output index y_off
        self.wsum = np.zeros(0, np.float64)  # sum of windows laid on each output sample
        self.y_off = 0
        self.k = 0  # next output frame
        self.prev: int | None = None  # input start of the segment chosen for frame k-1
        self.finished = False

    def _tau(self, k: int) -> int:
        return round(k * self.Ha)

    def _needs(self) -> int:
        """Input samples that must exist before frame k can be made."""
        end = self._tau(self.k) + self.delta + self.N
        if self.prev is not None:
            end = max(end, self.prev + self.Hs + self.N)
        return end

    def _get(self, start: int, n: int) -> np.ndarray:
        """Input [start, start + n), zeros past the end of the stream."""
        assert start >= self.x_off, "WSOLA read before its kept input"
        seg = self.x[start - self.x_off: start - self.x_off + n]
        return seg if seg.shape[0] == n else np.pad(seg, (0, n - seg.shape[0]))

    def _frame(self) -> None:
        N, tau = self.N, self._tau(self.k)
        if self.prev is None:
            pos = tau
        else:
            lo, hi = max(tau - self.delta, self.x_off), tau + self.delta
            template = self._get(self.prev + self.Hs, N)  # what would naturally follow the last frame
            region = self._get(lo, hi - lo + N)
            corr = np.correlate(region, template, "valid")  # [hi - lo + 1]
            c = np.concatenate(([0.0], np.cumsum(region * region)))
            energy = c[N:] - c[:-N]
            pos = lo + int(np.argmax(corr / np.sqrt(energy + 1e-9)))
        out0 = self.k * self.Hs - self.y_off
        need = out0 + N - self.y.shape[0]
        if need > 0:  # grow in large steps: the tail past the last frame stays zero
            grow = max(need, 64 * N)
            self.y = np.concatenate((self.y, np.zeros(grow)))
            self.wsum = np.concatenate((self.wsum, np.zeros(grow)))
        self.y[out0: out0 + N] += self.window * self._get(pos, N)
        self.wsum[out0: out0 + N] += self.window
        self.prev, self.k = pos, self.k + 1

    def _emit(self, upto: int) -> np.ndarray:
        n = max(0, upto - self.y_off)
        if n == 0:
            return np.zeros(0, np.float32)
        y, w = self.y[:n], self.wsum[:n]
        if y.shape[0] < n:  # only at the end, past the last frame
            y, w = np.pad(y, (0, n - y.shape[0])), np.pad(w, (0, n - w.shape[0]))
        out = np.divide(y, w, out=np.zeros(n), where=w > 1e-6)
        self.y, self.wsum, self.y_off = self.y[n:], self.wsum[n:], upto
        # forget input that no later frame can read
        keep = self._tau(self.k) - self.delta
        if self.prev is not None:
            keep = min(keep, self.prev + self.Hs)
        if keep > self.x_off:
            self.x, self.x_off = self.x[keep - self.x_off:], keep
        return out.astype(np.float32)

    def process(self, audio: np.ndarray) -> np.ndarray:
        """Next input chunk -> the output that is final so far."""
        assert not self.finished
        self.x = np.concatenate((self.x, np.asarray(audio, np.float64)))
        self.n_in += len(audio)
        while self._needs() <= self.n_in:
            self._frame()
        # output before frame k's start is final; never run past the length the input so far implies
        return self._emit(min(self.k * self.Hs, int(self.n_in / self.speed)))

    def finish(self) -> np.ndarray:
        """The rest, zero-padding the input for the last frames."""
        self.finished = True
        total = round(self.n_in / self.speed)
        while self.k * self.Hs < total:
            self._frame()
        return self._emit(max(total, self.y_off))


# --------------------------------------------------------------------------- encoders
class PcmEncoder:
    """Raw s16le: no header, so no rate to declare."""

    def encode(self, audio: np.ndarray) -> bytes:
        return to_s16(audio).tobytes()

    def finish(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


class WavEncoder(PcmEncoder):
    def __init__(self, sample_rate: int, whole: bool = False):
        self.sample_rate, self.whole = sample_rate, whole
        self._header = wav_header(sample_rate, None)
        self._parts: list[bytes] = []  # whole: the PCM until finish

    def encode(self, audio: np.ndarray) -> bytes:
        if self.whole:
            self._parts.append(to_s16(audio).tobytes())
            return b""
        head, self._header = self._header, b""
        return head + to_s16(audio).tobytes()

    def finish(self) -> bytes:
        if self.whole:
            pcm = b"".join(self._parts)
            return wav_header(self.sample_rate, len(pcm)) + pcm
        return self.encode(np.zeros(0, np.float32))  # the header, if no audio came at all


class _Sink:
    """A write-only, unseekable file for PyAV: muxers then write streamable output and never seek back."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, b) -> int:
        self.parts.append(bytes(b))
        return len(b)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class _WholeSink(io.BytesIO):
    """A seekable file: the muxer goes back to fill in the header's lengths, so nothing leaves before the end."""

    def take(self) -> bytes:
        return b""


class AvEncoder:
    """flac / mp3 / aac / opus through PyAV (ffmpeg): float32 chunks in, container bytes out."""

    # format -> (encoder, container, container options, stream options)
    SPECS: ClassVar[dict[str, tuple[str, str, dict, dict]]] = {
        # no bit reservoir: LAME then gives each frame's bytes without waiting for later frames' spare bits, so a
        # stream keeps back at most 40 ms of the audio fed, not 136 (HELD_BACK_S); as many bytes at its constant
        # bit rate, its signal-to-noise ratio within 0.2 dB on a voice-like and a noise signal (BENCHMARKS.md)
        "mp3": ("libmp3lame", "mp3", {}, {"reservoir": "0"}),
        "opus": ("libopus", "ogg", {"page_duration": "20000"}, {}),  # Ogg pages of 20 ms, not 1 s
        "aac": ("aac", "adts", {}, {}),
        "flac": ("flac", "flac", {}, {"frame_size": "1920"}),  # one codec frame per FLAC block
    }

    def __init__(self, fmt: str, sample_rate: int, whole: bool = False):
        import av  # PyAV bundles ffmpeg with these encoders
        self._av = av
        codec, container, copts, sopts = self.SPECS[fmt]
        self.sample_rate, self._fmt = sample_rate, fmt
        self._sink = _Sink() if not whole else _WholeSink()
        self._container = av.open(self._sink, mode="w", format=container, options=copts)
        self._stream = self._container.add_stream(codec, rate=sample_rate, options=sopts)
        self._stream.layout = "mono"
        self._pts = 0
        self._coded = 0  # the packets' durations so far, in the codec's time base (summed as integers)
        self._closed = False

    @property
    def coded_s(self) -> float:
        """Seconds of audio in the packets given to the muxer so far (what fed audio less this is held back)."""
        return float(self._coded * self._stream.codec_context.time_base)

    def _mux(self, frame) -> bytes:
        for packet in self._stream.encode(frame):
            self._coded += packet.duration or 0
            self._container.mux(packet)
        return self._sink.take()

    def encode(self, audio: np.ndarray) -> bytes:
        if len(audio) == 0:
            return b""
        frame = self._av.AudioFrame.from_ndarray(np.ascontiguousarray(audio, np.float32)[None], format="flt",
                                                 layout="mono")
        frame.sample_rate, frame.pts = self.sample_rate, self._pts
        self._pts += len(audio)
        return self._mux(frame)

    def finish(self) -> bytes:
        out = self._mux(None)  # flush the encoder
        self._container.close()  # the trailer (whole: the header filled in)
        self._closed = True
        return out + (self._sink.getvalue() if isinstance(self._sink, _WholeSink) else self._sink.take())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._container.close()
            except (OSError, ValueError, RuntimeError) as e:  # an abandoned stream: nothing to deliver
                logging.getLogger("q3tts.server").debug("closing an abandoned %s encoder: %s", self._fmt, e)


def check_format(fmt: str) -> None:
    if fmt not in MEDIA_TYPES:
        raise ValueError(f"unknown response_format {fmt!r}; one of {sorted(MEDIA_TYPES)}")


class AudioEncoder:
    """Speed, then format: float32 chunks at `sample_rate` -> bytes of one `fmt` stream.

    Args:
        fmt: mp3 | opus | aac | flac | wav | pcm.
        sample_rate: of the input (and the output: no resampling).
        speed: tempo factor 0.25 .. 4.0, pitch preserved (1.0: no processing).
        whole: keep everything for finish(), one complete file whose header states its length (wav, flac).
    """

    def __init__(self, fmt: str, sample_rate: int, speed: float = 1.0, whole: bool = False):
        check_format(fmt)
        self.sample_rate = sample_rate
        self.media_type = MEDIA_TYPES[fmt]
        self.stretch = TimeStretch(speed, sample_rate) if speed != 1.0 else None
        self.encoder = (PcmEncoder() if fmt == "pcm" else WavEncoder(sample_rate, whole) if fmt == "wav"
                        else AvEncoder(fmt, sample_rate, whole))
        self.samples_out = 0  # audio samples encoded (after speed)

    @property
    def seconds_out(self) -> float:
        return self.samples_out / self.sample_rate

    async def aencode(self, audio: np.ndarray) -> bytes:  # the surface the server awaits, as RemoteEncoder's
        return self.encode(audio)

    async def afinish(self) -> bytes:
        return self.finish()

    def encode(self, audio: np.ndarray) -> bytes:
        if self.stretch is not None:
            audio = self.stretch.process(audio)
        self.samples_out += len(audio)
        return self.encoder.encode(audio)

    def finish(self) -> bytes:
        out = b""
        if self.stretch is not None:
            tail = self.stretch.finish()
            self.samples_out += len(tail)
            out = self.encoder.encode(tail)
        return out + self.encoder.finish()

    def close(self) -> None:
        self.encoder.close()


# --------------------------------------------------------------------------- encoder processes
# A codec (and WSOLA) costs far more than a copy: at hundreds of audio seconds a second mp3 needs several cores, and in
# the server's process every Python step of it holds the GIL that the event loop and the engine's thread need (worker
# threads made the engine's steps longer: BENCHMARKS.md). So those streams' encoders live in worker processes; pcm and
# wav (a copy) stay in the server's.
# Wire: to a worker HEAD + payload; from it REPLY + payload, one reply per ENCODE / FINISH, in the order sent.
HEAD = struct.Struct("<IBI")  # stream id, op, payload bytes
REPLY = struct.Struct("<IBqI")  # stream id, ok (1) or error (0), the stream's samples out so far, payload bytes
OPEN, ENCODE, FINISH, CLOSE = range(4)


def offloaded(fmt: str, speed: float) -> bool:
    """A codec's format or a changed speed: work for an encoder process."""
    return fmt in AvEncoder.SPECS or speed != 1.0


def default_encode_workers() -> int:
    """One fewer than the CPUs this process may run on (the other is the event loop's and the engine's), 1 to 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(8, cpus - 1))


def _read(f: BinaryIO, n: int) -> bytes | None:
    b = f.read(n)
    return b if len(b) == n else None  # EOF


def worker_main(inp: BinaryIO, out: BinaryIO) -> None:
    """An encoder process: AudioEncoders by stream id; requests in order from inp, replies to out; ends at EOF."""
    encoders: dict[int, AudioEncoder | Exception] = {}
    while (head := _read(inp, HEAD.size)) is not None:
        sid, op, n = HEAD.unpack(head)
        payload = _read(inp, n) if n else b""
        if payload is None:
            return
        if op == OPEN:  # no reply: an encoder that cannot be made answers its stream's first call with the error
            try:
                encoders[sid] = AudioEncoder(**json.loads(payload))
            except Exception as e:  # noqa: BLE001 (any failure belongs to that stream alone)
                encoders[sid] = e
            continue
        enc = encoders.pop(sid, None) if op == CLOSE else encoders.get(sid)
        if op == CLOSE:
            if isinstance(enc, AudioEncoder):
                enc.close()
            continue
        try:
            if not isinstance(enc, AudioEncoder):
                raise enc if isinstance(enc, Exception) else KeyError(f"no encoder {sid}")
            data, ok = enc.encode(np.frombuffer(payload, np.float32)) if op == ENCODE else enc.finish(), 1
            samples = enc.samples_out
        except Exception as e:  # noqa: BLE001
            data, ok, samples = f"{type(e).__name__}: {e}".encode(), 0, 0
        out.write(REPLY.pack(sid, ok, samples, len(data)) + data)
        out.flush()


class _Worker:
    """One encoder process, a thread that writes to it and one that reads its replies (both wait outside the GIL)."""

    def __init__(self):
        env = dict(os.environ)  # the child imports this package from where the parent did
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "q3tts.server.encode"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.streams = 0  # open on this worker (the event loop's count)
        self.alive = True
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        # stream id -> the futures of its calls in flight, oldest first (appended on the loop's thread before the
        # request is queued, popped by the reader after its reply)
        self.pending: dict[int, collections.deque] = {}
        threading.Thread(target=self._write, name="q3tts-encoder-write", daemon=True).start()
        threading.Thread(target=self._read, name="q3tts-encoder-read", daemon=True).start()

    def send(self, sid: int, op: int, payload: bytes = b"") -> None:
        self._out.put(HEAD.pack(sid, op, len(payload)) + payload)

    def _write(self) -> None:
        try:
            while (msg := self._out.get()) is not None:
                self.proc.stdin.write(msg)
                self.proc.stdin.flush()
            self.proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):  # the process is gone: the reader fails its calls
            pass

    def _read(self) -> None:
        f = self.proc.stdout
        while (head := _read(f, REPLY.size)) is not None:
            sid, ok, samples, n = REPLY.unpack(head)
            data = _read(f, n) if n else b""
            if data is None:
                break
            calls = self.pending.get(sid)
            if calls:  # else the stream was closed while its call ran (the client gone): nobody waits
                loop, fut = calls.popleft()
                loop.call_soon_threadsafe(_settle, fut, (ok, samples, data))
        self.alive = False
        code = self.proc.wait()
        for calls in list(self.pending.values()):
            while calls:
                loop, fut = calls.popleft()
                loop.call_soon_threadsafe(_settle, fut, (0, 0, f"the encoder process exited ({code})".encode()))

    def close(self) -> None:
        self._out.put(None)  # stdin closes: the process ends at EOF
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _settle(fut: asyncio.Future, reply: tuple) -> None:
    if not fut.done():  # its awaiter may be cancelled (the client gone)
        fut.set_result(reply)


class RemoteEncoder:
    """AudioEncoder's surface (aencode / afinish / close, media_type, seconds_out) over a stream in an encoder
    process. Calls go one at a time, in order (the server awaits each)."""

    def __init__(self, pool: EncoderPool, worker: _Worker, sid: int, fmt: str, sample_rate: int, speed: float,
                 whole: bool):
        self.pool, self.worker, self.sid, self.sample_rate = pool, worker, sid, sample_rate
        self.media_type = MEDIA_TYPES[fmt]
        self.samples_out = 0
        self._closed = False
        worker.pending[sid] = collections.deque()
        worker.send(sid, OPEN, json.dumps({"fmt": fmt, "sample_rate": sample_rate, "speed": speed,
                                           "whole": whole}).encode())

    @property
    def seconds_out(self) -> float:
        return self.samples_out / self.sample_rate

    async def _call(self, op: int, payload: bytes = b"") -> bytes:
        if self._closed:
            raise RuntimeError("encoder closed")
        if not self.worker.alive:
            raise RuntimeError("the encoder process exited")
        fut = asyncio.get_running_loop().create_future()
        self.worker.pending[self.sid].append((fut.get_loop(), fut))
        self.worker.send(self.sid, op, payload)
        if not self.worker.alive:  # it died between the check and the append: its reader may have failed the rest
            _settle(fut, (0, 0, b"the encoder process exited"))
        ok, samples, data = await fut
        if not ok:
            raise RuntimeError(f"encoding failed: {data.decode(errors='replace')}")
        self.samples_out = samples
        return data

    async def aencode(self, audio: np.ndarray) -> bytes:
        return await self._call(ENCODE, np.ascontiguousarray(audio, np.float32).tobytes()) if len(audio) else b""

    async def afinish(self) -> bytes:
        return await self._call(FINISH)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.worker.send(self.sid, CLOSE)
            self.worker.pending.pop(self.sid, None)
            self.pool.release(self.worker)


class EncoderPool:
    """Encoder processes for the streams that need a codec or a speed (`offloaded`); the others encode in place.

    Args:
        workers: processes, started when first needed; a stream goes to the one with the fewest open streams, and
            one that died is started again for the next stream. 0: every stream encodes in this process.
    """

    def __init__(self, workers: int):
        self.workers: list[_Worker | None] = [None] * max(0, workers)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def open(self, fmt: str, sample_rate: int, speed: float = 1.0,
             whole: bool = False) -> AudioEncoder | RemoteEncoder:
        check_format(fmt)
        if not self.workers or not offloaded(fmt, speed):
            return AudioEncoder(fmt, sample_rate, speed, whole)
        if not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed must be in [0.25, 4.0], got {speed}")
        with self._lock:
            for i, w in enumerate(self.workers):
                if w is None or not w.alive:
                    self.workers[i] = _Worker()
            worker = min(self.workers, key=lambda w: w.streams)
            worker.streams += 1
        return RemoteEncoder(self, worker, next(self._ids), fmt, sample_rate, speed, whole)

    def release(self, worker: _Worker) -> None:
        with self._lock:
            worker.streams -= 1

    def close(self) -> None:
        with self._lock:
            workers, self.workers = [w for w in self.workers if w is not None], [None] * len(self.workers)
        for w in workers:
            w.close()


if __name__ == "__main__":  # an encoder process (EncoderPool): stray prints go to stderr, replies to the real stdout
    _replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    worker_main(sys.stdin.buffer, _replies)
