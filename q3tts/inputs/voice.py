"""Voice cloning: reference audio -> prompt items (x-vector, ICL codes), and reusable `Voice` files.

    cloner = VoiceCloner.from_pretrained("Qwen/Qwen3-TTS-12Hz-0.6B-Base")
    items = cloner.create_voice_clone_prompt("ref.wav", ref_text="What the clip says.")
    voice = cloner.create_voice("ref.wav", ref_text="What the clip says.")
    voice.save("alice.safetensors"); voice = Voice.load("alice.safetensors", model=tts.cfg)

Semantics follow upstream's `Qwen3TTSModel.create_voice_clone_prompt`: scalars or lists (a list of one
is not broadcast), x-vector from the 24 kHz clip, ref_code from the speech tokenizer's encoder (clips of
one sample rate are encoded as one zero-padded batch, others one by one). Differences, all guards:
  - append_silence (default True): 0.5 s of silence is appended to the clip fed to the codec encoder
    (ICL only; the x-vector uses the clip as is), so a reference that ends mid-word does not make the
    model continue that word ("phoneme bleed"). Pass False for upstream-identical codes.
  - clips are validated (see q3tts.audio.AudioLimits), and URLs are fetched only with allow_urls=True;
  - a warning (RefTextWarning) when ref_text looks far too short or too long for the clip: a transcript
    that does not cover the audio is the usual cause of ICL output that collapses or babbles.
"""

from __future__ import annotations

import json
import os
import re
import threading
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..audio import TARGET_SR, AudioLimits, load_audio, resample
from ..config import ModelConfig, SpeechTokenizerConfig, parse_model_config, parse_speech_tokenizer_config, read_json
from ..models.codec_encoder import CodecEncoder
from ..models.loaders import load_codec_encoder, load_speaker_encoder
from ..models.speaker_encoder import SpeakerEncoder
from ..weights import resolve_model_dir
from .request import VoiceClonePromptItem

ICL_SILENCE_SECONDS = 0.5
VOICE_FORMAT = "q3tts.voice"
VOICE_FORMAT_VERSION = 1
MODEL_FAMILY = "qwen3-tts-12hz"
_SIZE_NAMES = {"0b6": "0.6B", "1b7": "1.7B"}


class RefTextWarning(UserWarning):
    """ref_text does not look like the transcript of the reference clip."""


# --------------------------------------------------------------------------- ref_text plausibility
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_VOWELS = set("aeiouyæøœåäöüаеёиоуыэюяіїєαεηιουω")


def speech_units(text: str) -> int:
    """A rough syllable count: one per CJK character / kana / hangul block, one per vowel group of other
    words, one per digit."""
    n = len(_CJK.findall(text))
    rest = _CJK.sub(" ", text)
    for word in re.findall(r"[^\W\d_]+|\d", rest):
        if word.isdigit():
            n += 1
            continue
        plain = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if not unicodedata.combining(c))
        groups = len(re.findall(r"[" + "".join(sorted(_VOWELS)) + r"]+", plain))
        n += max(1, groups)
    return n


