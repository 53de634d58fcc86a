"""Typed views of the Hugging Face JSON files of a Qwen3-TTS checkpoint.

Only the fields the engine uses are kept; everything is read from `config.json`,
`generation_config.json` and `speech_tokenizer/config.json` of the official layout.
No torch import here: the scheduler and the HTTP layer may read configs too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_TYPES = ("custom_voice", "voice_design", "base")


@dataclass(slots=True)
class DecoderLayerConfig:
    """A Qwen3 decoder stack (the talker and the code predictor share this shape)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # NOTE(head-dim): read from the config, never hidden_size // heads (0.6B: 128, not 64)
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int


@dataclass(slots=True)
class CodePredictorConfig(DecoderLayerConfig):
    num_code_groups: int = 16


@dataclass(slots=True)
class TalkerConfig(DecoderLayerConfig):
    text_hidden_size: int = 2048
    text_vocab_size: int = 151936
    num_code_groups: int = 16
    codec_bos_id: int = 2149
    codec_eos_token_id: int = 2150
    codec_pad_id: int = 2148
    codec_think_id: int = 2154
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_language_id: dict[str, int] = field(default_factory=dict)
    spk_id: dict[str, int] = field(default_factory=dict)
    spk_is_dialect: dict[str, str | bool] = field(default_factory=dict)
    code_predictor: CodePredictorConfig | None = None


@dataclass(slots=True)
class SpeakerEncoderConfig:
    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000


