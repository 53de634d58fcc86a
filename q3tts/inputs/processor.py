"""InputProcessor: the one place where a request's model type, speaker, language, instruction, voice and
sampling parameters are resolved and checked, and turned into PreparedRequests (the TTS facade and the
server both call it; nothing below it validates user input again).

Arguments follow `qwen_tts.Qwen3TTSModel`: a text or a list of texts (a batch), and per-text arguments
given once (broadcast) or once per text. A text of None is streamed in: the request gets a TextStream.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import warnings
from typing import Any

import torch

from ..config import GenerationDefaults, ModelConfig
from ..sampling import SamplingParams
from .prompt import PromptBuilder, PromptSpec
from .request import MAX_FRAMES_PER_TOKEN, InputError, PreparedRequest, VoiceClonePromptItem
from .text import TextStream
from .voice import Voice

log = logging.getLogger("q3tts")

METHODS = {"custom_voice": "generate_custom_voice", "voice_design": "generate_voice_design",
           "base": "generate_voice_clone"}
KINDS = {"custom_voice": "a CustomVoice", "voice_design": "a VoiceDesign", "base": "a Base"}


def _as_list(x: Any, n: int | None = None, name: str = "") -> list:
    out = x if isinstance(x, list) else [x]
    if n is not None and len(out) == 1 and n > 1:
        out = out * n
    if n is not None and len(out) != n:
        raise InputError(f"Batch size mismatch: text={n}, {name}={len(out)}", param=name)
    return out


def check_text(value: str | None, param: str) -> None:
    """InputError if the text cannot be encoded: a lone surrogate (U+D800..U+DFFF, which JSON's "\\ud800" escapes
    and Python strings can carry) is no Unicode character, and the tokenizer cannot take it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"{param} is not valid Unicode text: a lone surrogate U+{ord(value[e.start]):04X} at "
                             f"character {e.start} (send UTF-8 text; a surrogate pair must be complete)",
                             param=param, code="invalid_text") from None