def _voiced_seconds(wav: np.ndarray, sr: int) -> float:
    """Duration between the first and last 20 ms frame louder than -40 dB below the clip's peak frame."""
    hop = max(1, sr // 50)
    n = wav.shape[0] // hop
    if n < 2:
        return wav.shape[0] / sr
    rms = np.sqrt(np.mean(np.square(wav[: n * hop].reshape(n, hop), dtype=np.float64), axis=1))
    loud = np.nonzero(rms > rms.max() * 0.01)[0]
    return max((loud[-1] - loud[0] + 1) * hop / sr, 0.25) if loud.size else wav.shape[0] / sr


def ref_text_mismatch(ref_text: str, wav: np.ndarray, sr: int, min_rate: float = 1.0,
                      max_rate: float = 12.0) -> str | None:
    """A message when ref_text has far too few or far too many syllables for the clip's speech duration
    (natural speech is about 2-8 syllables per second), else None."""
    seconds = _voiced_seconds(wav, sr)
    units = speech_units(ref_text)
    rate = units / seconds
    if rate < min_rate:
        return (f"ref_text looks far too short for the reference audio: about {units} syllable(s) for "
                f"{seconds:.1f} s of sound ({rate:.1f}/s; speech is 2-8/s). ICL needs the full, exact transcript "
                "of the clip; a partial one tends to make the output collapse, repeat or babble. Give the whole "
                "transcript, trim the clip, or use x_vector_only_mode=True.")
    if rate > max_rate:
        return (f"ref_text looks far too long for the reference audio: about {units} syllables for {seconds:.1f} s "
                f"of sound ({rate:.1f}/s; speech is 2-8/s). Is it the transcript of this clip?")
    return None


# --------------------------------------------------------------------------- voices
@dataclass
class Voice:
    """A cloned voice, computed once and reused: the x-vector, and for ICL the reference codes + transcript."""

    embedding: torch.Tensor  # [D] float32 x-vector (D = talker hidden size: 1024 for 0.6B, 2048 for 1.7B)
    ref_code: torch.Tensor | None = None  # [T, 16] int64 codec frames of the reference (ICL voices)
    ref_text: str | None = None  # transcript of the reference (ICL voices)
    model_size: str = ""  # "0b6" | "1b7": the Base model whose speaker encoder made the embedding
    model_family: str = MODEL_FAMILY
    name: str | None = None

    @property
    def icl(self) -> bool:
        return self.ref_code is not None

    def to_prompt_item(self, x_vector_only_mode: bool | None = None):
        """-> VoiceClonePromptItem; ICL when the voice has reference codes unless x_vector_only_mode=True."""
        xvec = (not self.icl) if x_vector_only_mode is None else bool(x_vector_only_mode)
        if not xvec and not self.icl:
            raise ValueError(f"voice {self.name or ''}: ICL mode needs reference codes; this voice has only an "
                             "x-vector (made with x_vector_only_mode=True)")
        return VoiceClonePromptItem(ref_code=None if xvec else self.ref_code, ref_spk_embedding=self.embedding,
                                    x_vector_only_mode=xvec, icl_mode=not xvec,
                                    ref_text=None if xvec else self.ref_text)

    @classmethod
    def from_prompt_item(cls, item: Any, model_size: str, name: str | None = None) -> Voice:
        code = getattr(item, "ref_code", None)
        icl = bool(getattr(item, "icl_mode", False)) and code is not None
        return cls(embedding=torch.as_tensor(item.ref_spk_embedding).detach().float().cpu().reshape(-1),
                   ref_code=torch.as_tensor(code).detach().long().cpu() if icl else None,
                   ref_text=item.ref_text if icl else None, model_size=model_size, name=name)

    def check_model(self, cfg: ModelConfig) -> None:
        """ValueError unless this voice fits the model (a Base model of the same family and size)."""
        if self.model_family != MODEL_FAMILY:  # parse_model_config accepts the 12 Hz models only
            raise ValueError(f"voice {self.name or ''} is for {self.model_family!r} models; this model is "
                             f"{MODEL_FAMILY!r}")
        if cfg.tts_model_type != "base":
            raise ValueError(f"voices need a Base model; this model is a {cfg.tts_model_type} model")
        D = cfg.talker.hidden_size
        if self.model_size != cfg.tts_model_size or self.embedding.numel() != D:
            raise ValueError(
                f"voice {self.name or ''} was made for the {_SIZE_NAMES.get(self.model_size, self.model_size)} "
                f"model (size {self.model_size!r}, {self.embedding.numel()}-d x-vector) but this model is "
                f"{_SIZE_NAMES.get(cfg.tts_model_size, cfg.tts_model_size)} (size {cfg.tts_model_size!r}, "
                f"{D}-d): x-vectors of different model sizes are not interchangeable; clone the voice again "
                "with this model")

    def save(self, path: str | os.PathLike) -> None:
        """One safetensors file: tensors `embedding` [D] and `ref_code` [T, 16] (ICL), the rest as metadata."""
        from safetensors.torch import save_file

        from .. import __version__
        tensors = {"embedding": self.embedding.detach().float().cpu().contiguous().reshape(-1)}
        if self.ref_code is not None:
            tensors["ref_code"] = self.ref_code.detach().long().cpu().contiguous()
        meta = {"format": VOICE_FORMAT, "format_version": str(VOICE_FORMAT_VERSION), "model_family": self.model_family,
                "model_size": self.model_size, "mode": "icl" if self.icl else "x_vector",
                "embedding_dim": str(self.embedding.numel()), "q3tts_version": __version__}
        if self.ref_text is not None:
            meta["ref_text"] = self.ref_text
        if self.name is not None:
            meta["name"] = self.name
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike, model: ModelConfig | None = None) -> Voice:
        """Read a voice file; with `model`, also check it fits that model (ValueError if not)."""
        from safetensors import safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError:
            raise
        except Exception as e:
            raise ValueError(f"{path}: not a voice file (safetensors): {type(e).__name__}: {e}") from e
        if meta.get("format") != VOICE_FORMAT or "embedding" not in tensors:
            raise ValueError(f"{path}: not a q3tts voice file (metadata format={meta.get('format')!r})")
        version = int(meta.get("format_version", "0"))
        if version > VOICE_FORMAT_VERSION:
            raise ValueError(f"{path}: voice format version {version} is newer than this q3tts supports "
                             f"({VOICE_FORMAT_VERSION}); upgrade q3tts")
        code = tensors.get("ref_code")
        if code is not None and (code.dim() != 2 or code.shape[0] == 0):
            raise ValueError(f"{path}: ref_code must be [T, 16] with T > 0, got {tuple(code.shape)}")
        if code is not None and not meta.get("ref_text"):
            raise ValueError(f"{path}: an ICL voice needs its ref_text")
        voice = cls(embedding=tensors["embedding"].float().reshape(-1), ref_code=None if code is None else code.long(),
                    ref_text=meta.get("ref_text"), model_size=meta.get("model_size", ""),
                    model_family=meta.get("model_family", ""), name=meta.get("name"))
        if model is not None:
            voice.check_model(model)
        return voice