@dataclass(slots=True)
class Code2WavConfig:
    """The 12 Hz speech-tokenizer decoder (`speech_tokenizer/config.json` -> decoder_config)."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    num_quantizers: int = 16
    latent_dim: int = 1024
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 72
    layer_scale_initial_scale: float = 0.01
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536

    @property
    def total_upsample(self) -> int:
        """Waveform samples per codec frame (1920 = 24 kHz / 12.5 Hz)."""
        return math.prod((*self.upsample_rates, *self.upsampling_ratios))


@dataclass(slots=True)
class SpeechTokenizerConfig:
    decoder: Code2WavConfig
    encoder: dict[str, Any]  # Mimi config, used by the codec encoder (voice cloning)
    encoder_valid_num_quantizers: int = 16
    encode_downsample_rate: int = 1920


@dataclass(slots=True)
class GenerationDefaults:
    """`generation_config.json`; a request may override each field."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 2048

    def validate(self) -> None:
        """ValueError naming the first field outside its accepted range."""
        for name in ("temperature", "subtalker_temperature", "repetition_penalty"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("top_p", "subtalker_top_p"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("top_k", "subtalker_top_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables it), got {getattr(self, name)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(slots=True)
class ModelConfig:
    tts_model_type: str  # custom_voice | voice_design | base
    tts_model_size: str  # "0b6" | "1b7"
    tokenizer_type: str
    talker: TalkerConfig
    speaker_encoder: SpeakerEncoderConfig | None
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673

    @property
    def speakers(self) -> list[str]:
        return sorted(self.talker.spk_id)

    @property
    def languages(self) -> list[str]:
        """Accepted language names, lower case, as the official wrapper lists them (dialects excluded)."""
        return ["auto"] + sorted(k for k in self.talker.codec_language_id if "dialect" not in k)


def dataclass_kwargs(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """The entries of a JSON dict that are fields of dataclass cls, JSON lists turned into tuples."""
    fields = cls.__dataclass_fields__
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in fields}


def _layers(d: dict[str, Any], cls: type, **extra: Any) -> Any:
    """A decoder stack's config: the fields of cls that d has (head_dim, rms_norm_eps and rope_theta defaulting as
    upstream's), then `extra`."""
    defaults = {"head_dim": d["hidden_size"] // d["num_attention_heads"], "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    return cls(**{**defaults, **dataclass_kwargs(cls, d), **extra})


def parse_model_config(d: dict[str, Any]) -> ModelConfig:
    model_type = d.get("tts_model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: tts_model_type {model_type!r} is not one of {MODEL_TYPES}")
    if d.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
        raise ValueError(f"config.json: tokenizer_type {d.get('tokenizer_type')!r} is not supported "
                         "(only the 12 Hz models: qwen3_tts_tokenizer_12hz)")
    t = d["talker_config"]
    talker = _layers(
        t, TalkerConfig,
        codec_language_id={k.lower(): v for k, v in t.get("codec_language_id", {}).items()},
        spk_id={k.lower(): v for k, v in (t.get("spk_id") or {}).items()},
        spk_is_dialect={k.lower(): v for k, v in (t.get("spk_is_dialect") or {}).items()},
        code_predictor=_layers(t["code_predictor_config"], CodePredictorConfig),
    )
    spk = None
    if model_type == "base":
        spk = SpeakerEncoderConfig(**dataclass_kwargs(SpeakerEncoderConfig, d.get("speaker_encoder_config") or {}))
    # the special token ids default in ModelConfig
    defaults = {"tts_model_size": "", "tokenizer_type": "qwen3_tts_tokenizer_12hz"}
    return ModelConfig(**{**defaults, **dataclass_kwargs(ModelConfig, d), "talker": talker, "speaker_encoder": spk})


def parse_speech_tokenizer_config(d: dict[str, Any]) -> SpeechTokenizerConfig:
    decoder = Code2WavConfig(**dataclass_kwargs(Code2WavConfig, d.get("decoder_config") or {}))
    return SpeechTokenizerConfig(**{**dataclass_kwargs(SpeechTokenizerConfig, d), "decoder": decoder,
                                    "encoder": d.get("encoder_config") or {}})


def parse_generation_defaults(d: dict[str, Any], overrides: dict[str, Any] | str | Path | None = None
                              ) -> GenerationDefaults:
    """generation_config.json's fields (others ignored, as transformers writes more), then `overrides` laid over them:
    a server's or a user's defaults for clients that send no sampling fields (see generation_overrides)."""
    g = GenerationDefaults(**{**dataclass_kwargs(GenerationDefaults, d), **generation_overrides(overrides)})
    try:
        g.validate()  # the overrides are valid: a value out of range is the checkpoint's own
    except ValueError as e:
        raise ValueError(f"generation_config.json: {e}") from None
    return g


def generation_overrides(src: dict[str, Any] | str | Path | None) -> dict[str, Any]:
    """Generation defaults to lay over a checkpoint's: a dict, or the path of a JSON object, of
    generation_config.json's fields (e.g. {"do_sample": false, "subtalker_dosample": false} for greedy).
    An unknown field, a value of the wrong type or out of range is a ValueError naming it and what is accepted."""
    if src is None:
        return {}
    where = "generation config overrides"
    if not isinstance(src, dict):
        where = f"generation config {src}"
        try:
            src = read_json(src)
        except OSError as e:
            raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(src, dict):
            raise ValueError(f"{where}: must be a JSON object of generation_config.json's fields, "
                             f"got {type(src).__name__}")
    fields_ = GenerationDefaults.__dataclass_fields__
    unknown = sorted(str(k) for k in src if k not in fields_)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(fields_)}")
    for name, value in src.items():
        kind = fields_[name].type  # "bool" | "int" | "float" (annotations are strings here)
        ok = isinstance(value, bool) if kind == "bool" else (
            not isinstance(value, bool) and isinstance(value, int if kind == "int" else (int, float)))
        if not ok:
            raise ValueError(f"{where}: {name} must be a JSON {_JSON_KINDS[kind]}, got {value!r}")
    try:
        GenerationDefaults(**src).validate()  # the given fields' ranges (the defaults are valid)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return dict(src)


_JSON_KINDS = {"bool": "boolean (true / false)", "int": "integer", "float": "number"}


def read_json(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
