"""Public API: a drop-in for `qwen_tts.Qwen3TTSModel` (same methods, arguments and return values).

    from q3tts import TTS
    tts = TTS.from_pretrained("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    wavs, sr = tts.generate_custom_voice("Hello!", speaker="Vivian", language="English")
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .config import (GenerationDefaults, ModelConfig, parse_generation_defaults, parse_model_config,
                     parse_speech_tokenizer_config, read_json)
from .engine.engine import AudioChunk, Engine
from .engine.request import StreamOptions
from .models.codec import Code2Wav
from .models.layers import fuse_projections
from .models.quant import check_mode as check_quantization, quantize_
from .models.talker import Talker
from .prompt import PromptBuilder, PromptLayout, TextTokenizer
from .sampling import SamplingParams
from .weights import check_prefixes, load_module, read_tensors, resolve_model_dir, safetensors_files

log = logging.getLogger("q3tts")

GEN_KWARGS = set(SamplingParams.names())


@dataclass
class VoiceClonePromptItem:
    """One voice-clone prompt, field for field as `qwen_tts.VoiceClonePromptItem`."""

    ref_code: torch.Tensor | None  # [T, 16] codec frames of the reference audio (ICL), or None
    ref_spk_embedding: torch.Tensor  # [D] x-vector
    x_vector_only_mode: bool
    icl_mode: bool
    ref_text: str | None = None


@dataclass
class PreparedRequest:
    """A request ready for the engine: its prompt layout and what fills the layout's slots."""

    layout: PromptLayout
    speaker_embedding: torch.Tensor | None  # [D] x-vector (voice clone)
    ref_codes: torch.Tensor | None  # [T, 16] ICL reference frames (decoded in front, then cut)
    params: SamplingParams


def _as_list(x: Any, n: int | None = None, name: str = "") -> list:
    out = x if isinstance(x, list) else [x]
    if n is not None and len(out) == 1 and n > 1:
        out = out * n
    if n is not None and len(out) != n:
        raise ValueError(f"Batch size mismatch: text={n}, {name}={len(out)}")
    return out


