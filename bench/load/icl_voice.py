"""A stored ICL voice on a running Base `q3tts serve`, made through its own upload route (POST /v1/audio/voices,
multipart, as `q3tts voices add` sends it), for load runs that clone (bench/load/stall_matrix.sh's Base level).

    python -m bench.load.icl_voice --url http://127.0.0.1:8018 --name icl --wav /tmp/ref.wav
    python -m bench.load.load --url http://127.0.0.1:8018 --voice icl ...

The reference is synthetic (the bench checkpoints have random weights, so no recording is more meaningful): a
5 s, 24 kHz, 16-bit mono WAV written with the stdlib `wave`, a voiced buzz whose pitch glides and whose loudness
pulses at a syllable rate, with the transcript REF_TEXT (about 5 s of speech). Prints the stored voice as JSON;
exits non-zero unless the server stored it as an ICL voice (mode "icl", its ref_text kept): without a transcript
the server would make an x-vector voice, which is not what the Base level measures.
"""

from __future__ import annotations

import argparse
import json
import sys
import wave

import numpy as np

from q3tts.cli_voices import ServerVoices

SR = 24000
REF_TEXT = "Hello there, this short recording is the reference voice for the load test."


def reference_wav(path: str, seconds: float = 5.0, seed: int = 0) -> int:
    """Write the synthetic reference clip; -> its number of samples."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * SR)) / SR
    f0 = 120 + 30 * np.sin(2 * np.pi * 0.3 * t)  # Hz: a slow glide, as intonation
    phase = 2 * np.pi * np.cumsum(f0) / SR
    voiced = sum(np.sin(k * phase) / k for k in range(1, 16))  # harmonics with a 1/k spectrum
    syllables = 0.5 * (1 - np.cos(2 * np.pi * 4.0 * t))  # 4 syllables per second
    x = (voiced * syllables + 0.05 * rng.standard_normal(t.size)) * np.minimum(1, np.minimum(t, t[-1] - t) / 0.05)
    pcm = (0.3 * 32767 * x / np.abs(x).max()).astype("<i2")
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes(pcm.tobytes())
    return pcm.size


def store_icl_voice(url: str, name: str, wav: str, ref_text: str = REF_TEXT, api_key: str | None = None) -> dict:
    """Write the reference to `wav`, upload it as voice `name` with its transcript; -> the server's voice object.
    ValueError if the server refused it or did not store an ICL voice."""
    reference_wav(wav)
    with open(wav, "rb") as f:
        audio = f.read()
    voice = ServerVoices(url, api_key).add(name, audio, "reference.wav", ref_text, xvec=False)
    if voice.get("mode") != "icl" or voice.get("ref_text") != ref_text:
        raise ValueError(f"the server stored {name!r} as {voice.get('mode')!r} with ref_text "
                         f"{voice.get('ref_text')!r}, not as an ICL voice with the transcript {ref_text!r}")
    return voice


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="a Base model's `q3tts serve`")
    ap.add_argument("--name", default="icl", help="the voice's name (requests name it in `voice`)")
    ap.add_argument("--wav", required=True, help="where to write the reference clip")
    ap.add_argument("--ref-text", default=REF_TEXT, help="the clip's transcript")
    ap.add_argument("--api-key", default=None)
    a = ap.parse_args(argv)
    try:
        voice = store_icl_voice(a.url, a.name, a.wav, a.ref_text, a.api_key)
    except ValueError as e:
        print(f"icl_voice: {e}", file=sys.stderr)
        return 1
    print(json.dumps(voice))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