class InputProcessor:
    def __init__(self, cfg: ModelConfig, defaults: GenerationDefaults, builder: PromptBuilder, codebook_size: int):
        self.cfg, self.defaults, self.builder, self.codebook_size = cfg, defaults, builder, codebook_size
        self.gen_kwargs = set(SamplingParams.names())
        self.max_frames_per_token = MAX_FRAMES_PER_TOKEN  # the runaway guard's default (PreparedRequest.frame_cap)

    # ------------------------------------------------------------------ checks
    def require(self, model_type: str, method: str) -> None:
        have = self.cfg.tts_model_type
        if have != model_type:
            raise InputError(f"{method} needs {KINDS[model_type]} model; this is a {have} model (size "
                             f"{self.cfg.tts_model_size}). Use {METHODS[have]} with this model.",
                             code="unsupported_for_model")

    def check_options(self, instruct=None, ref_audio=None, ref_text=None, x_vector_only_mode=False) -> None:
        """InputError naming an option this model cannot use and the model type, rather than ignoring it."""
        have, size = self.cfg.tts_model_type, self.cfg.tts_model_size
        model = f"this is {KINDS[have]} model (size {size})"
        if instruct and str(instruct).strip() and (have == "base" or (have == "custom_voice" and size == "0b6")):
            raise InputError(f"instruct is not supported: {model}, which takes no instruction (style instructions need "
                             "a 1.7B CustomVoice model; a voice described in words a VoiceDesign model)",
                             param="instruct", code="unsupported_for_model")
        if have != "base":
            for name, given in (("ref_audio", ref_audio), ("ref_text", ref_text),
                                ("x_vector_only_mode", x_vector_only_mode)):
                if given:
                    raise InputError(f"{name} is not supported: {model}; cloning a voice from reference audio needs a "
                                     "Base model", param=name, code="unsupported_for_model")

    def language(self, language: str | None) -> str:
        lang = "auto" if language is None else str(language).strip().lower()
        if lang not in self.cfg.languages:
            raise InputError(f"Unsupported language {language!r}. Supported: {self.cfg.languages}", param="language",
                             code="unsupported_language")
        return lang

    def speaker(self, speaker: str | None) -> str:
        if speaker is None or not str(speaker).strip():
            raise InputError(f"speaker is required: one of this model's speakers: {self.cfg.speakers}",
                             param="speaker", code="missing_voice")
        spk = str(speaker).strip().lower()
        if spk not in self.cfg.talker.spk_id:
            raise InputError(f"Unsupported speaker {speaker!r}. Supported: {self.cfg.speakers}", param="speaker",
                             code="voice_not_found")
        return spk

    def sampling_params(self, **kwargs) -> SamplingParams:
        """generation_config.json defaults, overridden by the non-None kwargs; unknown ones are ignored with a
        warning (qwen_tts forwards them to transformers' generate). No seed: a random one."""
        unknown = sorted(set(kwargs) - self.gen_kwargs)
        if unknown:
            log.warning("ignoring unsupported generation argument(s): %s", ", ".join(unknown))
        given = {k: v for k, v in kwargs.items() if k in self.gen_kwargs and v is not None}
        p = SamplingParams(**{**dataclasses.asdict(self.defaults), **given})
        if kwargs.get("seed") is None:
            p.seed = random.randrange(1 << 31)
        try:
            p.validate()
        except ValueError as e:
            raise InputError(str(e), param=str(e).split()[0]) from None
        return p

    # ------------------------------------------------------------------ the three modes
    def custom_voice(self, text, speaker, language=None, instruct=None, non_streaming_mode: bool = True,
                     **kwargs) -> list[PreparedRequest]:
        self.require("custom_voice", "generate_custom_voice")
        texts = _as_list(text)
        n = len(texts)
        speakers = [self.speaker(s) for s in _as_list(speaker, n, "speaker")]
        languages = [self.language(x) for x in _as_list(language, n, "language")]
        instructs = _as_list(instruct, n, "instruct")
        for ins in instructs:
            check_text(ins, "instruct")
        instructs = [ins if ins and ins.strip() else None for ins in instructs]
        if self.cfg.tts_model_size == "0b6" and any(instructs):
            # NOTE(drop-in): upstream drops it unseen and TTS keeps its behaviour, saying so; the server and the CLI
            # refuse it (check_options), where no upstream code depends on it.
            warnings.warn("instruct is ignored: a 0.6B CustomVoice model takes no instruction (style instructions "
                          "need a 1.7B CustomVoice model)", stacklevel=3)
            instructs = [None] * n
        specs = [self.builder.spec(lang, speaker=s, instruct=ins, non_streaming_mode=non_streaming_mode)
                 for lang, s, ins in zip(languages, speakers, instructs)]
        return self._prepare(texts, specs, [None] * n, [None] * n, kwargs)

    def voice_design(self, text, instruct, language=None, non_streaming_mode: bool = True,
                     **kwargs) -> list[PreparedRequest]:
        self.require("voice_design", "generate_voice_design")
        texts = _as_list(text)
        n = len(texts)
        languages = [self.language(x) for x in _as_list(language, n, "language")]
        instructs = _as_list(instruct, n, "instruct")
        for ins in instructs:
            check_text(ins, "instruct")
        specs = [self.builder.spec(lang, instruct=ins, non_streaming_mode=non_streaming_mode)
                 for lang, ins in zip(languages, instructs)]
        return self._prepare(texts, specs, [None] * n, [None] * n, kwargs)

    def voice_clone(self, text, voice_clone_prompt, language=None, non_streaming_mode: bool = False,
                    **kwargs) -> list[PreparedRequest]:
        """voice_clone_prompt: items (ours or qwen_tts's), Voices, voice file paths, or upstream's dict of lists;
        one for all texts or one per text. Or a function that returns them (a clone of reference audio), called
        once the model type and the languages have passed: nothing is cloned in vain."""
        self.require("base", "generate_voice_clone")
        self.check_options(instruct=kwargs.pop("instruct", None))
        texts = _as_list(text)
        n = len(texts)
        languages = [self.language(x) for x in _as_list(language, n, "language")]
        if callable(voice_clone_prompt):
            voice_clone_prompt = voice_clone_prompt()
        items = _as_list(self.voice_items(voice_clone_prompt), n, "voice_clone_prompt")
        checked = [self.check_item(i, it) for i, it in enumerate(items)]
        specs = [self.builder.spec(lang, has_xvector=emb is not None, ref_text=it.ref_text,
                                   num_ref_frames=0 if ref is None else ref.shape[0],
                                   non_streaming_mode=non_streaming_mode)
                 for lang, it, (emb, ref) in zip(languages, items, checked)]
        return self._prepare(texts, specs, [e for e, _ in checked], [r for _, r in checked], kwargs)

    def _prepare(self, texts: list, specs: list[PromptSpec], embs: list, refs: list, kwargs) -> list[PreparedRequest]:
        guard = self.frame_guard(kwargs)
        params = self.sampling_params(**kwargs)
        out = []
        for text in texts:
            check_text(text, "text")
        for i, (text, spec, e, r) in enumerate(zip(texts, specs, embs, refs)):
            p = dataclasses.replace(params, seed=params.seed + i)  # distinct noise per row, reproducible from one seed
            if text is None:  # streamed in: the engine lays the prompt out once enough text has come
                out.append(PreparedRequest(None, e, r, p, TextStream(self.builder, spec), guard))
            else:
                ids = self.builder.text_ids(text)
                out.append(PreparedRequest(self.builder.build(spec, ids), e, r, p, None, guard, len(ids)))
        return out

    def frame_guard(self, kwargs: dict) -> float:
        """Frames per text token of the runaway guard (takes max_frames_per_token out of kwargs): none where the
        caller gives max_new_tokens (their cap), else kwargs' or this processor's default (0: off)."""
        fpt = kwargs.pop("max_frames_per_token", None)
        fpt = self.max_frames_per_token if fpt is None else fpt
        if isinstance(fpt, bool) or not isinstance(fpt, (int, float)) or not 0 <= fpt < float("inf"):
            raise InputError(f"max_frames_per_token must be a number >= 0 (0: no guard), got {fpt!r}",
                             param="max_frames_per_token")
        return 0.0 if kwargs.get("max_new_tokens") is not None else float(fpt)

    # ------------------------------------------------------------------ voices
    def voice_items(self, voice_clone_prompt) -> list[VoiceClonePromptItem]:
        """Accept a list of items (ours or qwen_tts's), Voices or voice file paths, or upstream's dict of lists."""
        if isinstance(voice_clone_prompt, dict):
            d = voice_clone_prompt
            n = len(d["ref_spk_embedding"])
            return [VoiceClonePromptItem(ref_code=(d.get("ref_code") or [None] * n)[i],
                                         ref_spk_embedding=d["ref_spk_embedding"][i],
                                         x_vector_only_mode=bool(d["x_vector_only_mode"][i]),
                                         icl_mode=bool(d["icl_mode"][i]),
                                         ref_text=(d.get("ref_text") or [None] * n)[i]) for i in range(n)]
        items = []
        for it in _as_list(voice_clone_prompt):
            if isinstance(it, (str, os.PathLike)):
                it = Voice.load(it)  # checked against this model below, as a Voice given as such
            if isinstance(it, Voice):
                it.check_model(self.cfg)
                it = it.to_prompt_item()
            elif not isinstance(it, VoiceClonePromptItem):  # e.g. qwen_tts's item
                it = VoiceClonePromptItem(
                    ref_code=getattr(it, "ref_code", None), ref_spk_embedding=it.ref_spk_embedding,
                    x_vector_only_mode=bool(it.x_vector_only_mode), icl_mode=bool(it.icl_mode),
                    ref_text=getattr(it, "ref_text", None))
            items.append(it)
        return items

    def check_item(self, i: int, it: VoiceClonePromptItem) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """-> (x-vector [D] or None, ICL reference codes [T, K] or None), checked against this model."""
        D, K = self.cfg.talker.hidden_size, self.cfg.talker.num_code_groups
        emb = it.ref_spk_embedding
        emb = torch.as_tensor(emb).float().reshape(-1) if emb is not None else None
        if (it.x_vector_only_mode or it.icl_mode) and (emb is None or emb.numel() != D):
            raise InputError(f"voice_clone_prompt[{i}]: speaker embedding has {None if emb is None else emb.numel()} "
                             f"values but this model ({self.cfg.tts_model_size}) needs {D}: the voice was made for "
                             "another model size", param="voice")
        ref = None
        if it.icl_mode:
            if it.ref_code is None:
                raise InputError(f"voice_clone_prompt[{i}]: ICL mode needs ref_code", param="voice")
            ref = torch.as_tensor(it.ref_code).long()
            if ref.dim() != 2 or ref.shape[1] != K or ref.shape[0] == 0:
                raise InputError(f"voice_clone_prompt[{i}]: ref_code must be [T, {K}] with T > 0, got "
                                 f"{tuple(ref.shape)}", param="voice")
            if int(ref.min()) < 0 or int(ref.max()) >= self.codebook_size:
                raise InputError(f"voice_clone_prompt[{i}]: ref_code values must be in [0, {self.codebook_size})",
                                 param="voice")
            check_text(it.ref_text, "ref_text")
            if not it.ref_text:
                raise InputError(f"voice_clone_prompt[{i}]: ICL mode needs ref_text (the transcript of the reference "
                                 "audio)", param="ref_text")
        return (emb if (it.x_vector_only_mode or it.icl_mode) else None), ref