# --------------------------------------------------------------------------- the cloner
def _per_item(x: Any, n: int) -> list:
    return list(x) if isinstance(x, list) else [x] * n


class VoiceCloner:
    """Speaker encoder + codec encoder of a Base checkpoint, loaded lazily on first use.

    Both run in float32 by default (they run once per voice; fp32 keeps the x-vector and codes exact)."""

    def __init__(self, model_dir: str | os.PathLike, cfg: ModelConfig | None = None,
                 speech_cfg: SpeechTokenizerConfig | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.model_dir = Path(model_dir)
        self.cfg = cfg or parse_model_config(read_json(self.model_dir / "config.json"))
        self.speech_cfg = speech_cfg or parse_speech_tokenizer_config(
            read_json(self.model_dir / "speech_tokenizer" / "config.json"))
        if self.cfg.tts_model_type != "base" or self.cfg.speaker_encoder is None:
            raise ValueError(f"voice cloning needs a Base model; {self.model_dir} is a {self.cfg.tts_model_type} "
                             f"model (size {self.cfg.tts_model_size}). Use e.g. Qwen/Qwen3-TTS-12Hz-0.6B-Base.")
        self.device, self.dtype = torch.device(device), dtype
        self._speaker_encoder: SpeakerEncoder | None = None
        self._codec_encoder: CodecEncoder | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> VoiceCloner:
        return cls(resolve_model_dir(name_or_path), device=device, dtype=dtype)

    # ------------------------------------------------------------------ lazy modules
    @property
    def speaker_encoder(self) -> SpeakerEncoder:
        with self._lock:
            if self._speaker_encoder is None:
                self._speaker_encoder = load_speaker_encoder(self.model_dir, self.cfg, self.device, self.dtype)
            return self._speaker_encoder

    @property
    def codec_encoder(self) -> CodecEncoder:
        with self._lock:
            if self._codec_encoder is None:
                self._codec_encoder = load_codec_encoder(self.model_dir, self.speech_cfg, self.device, self.dtype)
            return self._codec_encoder

    # ------------------------------------------------------------------ pieces
    def speaker_embedding(self, wav24: np.ndarray) -> torch.Tensor:
        """24 kHz mono clip -> x-vector [D] (float32, CPU)."""
        return self.speaker_encoder.embed(wav24)

    def encode(self, wavs24: list[np.ndarray]) -> list[torch.Tensor]:
        """24 kHz mono clips, encoded as one zero-padded batch -> codes [T_i, 16] (int64, CPU) each."""
        return self.codec_encoder.encode(wavs24, hop=self.speech_cfg.encode_downsample_rate)

    # ------------------------------------------------------------------ the official entry point
    def create_voice_clone_prompt(self, ref_audio: Any, ref_text: str | list[str | None] | None = None,
                                  x_vector_only_mode: bool | list[bool] = False, *, append_silence: bool = True,
                                  allow_urls: bool = False, allow_paths: bool = True,
                                  limits: AudioLimits | None = None) -> list:
        """Build voice-clone prompt items from reference audio, as `qwen_tts`'s method of the same name.

        Args:
            ref_audio: one clip or a list: path, bytes, base64 / data URL, (waveform, sr), URL (allow_urls).
            ref_text: transcript(s) of the clip(s); required for ICL (x_vector_only_mode=False).
            x_vector_only_mode: True: speaker embedding only; False: ICL (embedding + codes + transcript).
            append_silence: append 0.5 s of silence before encoding ICL codes (see module doc); False gives
                upstream-identical codes.
            allow_urls / allow_paths / limits: see q3tts.audio.load_audio.
        Returns:
            list[VoiceClonePromptItem], one per clip.
        """
        audios = ref_audio if isinstance(ref_audio, list) else [ref_audio]
        n = len(audios)
        if n == 0:
            raise ValueError("ref_audio is empty")
        texts = _per_item(ref_text, n)
        xvecs = _per_item(x_vector_only_mode, n)
        if len(texts) != n or len(xvecs) != n:
            raise ValueError(f"Batch size mismatch: ref_audio={n}, ref_text={len(texts)}, "
                             f"x_vector_only_mode={len(xvecs)}")
        for i, (t, xv) in enumerate(zip(texts, xvecs)):
            if not xv and not t:
                raise ValueError(f"ref_text is required when x_vector_only_mode=False (ICL mode). Bad index={i}: "
                                 "give the transcript of the reference clip, or pass x_vector_only_mode=True")
        loaded = [load_audio(a, allow_urls=allow_urls, allow_paths=allow_paths, limits=limits,
                             what=f"ref_audio[{i}]" if n > 1 else "ref_audio") for i, a in enumerate(audios)]
        for i, ((wav, sr), t, xv) in enumerate(zip(loaded, texts, xvecs)):
            if not xv and (msg := ref_text_mismatch(t, wav, sr)):
                warnings.warn(f"ref_audio[{i}]: {msg}", RefTextWarning, stacklevel=2)
        wavs24 = [resample(wav, sr, TARGET_SR) for wav, sr in loaded]

        codes: list[torch.Tensor | None] = [None] * n
        if not all(xvecs):
            pad = np.zeros(int(round(ICL_SILENCE_SECONDS * TARGET_SR)), dtype=np.float32)
            enc_in = [np.concatenate([w, pad]) if append_silence and not xv else w for w, xv in zip(wavs24, xvecs)]
            if len({sr for _, sr in loaded}) == 1:  # upstream: one padded batch over every clip
                codes = self.encode(enc_in)
            else:  # upstream: one by one
                codes = [None if xv else self.encode([w])[0] for w, xv in zip(enc_in, xvecs)]

        return [VoiceClonePromptItem(ref_code=None if xv else code, ref_spk_embedding=self.speaker_embedding(w24),
                                     x_vector_only_mode=bool(xv), icl_mode=not xv, ref_text=t)
                for w24, code, t, xv in zip(wavs24, codes, texts, xvecs)]

    def create_voice(self, ref_audio: Any, ref_text: str | None = None, x_vector_only_mode: bool = False,
                     name: str | None = None, **kwargs) -> Voice:
        """One clip -> a reusable Voice (save it with voice.save(path)). kwargs as create_voice_clone_prompt."""
        if isinstance(ref_audio, list):
            raise ValueError("create_voice takes one reference clip; use create_voice_clone_prompt for a batch")
        item = self.create_voice_clone_prompt(ref_audio, ref_text, x_vector_only_mode, **kwargs)[0]
        return Voice.from_prompt_item(item, self.cfg.tts_model_size, name=name)


def voice_summary(voice: Voice) -> str:
    """One line for CLIs and logs."""
    mode = f"ICL, {voice.ref_code.shape[0]} frames" if voice.icl else "x-vector only"
    size = _SIZE_NAMES.get(voice.model_size, voice.model_size)
    text = f", ref_text={json.dumps(voice.ref_text[:60], ensure_ascii=False)}" if voice.ref_text else ""
    return f"{voice.name or 'voice'}: {voice.model_family} {size}, {mode}, {voice.embedding.numel()}-d{text}"


__all__ = [
    "ICL_SILENCE_SECONDS",
    "RefTextWarning",
    "Voice",
    "VoiceCloner",
    "ref_text_mismatch",
    "speech_units",
    "voice_summary",
]
