"""Golden fixtures for voice cloning: reference clips run through the official `qwen-tts==0.1.1`.

    python tests/golden/make_golden_voice.py                # reuses committed clips; writes fixtures_voice/
    python tests/golden/make_golden_voice.py --remake-clips  # also re-synthesises the clips (needs espeak-ng)

Outside the oracle venv this script only re-runs itself inside it (created by make_golden.py's
`ensure_venv`). Inside, it
  1. makes the reference clips once (committed, so the fixtures never depend on an espeak-ng version):
     espeak-ng speech and synthetic speech-like signals (harmonic source with a moving f0, formant
     resonators, syllable envelopes, fricative noise) at 16, 22.05, 44.1 and 48 kHz, mono and stereo,
     as WAV (16-bit and float), FLAC, MP3 and OGG/Opus;
  2. rebuilds the tiny `base06` checkpoint from its recipe in fixtures/base06/manifest.json;
  3. records, per clip, what the official code computes: the loaded waveform's rate, the 24 kHz
     resampled waveform (two clips), the mel features, the x-vector and the ICL ref_code; batch calls of
     create_voice_clone_prompt (one sample rate: one padded batch; mixed rates: one by one); inputs
     given as data URLs; and end-to-end `generate_voice_clone(ref_audio=..., ref_text=...,
     x_vector_only_mode=...)` with greedy decoding (codes and waveforms);
  4. the librosa mel filterbank, and the official speaker-encoder state-dict shapes of the real 0.6B
     and 1.7B configs.
Everything goes to fixtures_voice/ (manifest.json, outputs.safetensors, clips/).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_golden as mg

OUT = HERE / "fixtures_voice"
CLIPS = OUT / "clips"
VARIANT = "base06"
CLIP_SECONDS = 1.3

ESPEAK_TEXT = {"en1": "Hello there, this is a short test.", "en2": "Please call Stella, ask her to bring these."}
SYNTH_TEXT = "ma na la ba da ga"  # six syllables in 1.3 s (the synthetic clips have six bursts)

# name -> (sample rate, channels, source, file extension, soundfile subtype)
CLIP_SPECS = {
    "es16m": (16000, 1, "en1", "wav", "PCM_16"),
    "sy16s": (16000, 2, "synth", "flac", "PCM_16"),
    "sy22m": (22050, 1, "synth", "wav", "PCM_16"),
    "es22s": (22050, 2, "en2", "flac", "PCM_16"),
    "es44m": (44100, 1, "en2", "flac", "PCM_16"),
    "sy44s": (44100, 2, "synth", "wav", "PCM_16"),
    "sy48m": (48000, 1, "synth", "wav", "FLOAT"),
    "es48s": (48000, 2, "en1", "wav", "PCM_16"),
    "es24m": (24000, 1, "en1", "mp3", "MPEG_LAYER_III"),
    "sy48s": (48000, 2, "synth", "ogg", "OPUS"),
}
KEEP_WAV24 = ("es16m", "es48s")  # upsampled and downsampled: the resampler itself, sample by sample

# end-to-end official generate_voice_clone calls: (name, clip, mode, non_streaming_mode, text, language)
E2E = [
    ("e2e_es16m_icl_stream", "es16m", "icl", False, mg.T_LONG, "English"),
    ("e2e_sy16s_xvec_nsm", "sy16s", "xvec", True, mg.T_MIX, "Auto"),
    ("e2e_sy22m_icl_nsm", "sy22m", "icl", True, mg.T_ZH, "Chinese"),
    ("e2e_es22s_xvec_stream", "es22s", "xvec", False, mg.T_LONG, "English"),
    ("e2e_es44m_xvec_nsm", "es44m", "xvec", True, mg.T_SHORT, "English"),
    ("e2e_sy44s_icl_stream", "sy44s", "icl", False, mg.T_MIX, "Auto"),
    ("e2e_sy48m_xvec_stream", "sy48m", "xvec", False, mg.T_ZH, "Auto"),
    ("e2e_es48s_icl_nsm", "es48s", "icl", True, mg.T_LONG, "English"),
]
# create_voice_clone_prompt batches: (name, [(clip, mode)])
BATCHES = [
    ("batch_same_sr", [("sy48m", "icl"), ("es48s", "xvec"), ("es48s", "icl")]),
    ("batch_mixed_sr", [("es16m", "icl"), ("sy44s", "icl"), ("es22s", "xvec")]),
]
DATA_URL_CLIPS = ("es24m", "sy16s")  # the same clips given as data URLs (upstream reads them with soundfile)


def ref_text_of(clip: str) -> str:
    src = CLIP_SPECS[clip][2]
    return SYNTH_TEXT if src == "synth" else ESPEAK_TEXT[src]


def clip_path(clip: str) -> Path:
    return CLIPS / f"{clip}.{CLIP_SPECS[clip][3]}"


# --------------------------------------------------------------------------- clips (inside the venv)
def synth_speech(sr: int, seconds: float, seed: int):
    """A speech-like signal: glottal-ish harmonics under a moving f0, two formant resonators that move
    per syllable, six syllable envelopes, fricative noise between them; peak 0.5."""
    import numpy as np
    from scipy.signal import lfilter
    rng = np.random.default_rng(seed)
    n = int(seconds * sr)
    t = np.arange(n) / sr
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6)) + 8 * np.sin(2 * np.pi * 5.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    src = np.zeros(n)
    for h in range(1, int(0.45 * sr / 120)):  # harmonics up to ~Nyquist: exercises the resampler's filter
        src += np.where(h * f0 < 0.45 * sr, np.sin(h * phase) / h ** 1.2, 0.0)
    out = np.zeros(n)
    syl = 6
    bounds = np.linspace(0, n, syl + 1).astype(int)
    for s in range(syl):
        a, b = bounds[s], bounds[s + 1]
        seg = src[a:b]
        y = np.zeros_like(seg)
        for fc, bw in ((rng.uniform(300, 900), 90), (rng.uniform(900, 2500), 120)):
            r = np.exp(-np.pi * bw / sr)
            y += lfilter([1 - r], [1, -2 * r * np.cos(2 * np.pi * fc / sr), r * r], seg)
        env = np.sin(np.pi * np.linspace(0, 1, b - a)) ** 2
        vowel = slice(int(0.2 * (b - a)), b - a)
        out[a:b][vowel] += (y * env)[vowel]
        noise = lfilter([1, -0.95], [1], rng.standard_normal(int(0.2 * (b - a))))  # high-passed noise
        out[a:a + noise.size] += 0.15 * noise * np.hanning(noise.size)
    out = out / np.abs(out).max() * 0.5
    return out.astype(np.float32)


def espeak(text: str, tmp: Path):
    import soundfile as sf
    wav = tmp / "espeak.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "175", "-w", str(wav), text], check=True)
    y, sr = sf.read(str(wav), dtype="float32")
    return y, sr


def make_clips() -> None:
    import tempfile

    import numpy as np
    import soundfile as sf
    import soxr
    CLIPS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    for i, (name, (sr, ch, src, ext, subtype)) in enumerate(CLIP_SPECS.items()):
        if src == "synth":
            left = synth_speech(sr, CLIP_SECONDS, seed=10 + i)
            right = synth_speech(sr, CLIP_SECONDS, seed=100 + i) if ch == 2 else None
        else:
            y, esr = espeak(ESPEAK_TEXT[src], tmp)
            y = y[np.argmax(np.abs(y) > 0.01):]  # drop the leading silence
            y = soxr.resample(y, esr, sr, quality="VHQ") if esr != sr else y
            n = int(CLIP_SECONDS * sr)
            left = np.pad(y, (0, max(0, n - len(y))))[:n] * 0.8  # cut mid-sentence: as real references are
            right = None
            if ch == 2:  # a different right channel: delayed, quieter, with a little noise
                d = int(0.003 * sr)
                right = 0.6 * np.concatenate([np.zeros(d, np.float32), left[:-d]])
                right = right + 0.01 * np.random.default_rng(i).standard_normal(n).astype(np.float32)
        data = left if ch == 1 else np.stack([left, right], axis=1)
        fmt = {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "ogg": "OGG"}[ext]
        sf.write(str(clip_path(name)), data.astype(np.float32), sr, format=fmt, subtype=subtype)
        print(f"clip {name}: {sr} Hz x{ch} {ext}/{subtype} {clip_path(name).stat().st_size} bytes", flush=True)


# --------------------------------------------------------------------------- the oracle (inside the venv)
def run_inside(remake_clips: bool) -> None:
    import importlib.util

    import librosa
    import numpy as np
    import torch
    from qwen_tts import Qwen3TTSModel
    from qwen_tts.core.models.configuration_qwen3_tts import (
        Qwen3TTSSpeakerEncoderConfig,
    )
    from qwen_tts.core.models.modeling_qwen3_tts import (
        Qwen3TTSSpeakerEncoder,
        mel_spectrogram,
    )
    from safetensors.torch import save_file
    from transformers import AutoProcessor

    if remake_clips or not all(clip_path(c).exists() for c in CLIP_SPECS):
        make_clips()
    spec = importlib.util.spec_from_file_location("randomckpt", mg.ROOT / "q3tts" / "randomckpt.py")
    rc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rc)
    torch.manual_seed(0)

    m = json.loads((mg.FIXTURES / VARIANT / "manifest.json").read_text())
    ckpt = Path(os.environ.get("TMPDIR", "/tmp")) / f"q3tts-golden-voice-{VARIANT}"
    digests = rc.write_checkpoint(ckpt, m["config"], m["speech_config"], m["shapes"], m["speech_shapes"],
                                  mg.REFERENCE / "tokenizer", m["generation_config"], seed=m["seed"],
                                  tweaks=m["tweaks"])
    assert digests == m["digests"], "rebuilt base06 differs from its recipe"
    tts = Qwen3TTSModel.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager")
    tts.processor = AutoProcessor.from_pretrained(str(ckpt), fix_mistral_regex=False)  # see make_golden.py
    model = tts.model

    t: dict[str, torch.Tensor] = {}
    clips_meta = {}
    for clip in CLIP_SPECS:
        path = str(clip_path(clip))
        (wav, sr), = tts._normalize_audio_inputs([path])  # upstream's loader (librosa.load, mono)
        wav24 = librosa.resample(y=wav.astype(np.float32), orig_sr=int(sr), target_sr=24000) if sr != 24000 else wav
        mel = mel_spectrogram(torch.from_numpy(wav24).unsqueeze(0), n_fft=1024, num_mels=128, sampling_rate=24000,
                              hop_size=256, win_size=1024, fmin=0, fmax=12000)[0]
        item, = tts.create_voice_clone_prompt(path, ref_text=ref_text_of(clip), x_vector_only_mode=False)
        emb = model.extract_speaker_embedding(wav24, 24000)
        assert torch.equal(emb, item.ref_spk_embedding)
        t[f"{clip}.mel"] = mel.contiguous()
        t[f"{clip}.spk"] = item.ref_spk_embedding.float().contiguous()
        t[f"{clip}.ref_code"] = item.ref_code.contiguous()
        if clip in KEEP_WAV24:
            t[f"{clip}.wav24"] = torch.from_numpy(np.ascontiguousarray(wav24))
        clips_meta[clip] = dict(file=clip_path(clip).name, sr=int(sr), num_samples=int(wav.shape[0]),
                                channels=CLIP_SPECS[clip][1], ref_text=ref_text_of(clip),
                                num_samples_24k=int(wav24.shape[0]), num_frames=int(item.ref_code.shape[0]))
        print(f"{clip}: sr={sr} n={wav.shape[0]} -> {wav24.shape[0]} @24k, mel {tuple(mel.shape)}, "
              f"ref_code {tuple(item.ref_code.shape)}", flush=True)

    for clip in DATA_URL_CLIPS:  # inputs given as data URLs: decoded by soundfile from memory
        mime = {"mp3": "audio/mpeg", "flac": "audio/flac", "wav": "audio/wav", "ogg": "audio/ogg"}[CLIP_SPECS[clip][3]]
        url = f"data:{mime};base64," + base64.b64encode(clip_path(clip).read_bytes()).decode()
        item, = tts.create_voice_clone_prompt(url, ref_text=ref_text_of(clip), x_vector_only_mode=False)
        t[f"dataurl_{clip}.spk"] = item.ref_spk_embedding.float().contiguous()
        t[f"dataurl_{clip}.ref_code"] = item.ref_code.contiguous()

    batches = []
    for name, rows in BATCHES:
        paths = [str(clip_path(c)) for c, _ in rows]
        items = tts.create_voice_clone_prompt(paths, ref_text=[ref_text_of(c) for c, _ in rows],
                                              x_vector_only_mode=[mode == "xvec" for _, mode in rows])
        for j, it in enumerate(items):
            t[f"{name}.spk.{j}"] = it.ref_spk_embedding.float().contiguous()
            if it.ref_code is not None:
                t[f"{name}.ref_code.{j}"] = it.ref_code.contiguous()
        batches.append(dict(name=name, rows=rows))

    # end-to-end, as a user calls it
    captured: dict = {}
    orig_decode = model.speech_tokenizer.decode

    def spy_decode(encoded):
        captured["codes"] = [e["audio_codes"] for e in encoded]
        return orig_decode(encoded)

    model.speech_tokenizer.decode = spy_decode
    cases = []
    for name, clip, mode, nsm, text, language in E2E:
        captured.clear()
        kw = dict(text=text, language=language, ref_audio=str(clip_path(clip)), ref_text=ref_text_of(clip),
                  x_vector_only_mode=mode == "xvec", non_streaming_mode=nsm)
        wavs, sr = tts.generate_voice_clone(**kw, **mg.GREEDY)
        assert sr == 24000 and len(wavs) == 1
        peak = float(np.abs(wavs[0]).max())
        assert peak < 0.95, f"{name}: waveform peak {peak} too close to the clamp"
        t[f"{name}.codes"] = captured["codes"][0].contiguous()  # [T, 16]; ICL: the ref codes in front
        t[f"{name}.wav"] = torch.from_numpy(np.ascontiguousarray(wavs[0]))
        cases.append(dict(name=name, clip=clip, mode=mode, kw={k: v for k, v in kw.items() if k != "ref_audio"},
                          num_frames=int(captured["codes"][0].shape[0])))
        print(f"{name}: {cases[-1]['num_frames']} frames", flush=True)

    t["mel_filterbank"] = torch.from_numpy(librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000))

    real_shapes = {}
    for size, enc_dim in (("0b6", 1024), ("1b7", 2048)):
        with torch.device("meta"):
            se = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(enc_dim=enc_dim, sample_rate=24000))
        real_shapes[size] = {k: list(v.shape) for k, v in se.state_dict().items()}

    OUT.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(OUT / "outputs.safetensors"))
    manifest = dict(variant=VARIANT, greedy=mg.GREEDY, clips=clips_meta, batches=batches, e2e=cases,
                    data_url_clips=list(DATA_URL_CLIPS), real_speaker_encoder_shapes=real_shapes,
                    oracle="qwen-tts==0.1.1, transformers==4.57.3, torch==2.13.0+cpu, librosa==" + librosa.__version__
                    + ", fp32, eager attention")
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--remake-clips", action="store_true", help="re-synthesise the reference clips (espeak-ng)")
    args = ap.parse_args()
    if args.inside:
        run_inside(args.remake_clips)
        return
    py = mg.ensure_venv()
    subprocess.run([str(py), __file__, "--inside", *(["--remake-clips"] if args.remake_clips else [])], check=True)


if __name__ == "__main__":
    main()
