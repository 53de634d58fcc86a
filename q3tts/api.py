"""Public API: a drop-in for `qwen_tts.Qwen3TTSModel` (same methods, arguments and return values).

    from q3tts import TTS
    tts = TTS.from_pretrained("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    wavs, sr = tts.generate_custom_voice("Hello!", speaker="Vivian", language="English")

A thin facade: a Checkpoint (q3tts.models.loaders), the InputProcessor (q3tts.inputs) and one Engine,
built on first use and shared with the server.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from . import invariant, longform
from .align import ForcedAligner, WordTime
from .engine import AsyncEngine, AudioChunk, Engine, StreamOptions
from .inputs.align_text import aligner_language
from .inputs.processor import InputProcessor
from .inputs.prompt import PromptBuilder, TextTokenizer
from .inputs.request import PreparedRequest, VoiceClonePromptItem
from .inputs.voice import Voice, VoiceCloner
from .models.loaders import Checkpoint, load_checkpoint


class TTS:
    def __init__(self, ckpt: Checkpoint, max_batch_size: int | None = 8, max_seq_len: int | None = None,
                 max_queue: int = 256, compile: bool | None = None, gpu_memory_utilization: float | None = None,
                 gpu_memory: float | None = None, compile_cache: str | os.PathLike | bool | None = None,
                 aligner: ForcedAligner | None = None, batch_invariant: bool | None = None,
                 compile_artifact: str | os.PathLike | None = None):
        self.ckpt, self.cfg = ckpt, ckpt.cfg
        self.aligner = aligner  # word timestamps (word_timestamps=True)
        self.processor = InputProcessor(ckpt.cfg, ckpt.defaults, PromptBuilder(ckpt.cfg, TextTokenizer(ckpt.model_dir)),
                                        ckpt.code2wav.cfg.codebook_size)
        self.engine_options = {"max_slots": max_batch_size, "max_seq_len": max_seq_len, "max_queue": max_queue,
                                   "compile": compile, "gpu_memory_utilization": gpu_memory_utilization,
                                   "gpu_memory": gpu_memory, "compile_cache": compile_cache,
                                   "batch_invariant": batch_invariant, "compile_artifact": compile_artifact}
        self.sample_rate, self.samples_per_frame = ckpt.sample_rate, ckpt.samples_per_frame
        self._engine: Engine | None = None
        self._driver: AsyncEngine | None = None
        self._cloner: VoiceCloner | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None, max_batch_size: int | None = 8,
                        max_seq_len: int | None = None, max_queue: int = 256, compile: bool | None = None,
                        quantization: str | None = None, gpu_memory_utilization: float | None = None,
                        gpu_memory: float | None = None, compile_cache: str | os.PathLike | bool | None = None,
                        generation_config: dict | str | os.PathLike | None = None,
                        aligner: str | os.PathLike | ForcedAligner | None = None,
                        batch_invariant: bool | None = None,
                        compile_artifact: str | os.PathLike | None = None) -> TTS:
        """Load a local directory in the official layout or a Hugging Face repo id.

        Args:
            name_or_path: e.g. "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice" or a directory.
            device: default CUDA when available, else CPU.
            dtype: default bfloat16 on CUDA, float32 on CPU.
            max_batch_size: requests decoded together (more are queued, up to max_queue); None: as many as the
                memory budget holds (at most 32 on CUDA, 4 on a CPU).
            max_seq_len: KV-cache positions per request: prompt + frames (12.5 frames per second of audio); None
                (default): 4096, or less where the memory budget cannot hold max_batch_size x 4096.
            gpu_memory_utilization: the memory budget as a fraction of the GPU's memory (default 0.9); on a CPU,
                of the host memory available after loading (default 0.5).
            gpu_memory: the memory budget in GB instead (a GPU shared with other work).
            compile: torch.compile the decoder layers and samplers before capturing CUDA graphs (default: on
                for CUDA: faster frames; Q3TTS_COMPILE=0 disables). What it compiles is kept in
                compile_cache.
            compile_cache: directory of torch.compile's caches, so the next process reuses what this one compiled
                (default: $Q3TTS_COMPILE_CACHE, else $TORCHINDUCTOR_CACHE_DIR, else ~/.cache/q3tts/compile/torch-<v>;
                False or "off": torch's default, /tmp/torchinductor_<user>).
            compile_artifact: a file from `q3tts warmup --save` (q3tts.engine.artifact): what a start elsewhere
                compiled, put into compile_cache before anything compiles (built for another GPU, torch, model or
                dtype: a warning and a normal cold start).
            quantization: quantization of the talker and code predictor: None (exact), "int8" / "int4"
                (weight-only) or "int8dyn" (int8 weights and activations: the fastest) on CPU, "int8" or "fp8" on
                CUDA. Close to, not token-exact with, the unquantized model.
            generation_config: generation defaults laid over the checkpoint's generation_config.json, as a dict or
                the path of a JSON file of its fields (e.g. {"do_sample": False, "subtalker_dosample": False}:
                greedy); a call's own arguments still win. Unknown fields and invalid values are a ValueError.
            aligner: a forced aligner (e.g. "Qwen/Qwen3-ForcedAligner-0.6B", a directory, or a ForcedAligner),
                loaded on the same device: then generate_*(..., word_timestamps=True) also returns word times.
            batch_invariant: on CUDA, a request's codes and audio bit-identical whatever requests share its steps
                (q3tts.invariant; slower: BENCHMARKS.md). Process-wide; default $Q3TTS_BATCH_INVARIANT=1, else off.
        """
        ckpt = load_checkpoint(name_or_path, device, dtype, quantization, generation_config)
        if aligner is not None and not isinstance(aligner, ForcedAligner):
            aligner = ForcedAligner.from_pretrained(aligner, device=ckpt.device)
        return cls(ckpt, max_batch_size, max_seq_len, max_queue, compile, gpu_memory_utilization, gpu_memory,
                   compile_cache, aligner, batch_invariant, compile_artifact)

    # ------------------------------------------------------------------ info
    @property
    def tts_model_type(self) -> str:
        return self.cfg.tts_model_type

    @property
    def device(self) -> torch.device:
        return self.ckpt.device

    def get_supported_speakers(self) -> list[str] | None:
        return self.cfg.speakers

    def get_supported_languages(self) -> list[str] | None:
        return self.cfg.languages

    @property
    def engine(self) -> Engine:
        """The engine behind every call, and the server's (built on first use: static caches, CUDA graphs)."""
        return self.build_engine()

    def build_engine(self, **options) -> Engine:
        """The engine, built now if it does not exist yet, with `options` (Engine's: max_slots, max_seq_len,
        max_queue, ...) over those given to from_pretrained; ValueError if it exists with other options."""
        with self._lock:
            if self._engine is None:
                self.engine_options.update(options)
                self._engine = Engine(self.ckpt, **self.engine_options)
            elif any(v is not None and self.engine_options.get(k) != v for k, v in options.items()):
                raise ValueError(f"the engine exists already with {self.engine_options}; "
                                 f"cannot rebuild it with {options}")
            return self._engine

    # ------------------------------------------------------------------ prepared requests
    def prepare_custom_voice(self, text, speaker, language=None, instruct=None, non_streaming_mode: bool = True,
                             **kwargs) -> list[PreparedRequest]:
        return self.processor.custom_voice(text, speaker, language, instruct, non_streaming_mode, **kwargs)

    def prepare_voice_design(self, text, instruct, language=None, non_streaming_mode: bool = True,
                             **kwargs) -> list[PreparedRequest]:
        return self.processor.voice_design(text, instruct, language, non_streaming_mode, **kwargs)

    def prepare_voice_clone(self, text, language=None, ref_audio=None, ref_text=None, x_vector_only_mode=False,
                            voice_clone_prompt=None, non_streaming_mode: bool = False,
                            **kwargs) -> list[PreparedRequest]:
        audio_kw = {k: kwargs.pop(k) for k in ("append_silence", "allow_urls", "allow_paths", "limits") if k in kwargs}

        def clone():  # the processor calls it once the model type and language have passed
            if ref_audio is None:
                raise ValueError("Either `voice_clone_prompt` or `ref_audio` must be provided.")
            return self.create_voice_clone_prompt(ref_audio, ref_text, x_vector_only_mode, **audio_kw)
        return self.processor.voice_clone(text, clone if voice_clone_prompt is None else voice_clone_prompt, language,
                                          non_streaming_mode, **kwargs)

    def warmup_request(self) -> PreparedRequest:
        """One short greedy request of this model's type (a default speaker, a plain design, a zero x-vector clone):
        what `q3tts serve` and `q3tts warmup` run to compile and capture before they are ready."""
        kw = {"max_new_tokens": 8, "seed": 0, "do_sample": False, "subtalker_dosample": False}
        if self.tts_model_type == "custom_voice":
            return self.prepare_custom_voice("Hello.", self.get_supported_speakers()[0], **kw)[0]
        if self.tts_model_type == "voice_design":
            return self.prepare_voice_design("Hello.", "A clear, calm voice.", **kw)[0]
        item = VoiceClonePromptItem(ref_code=None, ref_spk_embedding=torch.zeros(self.cfg.talker.hidden_size),
                                    x_vector_only_mode=True, icl_mode=False)
        return self.prepare_voice_clone("Hello.", voice_clone_prompt=[item], **kw)[0]

    @property
    def driver(self) -> AsyncEngine:
        """The one loop that steps the engine (q3tts.engine.AsyncEngine), shared with the server."""
        driver = AsyncEngine.of(self.engine)
        if driver is not self._driver:  # its thread holds the engine: it ends when this TTS is collected
            self._driver = driver
            weakref.finalize(self, driver.stop)
        return driver

    def generate_codes(self, prepared: list[PreparedRequest]) -> list[torch.Tensor]:
        """Run the talker + code predictor for prepared requests -> codes [T_i, 16] each."""
        return self.driver.generate_codes(prepared)

    def stream(self, prepared: list[PreparedRequest], first_chunk_frames: int = 1, chunk_frames: int = 16,
               text_stream: Iterable[str] | None = None, request_ids: list[str] | None = None) -> Iterator[AudioChunk]:
        """Streaming synthesis of prepared requests: AudioChunks as frames are generated (exact stateful decoder).
        text_stream: the text of the one request prepared with text=None, read (in a thread) while audio is made."""
        start = time.perf_counter()  # time to first audio counts prompt processing too
        return self.driver.stream(prepared, StreamOptions(first_chunk_frames, chunk_frames), start, text_stream,
                                  request_ids)

    def decode(self, codes: list[torch.Tensor], ref_codes: list[torch.Tensor | None] | None = None,
               on_device: list[torch.Tensor] | None = None) -> list[np.ndarray]:
        """Codes [T, 16] per request -> waveforms (float32, 24 kHz), as upstream: ICL reference codes are decoded
        in front as context and their share of the audio is cut off. on_device: a list that receives the same
        waveforms as they lie on the model's device (the aligner reads them there: word_timestamps)."""
        ref_codes = ref_codes or [None] * len(codes)
        full = [c if r is None else torch.cat([r.to(c.device), c], 0) for c, r in zip(codes, ref_codes)]
        wavs = []
        with torch.inference_mode():  # a few rows per call: the workspace grows with rows x frames (~6 MB each)
            # (batch-invariant mode: one request per call, as cuDNN's and cuBLAS's algorithms follow the rows)
            lens = [c.shape[0] for c in full]
            for group in [[i] for i in range(len(full))] if invariant.ENABLED else _decode_groups(lens):
                wavs += self.ckpt.code2wav.decode_batch([full[i].to(self.device) for i in group])
        out = []
        for w, c, r in zip(wavs, full, ref_codes):
            if r is not None:
                w = w[int(r.shape[0] / max(c.shape[0], 1) * w.shape[0]):]  # upstream's proportional cut
            out.append(w.float())
        if on_device is not None:
            on_device += out
        flat = torch.cat(out).cpu() if out else torch.empty(0)  # one copy to the host, one sync
        return [w.numpy() for w in flat.split([w.shape[0] for w in out])]

    def _stream(self, prepare, text, text_stream, non_streaming_mode, default_nsm: bool, first_chunk_frames: int,
                chunk_frames: int, args: tuple, kwargs: dict) -> Iterator[AudioChunk]:
        """A *_stream call: the whole text, or text_stream (then the streamed-text layout unless non_streaming_mode
        is given: it reads one text token per frame, so speech starts after the first words)."""
        if (text is None) == (text_stream is None):
            raise ValueError("give the text (text=) or an iterable of text pieces (text_stream=), not both")
        nsm = (non_streaming_mode if non_streaming_mode is not None
               else False if text_stream is not None else default_nsm)
        if text_stream is not None and isinstance(text_stream, str):
            text_stream = [text_stream]
        if (split := longform.options(kwargs)) is not None:  # one request per segment of the text
            if text_stream is not None:
                raise ValueError("split_granularity needs the whole text (text=), not text_stream")
            if kwargs.get("word_timestamps"):
                raise ValueError("word_timestamps with split_granularity: only the non-streaming generate_* calls "
                                 "give both")
            return longform.stream(self, lambda t, **kw: prepare(t, *args, non_streaming_mode=nsm, **kw), text, split,
                                   kwargs, StreamOptions(first_chunk_frames, chunk_frames))
        if kwargs.pop("word_timestamps", False):
            return self._stream_words(prepare, text, text_stream, nsm, first_chunk_frames, chunk_frames, args, kwargs)
        return self.stream(prepare(text, *args, non_streaming_mode=nsm, **kwargs), first_chunk_frames, chunk_frames,
                           text_stream)

    def _synthesize(self, prepared: list[PreparedRequest],
                    on_device: list[torch.Tensor] | None = None) -> tuple[list[np.ndarray], int]:
        return self.decode(self.generate_codes(prepared), [p.ref_codes for p in prepared], on_device), self.sample_rate

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
                subtalker_temperature, subtalker_top_k, subtalker_top_p, max_new_tokens, seed; word_timestamps
                (needs from_pretrained(..., aligner=)).
            split_granularity: None (default, one request) or "sentence" / "clause": the text is split
                (q3tts.split_text) and its segments are spoken in parallel, one request each, joined in order.
            pause_ms: with split_granularity, the silence between two segments.
        Returns:
            (list of float32 waveforms, 24000); with word_timestamps=True (waveforms, 24000, per waveform a list
            of WordTime(word, start_s, end_s)).
        """
        def synthesize(on_device=None):
            if (split := longform.options(kwargs)) is not None:
                prepare = functools.partial(self.prepare_custom_voice, speaker=speaker, language=language,
                                            instruct=instruct, non_streaming_mode=non_streaming_mode)
                return longform.generate(self, prepare, text, split, kwargs, language)
            return self._synthesize(self.prepare_custom_voice(text, speaker, language, instruct, non_streaming_mode,
                                                              **kwargs), on_device)
        return self._timed(kwargs, text, language, synthesize)

    def generate_voice_design(self, text, instruct, language=None, non_streaming_mode: bool = True,
                              **kwargs) -> tuple[list[np.ndarray], int]:
        """VoiceDesign: a voice described in words (instruct); other arguments as generate_custom_voice."""
        def synthesize(on_device=None):
            if (split := longform.options(kwargs)) is not None:
                prepare = functools.partial(self.prepare_voice_design, instruct=instruct, language=language,
                                            non_streaming_mode=non_streaming_mode)
                return longform.generate(self, prepare, text, split, kwargs, language)
            return self._synthesize(self.prepare_voice_design(text, instruct, language, non_streaming_mode, **kwargs),
                                    on_device)
        return self._timed(kwargs, text, language, synthesize)

    def generate_voice_clone(self, text, language=None, ref_audio=None, ref_text=None, x_vector_only_mode=False,
                             voice_clone_prompt=None, non_streaming_mode: bool = False,
                             **kwargs) -> tuple[list[np.ndarray], int]:
        """Base models: clone a voice from reference audio or from prompt items (x-vector only, or ICL with
        reference codes + transcript); other arguments as generate_custom_voice."""
        def synthesize(on_device=None):
            if (split := longform.options(kwargs)) is not None:  # the clone prompt is made once for every segment
                prompt = longform.clone_prompt_once(self, ref_audio, ref_text, x_vector_only_mode, voice_clone_prompt,
                                                    kwargs)
                prepare = functools.partial(self.prepare_voice_clone, language=language, voice_clone_prompt=prompt,
                                            non_streaming_mode=non_streaming_mode)
                return longform.generate(self, prepare, text, split, kwargs, language)
            prepared = self.prepare_voice_clone(text, language, ref_audio, ref_text, x_vector_only_mode,
                                                voice_clone_prompt, non_streaming_mode, **kwargs)
            return self._synthesize(prepared, on_device)
        return self._timed(kwargs, text, language, synthesize)

    # ------------------------------------------------------------------ streaming variants
    def generate_custom_voice_stream(self, text=None, speaker=None, language=None, instruct=None,
                                     non_streaming_mode: bool | None = None, first_chunk_frames: int = 1,
                                     chunk_frames: int = 16, text_stream: Iterable[str] | None = None,
                                     **kwargs) -> Iterator[AudioChunk]:
        """As generate_custom_voice, yielding AudioChunks (audio, sample_rate, frame_index, elapsed_s, ...) as
        frames are generated. The concatenated chunks equal the offline audio (exact stateful decoder).

        Args:
            first_chunk_frames: frames in the first chunk (80 ms each): small for low time to first audio.
            chunk_frames: the largest chunk; chunks double from the first one up to it.
            text_stream: instead of text, any iterable of str pieces (an LLM's tokens), read as it yields:
                speech starts after the first words and equals that of the whole text.
            word_timestamps: the last chunk of each utterance carries its words' times (AudioChunk.word_timestamps,
                seconds from the utterance's start), aligned once its audio is complete.
        """
        return self._stream(self.prepare_custom_voice, text, text_stream, non_streaming_mode, True, first_chunk_frames,
                            chunk_frames, (speaker, language, instruct), kwargs)

    def generate_voice_design_stream(self, text=None, instruct=None, language=None,
                                     non_streaming_mode: bool | None = None, first_chunk_frames: int = 1,
                                     chunk_frames: int = 16, text_stream: Iterable[str] | None = None,
                                     **kwargs) -> Iterator[AudioChunk]:
        """As generate_voice_design, streaming (see generate_custom_voice_stream)."""
        return self._stream(self.prepare_voice_design, text, text_stream, non_streaming_mode, True, first_chunk_frames,
                            chunk_frames, (instruct, language), kwargs)

    def generate_voice_clone_stream(self, text=None, language=None, ref_audio=None, ref_text=None,
                                    x_vector_only_mode=False, voice_clone_prompt=None,
                                    non_streaming_mode: bool | None = None, first_chunk_frames: int = 1,
                                    chunk_frames: int = 16, text_stream: Iterable[str] | None = None,
                                    **kwargs) -> Iterator[AudioChunk]:
        """As generate_voice_clone, streaming; ICL reference codes warm the decoder once and are never emitted."""
        if kwargs.get("split_granularity") not in (None, "none"):  # the clone prompt is made once for every segment
            voice_clone_prompt = longform.clone_prompt_once(self, ref_audio, ref_text, x_vector_only_mode,
                                                            voice_clone_prompt, kwargs)
        return self._stream(self.prepare_voice_clone, text, text_stream, non_streaming_mode, False,
                            first_chunk_frames, chunk_frames,
                            (language, ref_audio, ref_text, x_vector_only_mode, voice_clone_prompt), kwargs)

    # ------------------------------------------------------------------ word timestamps
    def _alignable(self, text, language) -> tuple[list[str] | None, list[str]]:
        """Per utterance (text, aligner language), checked before any synthesis: an aligner is loaded and can split
        each text's words (no language: "Auto"; text None: a streamed text, its language only)."""
        if self.aligner is None:
            raise ValueError("word_timestamps=True needs a forced aligner: TTS.from_pretrained(..., "
                             "aligner='Qwen/Qwen3-ForcedAligner-0.6B') (or a local directory)")
        texts = text if isinstance(text, list) else [text]
        langs = language if isinstance(language, list) else [language] * len(texts)
        langs = [aligner_language(lang) for lang in langs]
        for t, lang in zip(texts, langs):
            if t is None or (isinstance(t, str) and t.strip()):  # (bad text is the processor's to refuse)
                self.aligner.words(t if t is not None else "a", lang)
        return texts, langs

    def _timed(self, kwargs: dict, text, language, synthesize):
        """synthesize(on_device) -> (wavs, sr); with kwargs' word_timestamps, (wavs, sr, [WordTime] per wav). The
        aligner reads the waveforms where the vocoder left them when synthesize puts them in on_device (one request a
        text; a long text's joined segments come from the host)."""
        if not kwargs.pop("word_timestamps", False):
            return synthesize()
        texts, langs = self._alignable(text, language)
        on_device: list[torch.Tensor] = []
        wavs, sr = synthesize(on_device)
        audio = on_device if len(on_device) == len(wavs) else wavs
        words = self.aligner.align(audio, [sr] * len(wavs), texts, langs[:len(wavs)], rows_alone=True)
        return wavs, sr, words

    def _stream_words(self, prepare, text, text_stream, nsm, first_chunk_frames, chunk_frames, args, kwargs):
        """A *_stream with word_timestamps: each utterance's audio is kept and aligned when its last chunk comes;
        that chunk carries the words."""
        texts, langs = self._alignable(text, args[_LANGUAGE_ARG[prepare.__name__]])
        pieces: list[str] = []
        if text_stream is not None:  # the text is known once the stream has been read
            text_stream = _recorded(text_stream, pieces)
        prepared = prepare(text, *args, non_streaming_mode=nsm, **kwargs)
        ids = [f"words-{id(self)}-{id(p)}" for p in prepared]
        audio: dict[str, list[np.ndarray]] = {r: [] for r in ids}
        for chunk in self.stream(prepared, first_chunk_frames, chunk_frames, text_stream, request_ids=ids):
            audio[chunk.request_id].append(chunk.audio)
            if chunk.is_last:
                i = ids.index(chunk.request_id)
                t = "".join(pieces) if text_stream is not None else texts[i]
                wav = np.concatenate(audio.pop(chunk.request_id))
                words: list[WordTime] = []
                if t.strip() and wav.size >= 640 and self.aligner.words(t, langs[min(i, len(langs) - 1)]):
                    words = self.aligner.align(wav, chunk.sample_rate, t, langs[min(i, len(langs) - 1)])
                chunk.word_timestamps = words
            yield chunk

    # ------------------------------------------------------------------ voices
    def voice_cloner(self) -> VoiceCloner:
        """Speaker encoder + codec encoder of this Base checkpoint (loaded on first use, fp32)."""
        self.processor.require("base", "create_voice_clone_prompt")
        with self._lock:
            if self._cloner is None:
                self._cloner = VoiceCloner(self.ckpt.model_dir, self.cfg, self.ckpt.speech_cfg, device=self.device)
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

    def create_voice(self, ref_audio, ref_text=None, x_vector_only_mode=False, name=None, **kwargs) -> Voice:
        """A reusable `q3tts.inputs.voice.Voice` (save it with .save(path), load with TTS.load_voice)."""
        return self.voice_cloner().create_voice(ref_audio, ref_text, x_vector_only_mode, name=name, **kwargs)

    def load_voice(self, path) -> Voice:
        """Load a voice file made for this model (a voice made for another model size is rejected)."""
        return Voice.load(path, model=self.cfg)


def _decode_groups(lengths: list[int], max_frames: int = 1024, chunk: int = 325) -> list[list[int]]:
    """Consecutive items decoded together: rows x (padded frames, at most upstream's 300 + 25 per chunk) <=
    max_frames, at least one row per call."""
    groups: list[list[int]] = []
    for i, n in enumerate(lengths):
        g = groups[-1] if groups else None
        if g is None or (len(g) + 1) * min(chunk, max(n, *(lengths[j] for j in g))) > max_frames:
            groups.append([i])
        else:
            g.append(i)
    return groups


# where each prepare_* takes its language among the positional arguments a *_stream passes on
_LANGUAGE_ARG = {"prepare_custom_voice": 1, "prepare_voice_design": 1, "prepare_voice_clone": 0}


def _recorded(pieces: Iterable[str], seen: list[str]) -> Iterator[str]:
    for p in pieces:
        seen.append(p)
        yield p