class TTS:
    def __init__(self, model_dir, cfg: ModelConfig, defaults: GenerationDefaults, talker: Talker,
                 code2wav: Code2Wav, builder: PromptBuilder, device: torch.device, dtype: torch.dtype,
                 max_batch_size: int = 8, max_seq_len: int = 4096, compile: bool | None = None):
        self.model_dir, self.cfg, self.generate_defaults = model_dir, cfg, defaults
        self.compile = compile
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self._engine: Engine | None = None
        self._cloner = None
        self.talker, self.code2wav, self.builder = talker, code2wav, builder
        self.device, self.dtype = device, dtype
        self.sample_rate = 24000
        self.samples_per_frame = code2wav.cfg.total_upsample
        with torch.inference_mode():
            self.tts_pad_embed = talker.embed_text(torch.tensor([cfg.tts_pad_token_id], device=device))[0]

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None, max_batch_size: int = 8,
                        max_seq_len: int = 4096, compile: bool | None = None,
                        quantization: str | None = None) -> "TTS":
        """Load a local directory in the official layout or a Hugging Face repo id.

        Args:
            name_or_path: e.g. "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice" or a directory.
            device: default CUDA when available, else CPU.
            dtype: default bfloat16 on CUDA, float32 on CPU.
            max_batch_size: requests decoded together (more are queued).
            max_seq_len: KV-cache positions per request: prompt + frames (12.5 frames per second of audio).
            compile: torch.compile the decoder layers and samplers before capturing CUDA graphs (default: on
                for CUDA; ~1 min once per process, then 1.7x faster frames; Q3TTS_COMPILE=0 disables).
            quantization: weight-only quantization of the talker and code predictor: None (exact), "int8" or
                "int4" on CPU, "int8" or "fp8" on CUDA. Close to, not token-exact with, the unquantized model.
        """
        d = resolve_model_dir(name_or_path)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        check_quantization(quantization, device)  # a bad value fails before the weights are read
        cfg = parse_model_config(read_json(d / "config.json"))
        defaults = parse_generation_defaults(read_json(d / "generation_config.json"))
        scfg = parse_speech_tokenizer_config(read_json(d / "speech_tokenizer" / "config.json"))

        files = safetensors_files(d / "model")
        check_prefixes(files, ("talker.", "speaker_encoder."), str(d / "model.safetensors"))
        with torch.device("meta"):
            talker = Talker(cfg.talker)
        talker = talker.to_empty(device="cpu")  # no buffers: every tensor is loaded below
        load_module(talker, read_tensors(files, "talker."), f"{d}/model.safetensors (talker.*)")
        speech_files = safetensors_files(d / "speech_tokenizer" / "model")
        check_prefixes(speech_files, ("decoder.", "encoder."), f"{d}/speech_tokenizer/model.safetensors")
        code2wav = Code2Wav(scfg.decoder)
        load_module(code2wav, read_tensors(speech_files, "decoder."), f"{d}/speech_tokenizer (decoder.*)")
        talker = talker.to(device=device, dtype=dtype).eval()
        if device.type == "cuda":
            fuse_projections(talker)  # one GEMM for q|k|v and for gate|up (the CPU path stays upstream-shaped)
        quantize_(talker, quantization, device)
        # the vocoder runs in fp32 on CPU; on GPU in the engine dtype
        code2wav = code2wav.to(device=device, dtype=dtype).eval()
        builder = PromptBuilder(cfg, TextTokenizer(d))
        return cls(d, cfg, defaults, talker, code2wav, builder, device, dtype, max_batch_size, max_seq_len, compile)

    # ------------------------------------------------------------------ info
    @property
    def tts_model_type(self) -> str:
        return self.cfg.tts_model_type

    def get_supported_speakers(self) -> list[str] | None:
        return self.cfg.speakers

    def get_supported_languages(self) -> list[str] | None:
        return self.cfg.languages

    def _require(self, model_type: str, method: str) -> None:
        if self.cfg.tts_model_type != model_type:
            need = {"custom_voice": "a CustomVoice", "voice_design": "a VoiceDesign", "base": "a Base"}[model_type]
            raise ValueError(f"{method} needs {need} model; {self.model_dir} is a {self.cfg.tts_model_type} model "
                             f"(size {self.cfg.tts_model_size}). Use " + {
                                 "custom_voice": "generate_custom_voice", "voice_design": "generate_voice_design",
                                 "base": "generate_voice_clone"}[self.cfg.tts_model_type] + " with this model.")

    # ------------------------------------------------------------------ generation plumbing
    def sampling_params(self, **kwargs) -> SamplingParams:
        """generation_config.json defaults, overridden by the non-None kwargs; unknown ones are ignored with a
        warning (qwen_tts forwards them to transformers' generate)."""
        unknown = sorted(set(kwargs) - GEN_KWARGS)
        if unknown:
            log.warning("ignoring unsupported generation argument(s): %s", ", ".join(unknown))
        d = self.generate_defaults
        p = SamplingParams(**{f: getattr(d, f) for f in GenerationDefaults.__dataclass_fields__})
        for k, v in kwargs.items():
            if k in GEN_KWARGS and v is not None:
                setattr(p, k, v)
        if "seed" not in kwargs or kwargs["seed"] is None:
            p.seed = random.randrange(1 << 31)
        p.validate()
        return p

    def _prepare(self, layouts, spk, refs, kwargs) -> list[PreparedRequest]:
        params = self.sampling_params(**kwargs)
        out = []
        for i, (lay, e, r) in enumerate(zip(layouts, spk, refs)):
            p = dataclasses.replace(params, seed=params.seed + i)  # distinct noise per row, reproducible from one seed
            out.append(PreparedRequest(lay, e, r, p))
        return out

    @property
    def engine(self) -> Engine:
        """The engine behind every call (created on first use; static caches for max_batch_size requests)."""
        if self._engine is None:
            self._engine = Engine(self, max_slots=self.max_batch_size, max_seq_len=self.max_seq_len)
        return self._engine

    def generate_codes(self, prepared: list[PreparedRequest]) -> list[torch.Tensor]:
        """Run the talker + code predictor for prepared requests -> codes [T_i, 16] each."""
        return self.engine.generate_codes(prepared)

    def stream(self, prepared: list[PreparedRequest], first_chunk_frames: int = 1,
               chunk_frames: int = 16) -> Iterator[AudioChunk]:
        """Streaming synthesis of prepared requests: AudioChunks as frames are generated (exact stateful decoder)."""
        start = time.perf_counter()
        eng = self.engine
        reqs = [eng.add_request(p, StreamOptions(first_chunk_frames, chunk_frames)) for p in prepared]
        ids = {r.request_id for r in reqs}
        for r in reqs:
            r.arrival_time = start  # time to first audio counts prompt processing too
        try:
            while not all(r.stream_done for r in reqs):
                for chunk in eng.step():
                    if chunk.request_id in ids:
                        if chunk.error:
                            raise ValueError(chunk.error)
                        yield chunk
        finally:
            for r in reqs:
                if not r.status.finished:
                    eng.abort(r.request_id)
            if any(not r.status.finished for r in reqs):
                eng.step()

    def _synthesize(self, prepared: list[PreparedRequest]) -> tuple[list[np.ndarray], int]:
        return self.decode(self.generate_codes(prepared), [p.ref_codes for p in prepared]), self.sample_rate

    def decode(self, codes: list[torch.Tensor], ref_codes: list[torch.Tensor | None] | None = None) -> list[np.ndarray]:
        """Codes [T, 16] per request -> waveforms (float32, 24 kHz), as upstream: ICL reference codes are decoded
        in front as context and their share of the audio is cut off."""
        ref_codes = ref_codes or [None] * len(codes)
        full = [c if r is None else torch.cat([r.to(c.device), c], 0) for c, r in zip(codes, ref_codes)]
        with torch.inference_mode():
            wavs = self.code2wav.decode_batch([c.to(self.device) for c in full])
        out = []
        for w, c, r in zip(wavs, full, ref_codes):
            w = w.float().cpu().numpy()
            if r is not None:
                w = w[int(r.shape[0] / max(c.shape[0], 1) * w.shape[0]):]  # upstream's proportional cut
            out.append(w)
        return out

    # ------------------------------------------------------------------ the three modes
    def generate_custom_voice(self, text, speaker, language=None, instruct=None, non_streaming_mode: bool = True,
                              **kwargs) -> tuple[list[np.ndarray], int]:
        """CustomVoice: a built-in speaker, optionally steered by an instruction (1.7B only; 0.6B ignores it).

        Args:
            text: a string or a list (a batch).
            speaker: a name from get_supported_speakers() (case-insensitive), or one per text.
            language: "Auto" (default) or a name from get_supported_languages(), or one per text.
            instruct: optional style instruction(s).
            non_streaming_mode: True puts the whole text in the prompt; False feeds it one token per frame.
            **kwargs: do_sample, temperature, top_k, top_p, repetition_penalty, subtalker_dosample,
                subtalker_temperature, subtalker_top_k, subtalker_top_p, max_new_tokens, seed.
        Returns:
            (list of float32 waveforms, 24000)
        """
        return self._synthesize(self.prepare_custom_voice(text, speaker, language, instruct, non_streaming_mode, **kwargs))

    def prepare_custom_voice(self, text, speaker, language=None, instruct=None, non_streaming_mode: bool = True,
                             **kwargs) -> list[PreparedRequest]:
        self._require("custom_voice", "generate_custom_voice")
        texts = _as_list(text)
        n = len(texts)
        speakers = [self.builder.resolve_speaker(s) for s in _as_list(speaker, n, "speaker")]
        if any(s is None for s in speakers):
            raise ValueError(f"speaker is required. Supported: {self.cfg.speakers}")
        languages = [self.builder.resolve_language(x) for x in _as_list(language if language is not None else "Auto", n, "language")]
        if self.cfg.tts_model_size == "0b6":
            instruct = None  # upstream: the 0.6B CustomVoice model takes no instruction
        instructs = _as_list(instruct if instruct is not None else "", n, "instruct")
        layouts = [self.builder.build(t, language=lang, speaker=s, instruct=ins, non_streaming_mode=non_streaming_mode)
                   for t, lang, s, ins in zip(texts, languages, speakers, instructs)]
        return self._prepare(layouts, [None] * n, [None] * n, kwargs)

    def generate_voice_design(self, text, instruct, language=None, non_streaming_mode: bool = True,
                              **kwargs) -> tuple[list[np.ndarray], int]:
        """VoiceDesign: a voice described in words (instruct); other arguments as generate_custom_voice."""
        return self._synthesize(self.prepare_voice_design(text, instruct, language, non_streaming_mode, **kwargs))

    def prepare_voice_design(self, text, instruct, language=None, non_streaming_mode: bool = True,
                             **kwargs) -> list[PreparedRequest]:
        self._require("voice_design", "generate_voice_design")
        texts = _as_list(text)
        n = len(texts)
        languages = [self.builder.resolve_language(x) for x in _as_list(language if language is not None else "Auto", n, "language")]
        instructs = _as_list(instruct, n, "instruct")
        layouts = [self.builder.build(t, language=lang, instruct=ins, non_streaming_mode=non_streaming_mode)
                   for t, lang, ins in zip(texts, languages, instructs)]
        return self._prepare(layouts, [None] * n, [None] * n, kwargs)

    def _prompt_items(self, voice_clone_prompt) -> list[VoiceClonePromptItem]:
        """Accept a list of items (ours or qwen_tts's), or upstream's dict of lists."""
        if isinstance(voice_clone_prompt, dict):
            d = voice_clone_prompt
            n = len(d["ref_spk_embedding"])
            return [VoiceClonePromptItem(ref_code=(d.get("ref_code") or [None] * n)[i], ref_spk_embedding=d["ref_spk_embedding"][i],
                                         x_vector_only_mode=bool(d["x_vector_only_mode"][i]), icl_mode=bool(d["icl_mode"][i]),
                                         ref_text=(d.get("ref_text") or [None] * n)[i]) for i in range(n)]
        from .voice import Voice
        items = []
        for it in _as_list(voice_clone_prompt):
            if isinstance(it, (str, os.PathLike)):
                it = self.load_voice(it)  # Voice.load checks that it fits this model
            elif isinstance(it, Voice):
                it.check_model(self.cfg)
            if isinstance(it, Voice):
                it = it.to_prompt_item()
            elif not isinstance(it, VoiceClonePromptItem):  # e.g. qwen_tts's item
                it = VoiceClonePromptItem(
                    ref_code=getattr(it, "ref_code", None), ref_spk_embedding=it.ref_spk_embedding,
                    x_vector_only_mode=bool(it.x_vector_only_mode), icl_mode=bool(it.icl_mode),
                    ref_text=getattr(it, "ref_text", None))
            items.append(it)
        return items

    def _check_item(self, i: int, it: VoiceClonePromptItem) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        D, K = self.cfg.talker.hidden_size, self.cfg.talker.num_code_groups
        emb = it.ref_spk_embedding
        emb = torch.as_tensor(emb).float().reshape(-1) if emb is not None else None
        if (it.x_vector_only_mode or it.icl_mode) and (emb is None or emb.numel() != D):
            raise ValueError(f"voice_clone_prompt[{i}]: speaker embedding has {None if emb is None else emb.numel()} "
                             f"values but this model ({self.cfg.tts_model_size}) needs {D}: the voice was made for "
                             "another model size")
        ref = None
        if it.icl_mode:
            if it.ref_code is None:
                raise ValueError(f"voice_clone_prompt[{i}]: ICL mode needs ref_code")
            ref = torch.as_tensor(it.ref_code).long()
            if ref.dim() != 2 or ref.shape[1] != K or ref.shape[0] == 0:
                raise ValueError(f"voice_clone_prompt[{i}]: ref_code must be [T, {K}] with T > 0, got {tuple(ref.shape)}")
            if int(ref.min()) < 0 or int(ref.max()) >= self.code2wav.cfg.codebook_size:
                raise ValueError(f"voice_clone_prompt[{i}]: ref_code values must be in [0, {self.code2wav.cfg.codebook_size})")
            if not it.ref_text:
                raise ValueError(f"voice_clone_prompt[{i}]: ICL mode needs ref_text (the transcript of the reference audio)")
        return (emb if (it.x_vector_only_mode or it.icl_mode) else None), ref

    def generate_voice_clone(self, text, language=None, ref_audio=None, ref_text=None, x_vector_only_mode=False,
                             voice_clone_prompt=None, non_streaming_mode: bool = False,
                             **kwargs) -> tuple[list[np.ndarray], int]:
        """Base models: clone a voice from reference audio or from prompt items (x-vector only, or ICL with
        reference codes + transcript); other arguments as generate_custom_voice."""
        return self._synthesize(self.prepare_voice_clone(text, language, ref_audio, ref_text, x_vector_only_mode,
                                                         voice_clone_prompt, non_streaming_mode, **kwargs))

    def prepare_voice_clone(self, text, language=None, ref_audio=None, ref_text=None, x_vector_only_mode=False,
                            voice_clone_prompt=None, non_streaming_mode: bool = False, **kwargs) -> list[PreparedRequest]:
        self._require("base", "generate_voice_clone")
        texts = _as_list(text)
        n = len(texts)
        languages = [self.builder.resolve_language(x) for x in _as_list(language if language is not None else "Auto", n, "language")]
        audio_kw = {k: kwargs.pop(k) for k in ("append_silence", "allow_urls", "allow_paths", "limits") if k in kwargs}
        if voice_clone_prompt is None:
            if ref_audio is None:
                raise ValueError("Either `voice_clone_prompt` or `ref_audio` must be provided.")
            voice_clone_prompt = self.create_voice_clone_prompt(ref_audio, ref_text, x_vector_only_mode, **audio_kw)
        items = _as_list(self._prompt_items(voice_clone_prompt), n, "voice_clone_prompt")
        checked = [self._check_item(i, it) for i, it in enumerate(items)]
        layouts = [self.builder.build(t, language=lang, has_xvector=emb is not None, ref_text=it.ref_text,
                                      num_ref_frames=0 if ref is None else ref.shape[0],
                                      non_streaming_mode=non_streaming_mode)
                   for t, lang, it, (emb, ref) in zip(texts, languages, items, checked)]
        return self._prepare(layouts, [e for e, _ in checked], [r for _, r in checked], kwargs)

    # ------------------------------------------------------------------ streaming variants
    def generate_custom_voice_stream(self, text, speaker, language=None, instruct=None, non_streaming_mode: bool = True,
                                     first_chunk_frames: int = 1, chunk_frames: int = 16, **kwargs) -> Iterator[AudioChunk]:
        """As generate_custom_voice, yielding AudioChunks (audio, sample_rate, frame_index, elapsed_s, ...) as
        frames are generated. The concatenated chunks equal the offline audio (exact stateful decoder).

        Args:
            first_chunk_frames: frames in the first chunk (80 ms each): small for low time to first audio.
            chunk_frames: the largest chunk; chunks double from the first one up to it.
        """
        return self.stream(self.prepare_custom_voice(text, speaker, language, instruct, non_streaming_mode, **kwargs),
                           first_chunk_frames, chunk_frames)

    def generate_voice_design_stream(self, text, instruct, language=None, non_streaming_mode: bool = True,
                                     first_chunk_frames: int = 1, chunk_frames: int = 16, **kwargs) -> Iterator[AudioChunk]:
        """As generate_voice_design, streaming (see generate_custom_voice_stream)."""
        return self.stream(self.prepare_voice_design(text, instruct, language, non_streaming_mode, **kwargs),
                           first_chunk_frames, chunk_frames)

    def generate_voice_clone_stream(self, text, language=None, ref_audio=None, ref_text=None, x_vector_only_mode=False,
                                    voice_clone_prompt=None, non_streaming_mode: bool = False, first_chunk_frames: int = 1,
                                    chunk_frames: int = 16, **kwargs) -> Iterator[AudioChunk]:
        """As generate_voice_clone, streaming; ICL reference codes warm the decoder once and are never emitted."""
        return self.stream(self.prepare_voice_clone(text, language, ref_audio, ref_text, x_vector_only_mode,
                                                    voice_clone_prompt, non_streaming_mode, **kwargs),
                           first_chunk_frames, chunk_frames)

    def voice_cloner(self):
        """Speaker encoder + codec encoder of this Base checkpoint (loaded on first use, fp32)."""
        self._require("base", "create_voice_clone_prompt")
        if self._cloner is None:
            from .voice import VoiceCloner
            self._cloner = VoiceCloner(self.model_dir, cfg=self.cfg, device=self.device)
        return self._cloner

    def create_voice_clone_prompt(self, ref_audio, ref_text=None, x_vector_only_mode=False, append_silence: bool = True,
                                  **audio_kwargs) -> list[VoiceClonePromptItem]:
        """Build voice-clone prompt items from reference audio (path, bytes, base64 / data URL, (array, sr)).

        Args:
            ref_text: transcript of the reference; required for ICL (x_vector_only_mode=False).
            append_silence: append 0.5 s of silence before encoding the ICL reference codes, so a reference
                that ends mid-word does not bleed into the first generated phoneme (False = upstream exactly).
            **audio_kwargs: allow_urls (default False), allow_paths, limits (q3tts.audio.AudioLimits).
        """
        return self.voice_cloner().create_voice_clone_prompt(ref_audio, ref_text, x_vector_only_mode,
                                                             append_silence=append_silence, **audio_kwargs)

    def create_voice(self, ref_audio, ref_text=None, x_vector_only_mode=False, name=None, **kwargs):
        """A reusable `q3tts.voice.Voice` (save it with .save(path), load with TTS.load_voice)."""
        return self.voice_cloner().create_voice(ref_audio, ref_text, x_vector_only_mode, name=name, **kwargs)

    def load_voice(self, path):
        """Load a voice file made for this model (a voice made for another model size is rejected)."""
        from .voice import Voice
        return Voice.load(path, model=self.cfg)
