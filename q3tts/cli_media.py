"""What the command line does with audio as it streams: a progress line, a WAV file that is valid after every
chunk, and playback on the sound device.

    progress = Progress(total_s=...)             # draws on stderr only when stderr is a terminal
    with WavWriter("out.wav", 24000) as wav, Player.maybe(play, 24000) as player:
        for chunk in stream:
            wav.write(chunk.audio); player.write(chunk.audio); progress.update(wav.seconds)
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time

import numpy as np

from .audio import to_s16, wav_header


class WavWriter:
    """16-bit mono WAV written as audio arrives: the header's sizes are rewritten after every chunk, so a run
    that is interrupted (Ctrl+C, kill, power loss after the OS wrote the pages) leaves a valid file holding
    every chunk written before it. A chunk is appended before the sizes that include it are written: a crash
    between the two leaves the previous sizes (a shorter valid file), never sizes past the data."""

    def __init__(self, path: str | os.PathLike, sample_rate: int):
        self.path, self.sample_rate, self.samples = path, sample_rate, 0
        self.f = open(path, "wb")
        self.f.write(wav_header(sample_rate, 0))
        self.f.flush()

    def write(self, audio: np.ndarray) -> None:
        """audio: float32 [-1, 1] (or int16), mono."""
        pcm = to_s16(audio) if audio.dtype != np.int16 else audio
        self.f.seek(0, os.SEEK_END)
        self.f.write(pcm.astype("<i2", copy=False).tobytes())
        self.samples += len(pcm)
        self.f.seek(0)
        self.f.write(wav_header(self.sample_rate, self.samples * 2))
        self.f.flush()

    @property
    def seconds(self) -> float:
        return self.samples / self.sample_rate

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Progress:
    """One line on stderr, redrawn at most 10 times a second: audio seconds made, real-time factor (audio seconds
    per wall second), and, when the length is bounded (total_s), a bar and the time left at the current rate.
    Silent unless the stream is a terminal (or enabled=True)."""

    def __init__(self, label: str = "", total_s: float | None = None, stream=None, enabled: bool | None = None,
                 width: int = 24):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label, self.total_s, self.width = label, total_s, width
        self.t0 = time.perf_counter()
        self.first_s: float | None = None  # wall seconds to the first audio
        self._last_draw, self._drawn = 0.0, False

    def update(self, audio_s: float, force: bool = False) -> None:
        now = time.perf_counter()
        if self.first_s is None and audio_s > 0:
            self.first_s = now - self.t0
        if not self.enabled or (not force and now - self._last_draw < 0.1):
            return
        self._last_draw = now
        self.stream.write("\r\033[K" + self.line(audio_s, now - self.t0))
        self.stream.flush()
        self._drawn = True

    def line(self, audio_s: float, wall_s: float) -> str:
        parts = [self.label] if self.label else []
        if self.total_s:
            frac = min(1.0, audio_s / self.total_s)
            fill = int(round(frac * self.width))
            parts.append("[" + "#" * fill + "." * (self.width - fill) + f"] {100 * frac:3.0f}%")
        parts.append(f"{audio_s:6.2f} s audio")
        if audio_s > 0 and wall_s > 0:
            rtf = audio_s / wall_s
            parts.append(f"{rtf:5.2f}x real time")
            if self.total_s and audio_s < self.total_s:
                parts.append(f"<= {(self.total_s - audio_s) / rtf:.1f} s left")
        else:
            parts.append(f"{wall_s:5.1f} s")
        return "  ".join(parts)

    def stage(self, text: str) -> None:
        """A step without a measurable length (loading, encoding): shown on the line while it runs."""
        if self.enabled:
            self.stream.write(f"\r\033[K{self.label}  {text}" if self.label else f"\r\033[K{text}")
            self.stream.flush()
            self._drawn = True

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()


class Player:
    """Plays float32 mono chunks on the default output device (the `sounddevice` package) from a thread, so a
    generation that runs faster than real time is never held up by playback; close() waits until the audio has
    played. A chunk that arrives late leaves a gap (an underrun), not a shorter file."""

    def __init__(self, sample_rate: int, sd=None):
        if sd is None:
            try:
                import sounddevice as sd
            except (ImportError, OSError) as e:  # OSError: the PortAudio library is missing
                raise ValueError("--play needs the sounddevice package and PortAudio: pip install 'q3tts[play]' "
                                 f"({e})") from None
        try:
            self.out = sd.OutputStream(samplerate=sample_rate, channels=1, dtype="float32")
            self.out.start()
        except Exception as e:  # sounddevice.PortAudioError: no device, device busy
            raise ValueError(f"--play: no usable sound output device ({e})") from None
        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="q3tts-play", daemon=True)
        self.thread.start()

    @staticmethod
    def maybe(enabled: bool, sample_rate: int):
        return Player(sample_rate) if enabled else _NoPlayer()

    def _run(self) -> None:
        try:
            while (audio := self.q.get()) is not None:
                self.out.write(np.ascontiguousarray(audio, dtype=np.float32).reshape(-1, 1))
        except BaseException as e:  # reported by close()
            self.error = e

    def write(self, audio: np.ndarray) -> None:
        self.q.put(audio)

    def close(self, drain: bool = True) -> None:
        if not drain:  # interrupted: drop what is queued
            while not self.q.empty():
                self.q.get_nowait()
        self.q.put(None)
        self.thread.join()
        self.out.stop()
        self.out.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close(drain=exc_type is None)


class _NoPlayer:
    def write(self, audio) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass
