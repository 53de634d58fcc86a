"""Word timestamps: the Qwen3 forced aligner (Qwen/Qwen3-ForcedAligner-0.6B) without qwen-asr.

    aligner = ForcedAligner.from_pretrained("Qwen/Qwen3-ForcedAligner-0.6B")     # or a local directory
    words = aligner.align(wav, 24000, "Hello world.", "English")   # [WordTime("Hello", 0.12, 0.48), ...]

The same words and times as qwen-asr 0.0.6's `Qwen3ForcedAligner.align` (tests/golden/make_golden_aligner.py), for
one utterance or a batch (lists in, lists out). fp32 on a CPU, bf16 on CUDA.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .audio import resample, resampled_length, to_mono
from .config import read_json
from .engine.graphs import capture_beside, gc_paused, side_stream
from .hostcopy import to_device
from .inputs.align_text import WordTime, prompt_text, split_words, word_times_padded
from .inputs.prompt import TextTokenizer
from .models.aligner import ALIGNER_FILES, AlignerConfig, Thinker, lm_layer, load_thinker, parse_aligner_config
from .models.audio_encoder import (
    HOP,
    SAMPLE_RATE,
    Ragged,
    encoder_layer,
    log_mel,
    mel_filters,
    reflect_rows,
    reflect_rows_device,
    tokens_after_cnn,
    valid_frames,
)
from .models.resample import Polyphase
from .weights import resolve_model_dir

__all__ = ["AlignerWorker", "ForcedAligner", "WordTime"]

PREP_THREADS = 8  # CPU threads of a large batch's preparation (ForcedAligner._in_groups)
PREP_MIN_SAMPLES = 1 << 20  # audio samples from which a batch's preparation is spread over them
PREP_MIN_ROWS = 8  # rows of a group at least
# the most rows of one AlignerWorker pass: a burst of utterances (streams ending together) goes in few passes, each
# pass's fixed host and launch work paid once for many rows; newcomers' first chunks do not wait for a long pass,
# which does not start while the engine admits (busy) and runs on a stream below the engine's steps (BENCHMARKS.md:
# the worker's figures, passes of 16 and 64 rows)
WORKER_MAX_BATCH = 64
# a worker's pass that can wait (its audio is out already) waits while the engine admits newcomers and makes their
# first chunks (AlignerWorker's busy), at most this long from its oldest utterance's submission
WORKER_MAX_DEFER_S = 0.25
WORKER_POLL_S = 0.002
WARMUP_RATE = 24000  # Hz: Qwen3-TTS's audio, what the server's worker aligns (ForcedAligner.warmup)


@dataclass(slots=True)
class _Item:
    words: list[str] | None  # None: its text not checked yet (text holds it: ForcedAligner._words_of)
    wav: np.ndarray | torch.Tensor  # mono float32 at sample_rate; once prepared: at 16 kHz, in [-1, 1]. A tensor
    # on the aligner's CUDA device (a synthesis's own audio: TTS word_timestamps) until ready() needs it on the CPU:
    # the padded pass copies it device to device
    sample_rate: int
    prepared: bool = False
    pinned: torch.Tensor | None = None  # wav's samples in page-locked memory (AlignerWorker.submit on CUDA): the
    # padded pass copies them straight to the device
    label: str = ""  # "item i: " in a batch's errors
    finite: bool = True  # its samples were checked finite on the host (False: align()'s padded pass checks them on
    # the device, where they go anyway; ready() before it resamples them on the CPU)
    text: tuple[Any, Any] | None = None  # (text, language) not checked yet: align() leaves it to the pass, which
    # checks it while the rows' samples are written (_words_of)

    def ready(self) -> "_Item":
        """Resampled to 16 kHz and brought into [-1, 1]: the CPU part of an item, after its checks (the worker does it
        on its own thread, not on the submitting caller's); samples not yet checked finite (finite False) are checked
        here first, where the CPU reads them anyway."""
        if not self.prepared:
            if isinstance(self.wav, torch.Tensor):
                self.wav = self.wav.cpu().numpy()
            if not self.finite and not _finite(self.wav):
                raise ValueError(f"{self.label}audio has NaN or infinite samples")
            wav = resample(self.wav, self.sample_rate, SAMPLE_RATE)
            peak = float(np.max(np.abs(wav))) if wav.size else 0.0
            if peak > 1.0:  # as the official: int-scaled or clipping input is brought back into [-1, 1]
                wav = wav / peak
            self.wav, self.sample_rate, self.prepared = np.clip(wav, -1.0, 1.0).astype(np.float32), SAMPLE_RATE, True
            self.pinned = None
        return self

    @property
    def num_samples(self) -> int:
        """Its length at 16 kHz (what resample() returns)."""
        n = self.wav.shape[0]
        return n if self.prepared else resampled_length(n, self.sample_rate, SAMPLE_RATE)


@dataclass(slots=True)
class _Launched:
    """A padded pass on its way: its results copied to the host behind it (on CUDA asynchronously, into page-locked
    memory, done's event after the copy), so that the caller's host work until result() overlaps the device's."""
    key: tuple[int, int, int, int]  # its LM bucket (rows, chunks, input rate, tokens)
    host: torch.Tensor  # [B, S + 1] each row's classes at every prompt slot, then its samples all finite (1 / 0)
    done: torch.cuda.Event | None  # recorded after host's copy (None: host is already written)
    slot_at: np.ndarray  # [B, n] where each row's <timestamp> slots lie, in order (2 a word; past them other slots)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(classes [B, n] at each row's <timestamp> slots, [B] bool: the row's input samples all finite), once the
        pass is done."""
        if self.done is not None:
            self.done.synchronize()
        h = self.host.numpy()
        return h[np.arange(h.shape[0])[:, None], self.slot_at], h[:, -1].astype(bool)


class _PaddedPass:
    """The aligner's fast pass (ForcedAligner(graphs=True)): the batch right-padded to a bucket of (rows, audio
    chunks, input rate, prompt tokens) and run as the features (_features: resampling, log-mel) and
    Thinker.forward_padded, whose shapes depend on the bucket only. On CUDA the pass is two CUDA graphs, captured
    once per bucket and replayed: the features' and audio encoder's (rows, chunks, rate) and the LM's (rows, chunks,
    rate, tokens), about a thousand kernels in two launches instead of a Python call per kernel. The encoder's
    graph needs no prompt: it runs on the GPU while the CPU tokenizes the prompts. The graphs share one
    memory pool and are captured lazily, at most max_graphs of them (later buckets run the same pass uncaptured).

    NOTE(aligner): a row's words equal the eager pass's with rows_alone: padding rows, padding chunks (zeroed
    frames, as the official pads a row's tail chunk) and padding tokens never reach a real one (per-row STFT and
    floor, per-window key masks, right padding under is_causal). Rows under one conv chunk of frames (< 1 s) are
    padded differently by the official, so a batch with one runs eagerly."""

    TOKEN_STEP = 8  # prompt tokens are padded to a multiple of this (every padding token is a row's LM work); rows
    # to a power of two

    def __init__(self, aligner: "ForcedAligner", resample_on_device: bool, max_graphs: int = 32):
        self.aligner, self.max_graphs = aligner, max_graphs
        self.capture = aligner.device.type == "cuda"
        self.resample_on_device = resample_on_device
        self.resamplers: dict[int, Polyphase | None] = {}  # by input rate: soxr's filter on the device
        # (rows, chunks, rate) -> the features' and encoder's graph and output; (rows, chunks, rate, tokens) -> the
        # LM's graph and classes
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.inputs: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}  # the graphs' static inputs, same keys
        self.pool = None
        self.capture_s = 0.0  # time spent capturing, all buckets
        self.staging: torch.Tensor | None = None  # [rows x samples] float32, pinned: the rows' waveforms on their way
        self.staged: torch.cuda.Event | None = None  # the last copy out of staging
        self.after: torch.cuda.Event | None = None  # the last pass's end (its results' copy): the next one waits

    def audio_key(self, frames: list[int], rate: int = SAMPLE_RATE) -> tuple[int, int, int] | None:
        """(rows, chunks, input rate) of the features' and encoder's bucket for rows of these mel frames whose samples
        come at rate (resampled on the device unless it is 16 kHz); None: not padded."""
        enc = self.aligner.cfg.audio
        chunk = 2 * enc.n_window
        if min(frames) < chunk:
            return None
        per = enc.n_window_infer // chunk  # chunks in an attention window
        C = max(-(-f // chunk) for f in frames)
        C = C if C <= per else -(-C // per) * per
        return 1 << (len(frames) - 1).bit_length(), C, rate

    def key(self, frames: list[int], lengths: list[int], rate: int = SAMPLE_RATE) -> tuple[int, int, int, int] | None:
        """(rows, chunks, input rate, tokens) of the LM's bucket for rows of these mel frames and prompt lengths;
        None: not padded."""
        ak = self.audio_key(frames, rate)
        return None if ak is None else (*ak, -(-max(lengths) // self.TOKEN_STEP) * self.TOKEN_STEP)

    def samples(self, key: tuple[int, ...]) -> int:
        """Input samples a row of the bucket holds at most: rows of at most C chunks of frames, at key's rate."""
        _, C, rate = key[:3]
        most = C * 2 * self.aligner.cfg.audio.n_window * HOP + HOP - 1  # 16 kHz samples of C * chunk frames
        return -(-most * rate // SAMPLE_RATE)

    def _buffers(self, key: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """The static inputs of a bucket. (rows, chunks, rate), the features' and encoder's: wav [B, L] each row's
        input samples (anything past its own), ints [4, B] each row's input samples, resampled end (Polyphase.ends),
        16 kHz samples and mel frames (0: a padding row), mask [W, T] the windows' keys, finite [B] (an output);
        with a device resampler its spectrum. (rows, chunks, rate, tokens), the LM's: ids, audio_at [B, S]."""
        enc, dev = self.aligner.thinker.audio_tower, self.aligner.device
        B, C = key[:2]
        if len(key) == 4:
            return dict(ids=torch.zeros(B, key[3], dtype=torch.int64, device=dev),  # [B, S] prompts, right-padded
                        audio_at=torch.zeros(B, key[3], dtype=torch.int64, device=dev))  # [B, S]
        T, L = enc.window_tokens(C), self.samples(key)
        x = dict(wav=torch.zeros(B, L, device=dev), ints=torch.zeros(4, B, dtype=torch.int64, device=dev),
                 mask=torch.ones(B * C * enc.window_tokens(1) // T, T, dtype=torch.bool, device=dev),
                 finite=torch.ones(B, dtype=torch.bool, device=dev))
        f = self.resamplers.get(key[2])
        if f is not None:
            x["spectrum"] = f.spectrum(L, f.out_len(L), dev)
        return x

    def _features(self, key: tuple[int, ...], x: dict[str, torch.Tensor]) -> torch.Tensor:
        """The bucket's log-mel [B, mel, C * chunk] in the model dtype from its static inputs, with shapes of the
        bucket only (captured with the encoder): each row's samples, resampled to 16 kHz on the device (its rate's
        Polyphase), scaled back into [-1, 1] when its peak is past 1 and clipped (as _Item.ready and the official),
        reflect-padded at its own ends, floored over its own frames, zero past them. Writes x["finite"]: each row's
        input samples all finite (a non-finite row stays in its row: every step here is per row)."""
        a = self.aligner
        n, ends, num_samples, frames = x["ints"]
        wav = x["wav"]
        L = wav.shape[1]
        wav = torch.where(torch.arange(L, device=wav.device)[None, :] < n[:, None], wav, 0.0)  # [B, L]
        x["finite"].copy_(torch.isfinite(wav).all(1))
        f = self.resamplers.get(key[2])
        if f is not None:
            wav = f.padded(wav, f.out_len(L), ends, x["spectrum"])  # [B, L16]
        peak = wav.abs().amax(1, keepdim=True)
        wav = torch.where(peak > 1.0, wav / peak, wav).clamp(-1.0, 1.0)
        mel = log_mel(reflect_rows_device(wav, num_samples), a._filters, frames, center=False)  # [B, mel, L16 // 160]
        past = torch.arange(mel.shape[2], device=mel.device)[None, :] >= frames[:, None]
        width = key[1] * 2 * a.cfg.audio.n_window  # C * chunk <= L16 // 160 (samples())
        return mel.masked_fill(past[:, None], 0.0)[..., :width].to(a.dtype)

    def _pass(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.aligner.thinker.forward_padded(x["ids"], x["mel"], x["mask"], x["audio_at"]).argmax(-1)  # [B, S]

    def _encode(self, key: tuple[int, ...], x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.aligner.thinker.audio_tower.forward_padded(self._features(key, x), x["mask"])  # [B, A, D]

    def _lm(self, x: dict[str, torch.Tensor], audio: torch.Tensor) -> torch.Tensor:
        return self.aligner.thinker.lm_padded(x["ids"], audio, x["audio_at"]).argmax(-1)  # [B, S]

    def _replay(self, key: tuple[int, ...], x: dict[str, torch.Tensor], fn) -> torch.Tensor:
        """fn(x)'s output through key's graph: replayed, captured first while there is room (else fn run as is)."""
        if key not in self.graphs and len(self.graphs) < self.max_graphs:
            self.inputs[key] = x
            self.graphs[key] = self._graph(lambda: fn(x))
        if key not in self.graphs:
            return fn(x)
        g, out = self.graphs[key]
        g.replay()
        return out

    def _graph(self, fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (cuBLAS handles, the allocator), then capture into the shared pool, beside the
        engine's steps (no device sync, no cache flush, no cycle collection: capture_beside)."""
        t0 = time.perf_counter()
        with side_stream():
            fn()
        with gc_paused(collect=False):
            g, out = capture_beside(fn, self.pool)
        self.pool = g.pool()
        self.capture_s += time.perf_counter() - t0
        return g, out

    def _rate(self, items: list[_Item]) -> tuple[int, list[_Item]]:
        """(the rate the rows' samples go to the device at, the items): their one input rate when every row is
        unprepared and that rate is 16 kHz or has a device resampler (Polyphase: soxr's own filter); else 16 kHz,
        the rows prepared on the CPU (soxr)."""
        rates = {it.sample_rate for it in items}
        if self.resample_on_device and len(rates) == 1 and not any(it.prepared for it in items):
            sr = rates.pop()
            if sr != SAMPLE_RATE and sr not in self.resamplers:
                self.resamplers[sr] = Polyphase.of(sr, SAMPLE_RATE)
            if sr == SAMPLE_RATE or self.resamplers[sr] is not None:
                return sr, items
        self.aligner._words_of(items)  # (before the CPU's resampling)
        return SAMPLE_RATE, [it.ready() for it in items]

    def _upload(self, wavs: list[np.ndarray | torch.Tensor], out: torch.Tensor) -> Callable[..., None]:
        """Starts writing each row's samples into the front of its row of out [B', L] on the device (B' >= rows; what
        lies past a row's samples is left as it was) and returns the call that finishes it (waits for the rows'
        writes, issues the last copies): the caller's host work in between overlaps the writes. On CUDA rows already
        on the device (one launch for all) or in page-locked memory (torch tensors: staged at submission) are copied
        straight; otherwise through one pinned buffer laid out as out, reused (grown when short): no fresh host pages
        to fault in. A large batch's rows are
        written (into it, or on the CPU into out itself) by the prep threads, a group of rows each, and on CUDA each
        group's rows are copied on asynchronously as soon as they are written. The next upload waits for the last
        copy (its event) before it writes the buffer again."""
        L, cuda = out.shape[1], self.aligner.device.type == "cuda"
        if cuda and all(isinstance(w, torch.Tensor) and w.is_cuda for w in wavs):
            torch._foreach_copy_([out[b, :w.shape[0]] for b, w in enumerate(wavs)], wavs)
            return lambda copy=True: None
        if cuda and all(isinstance(w, torch.Tensor) for w in wavs):
            for b, w in enumerate(wavs):
                out[b, :w.shape[0]].copy_(w, non_blocking=True)  # (the host allocator keeps w's pages until done)
            return lambda copy=True: None
        wavs = [w.cpu().numpy() if isinstance(w, torch.Tensor) else w for w in wavs]
        if not cuda:
            host = out
        else:
            if self.staged is not None:
                self.staged.synchronize()
            need = len(wavs) * L
            if self.staging is None or self.staging.shape[0] < need:
                self.staging = torch.empty(max(need, 2 * (0 if self.staging is None else self.staging.shape[0])),
                                           dtype=torch.float32, pin_memory=True)
            host = self.staging[:need].view(len(wavs), L)
        rows = host.numpy()

        def write(i: int) -> None:
            rows[i, :wavs[i].shape[0]] = wavs[i]
        groups = self.aligner._in_groups(write, len(wavs), sum(w.shape[0] for w in wavs))

        def finish(copy: bool = True) -> None:
            """copy False: the writes waited for, nothing copied (a batch that failed its checks meanwhile)."""
            error = None
            for (lo, hi), done in groups:  # every group waited for, even after an error: none writes on after it
                try:
                    done()  # this group's rows are in the buffer
                except BaseException as e:  # noqa: BLE001 - raised below, once no thread writes any more
                    error = error or e
                    continue
                if cuda and copy:
                    out[lo:hi].copy_(host[lo:hi], non_blocking=True)
            if cuda:
                self.staged = torch.cuda.Event()
                self.staged.record()
            if error is not None:
                raise error
        return finish

    def __call__(self, items: list[_Item], frames: list[int]) -> _Launched | None:
        """The pass of the rows of these mel frames (the audio_pad runs as long as tokens_after_cnn(frames)), launched;
        None: the batch is not for the padded pass (a row under one chunk).
        NOTE(aligner): no host sync until _Launched.result(): the host's part is the rows' samples and a few index
        rows, copied from page-locked memory asynchronously (hostcopy), and two launches (the features' and encoder's
        graph, the LM's), so the host's work overlaps the device's. The samples' writes start first (the encoder's
        launch waits for them); the index rows and masks are made meanwhile; the prompts, the LM's inputs and where
        the results lie are made while the encoder runs. A pass launched before this one may still be running: its
        work is ordered before this one's on the stream it was launched on (the bucket's static inputs and outputs
        are shared), and this one's stream waits for it (after), whichever thread launched it."""
        if self.audio_key(frames) is None:
            return None
        if self.after is not None:
            torch.cuda.current_stream(self.aligner.device).wait_event(self.after)
        rate, items = self._rate(items)
        ak = self.audio_key(frames, rate)
        a, (Bb, C, _), B, enc = self.aligner, ak, len(items), self.aligner.cfg.audio
        xa = self.inputs.get(ak) or self._buffers(ak)
        uploaded = self._upload([it.wav if it.pinned is None else it.pinned for it in items], xa["wav"])
        try:
            a._words_of(items)  # the texts' checks, while the samples are written
            f = self.resamplers.get(rate)
            n = [it.wav.shape[0] for it in items]
            ints = np.zeros((4, Bb), np.int64)  # as _buffers' ints; padding rows: 0
            ints[:, :B] = [n, f.ends(n) if f is not None else n, [it.num_samples for it in items], frames]
            t = tokens_after_cnn(2 * enc.n_window)
            T = a.thinker.audio_tower.window_tokens(C)
            tokens = tokens_after_cnn(np.array(frames))  # [B] a row's audio tokens (its audio_pad run)
            mask = np.zeros((Bb, C * t), bool)  # [B, windows a row x T]: a row's first tokens
            mask[:B] = np.arange(C * t)[None, :] < tokens[:, None]
            mask = mask.reshape(-1, T)
            mask[~mask.any(1)] = True  # padding windows: every key (no empty softmax row)
            ints_d, mask_d = to_device([torch.from_numpy(ints), torch.from_numpy(mask)], a.device)
            xa["ints"].copy_(ints_d)
            xa["mask"].copy_(mask_d)
        except BaseException:
            uploaded(copy=False)  # (a bad text: its batch's samples are not copied to the device)
            raise
        uploaded()
        audio = self._replay(ak, xa, lambda x: self._encode(ak, x)) if self.capture else None
        # the prompts (the CPU's part) while the encoder runs: right-padded; each audio_pad slot's embedding in the
        # encoder output [B * C * t]
        rows = a._prompts(items, frames)
        lengths = np.array([len(r) for r in rows])
        key = (*ak, -(-int(lengths.max()) // self.TOKEN_STEP) * self.TOKEN_STEP)
        x = self.inputs.get(key) or self._buffers(key)
        pos = np.arange(key[3])[None, :]
        ids = np.zeros((Bb, key[3]), np.int64)
        ids[:B][pos < lengths[:, None]] = np.concatenate(rows)
        audio_at = np.zeros((Bb, key[3]), np.int64)  # the prompt's audio_pad run starts at slot 1
        audio_at[:B] = np.where((pos >= 1) & (pos <= tokens[:, None]),
                                np.arange(B)[:, None] * (C * t) + pos - 1, 0)
        ids_d, audio_at_d = to_device([torch.from_numpy(ids), torch.from_numpy(audio_at)], a.device)
        x["ids"].copy_(ids_d)
        x["audio_at"].copy_(audio_at_d)
        # where each row's <timestamp> slots lie, in order (2 a word; past them, other slots): [B, n]
        slot_at = np.argsort(ids[:B] != a.cfg.timestamp_token_id, axis=1, kind="stable")[
            :, :max(2 * len(it.words) for it in items)]
        if audio is None:
            out = self._pass(dict(x, **xa, mel=self._features(ak, xa)))
        else:
            out = self._replay(key, x, lambda x: self._lm(x, audio)) if ak in self.graphs else self._lm(x, audio)
        res = torch.cat([out[:B], xa["finite"][:B, None].to(out.dtype)], 1)  # [B, S + 1]: one copy
        done = None
        if res.is_cuda:
            host = torch.empty(res.shape, dtype=res.dtype, pin_memory=True)
            host.copy_(res, non_blocking=True)
            done = self.after = torch.cuda.Event()
            done.record()
        else:
            host = res
        return _Launched(key, host, done, slot_at)


class ForcedAligner:
    """Audio + its transcript -> the time of every word."""

    def __init__(self, thinker: Thinker, tokenizer: TextTokenizer, cfg: AlignerConfig, model_dir: Path,
                 compile: bool = False, graphs: bool | None = None, resample_on_device: bool | None = None):
        self.thinker, self.tokenizer, self.cfg, self.model_dir = thinker, tokenizer, cfg, model_dir
        self.compiled = compile
        if compile:  # one compiled function per layer kind serves every layer; token counts and batch are dynamic
            thinker.layer_fn = torch.compile(lm_layer, dynamic=True, fullgraph=True)
            thinker.audio_tower.layer_fn = torch.compile(encoder_layer, dynamic=True, fullgraph=True)
        p = next(thinker.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._filters = torch.from_numpy(mel_filters(cfg.audio.num_mel_bins)).to(self.device, torch.float32)
        self._ids = {t: tokenizer.token_id(t) for t in ("<|audio_start|>", "<|audio_end|>", "<timestamp>")}
        if self._ids["<timestamp>"] != cfg.timestamp_token_id:
            raise ValueError(f"{model_dir}: the tokenizer's <timestamp> is id {self._ids['<timestamp>']}, "
                             f"config.json says {cfg.timestamp_token_id}")
        on_device = self.device.type == "cuda" if resample_on_device is None else resample_on_device
        self._padded = _PaddedPass(self, on_device) if (self.device.type == "cuda" if graphs is None else graphs) \
            else None
        self._lock = threading.Lock()  # one pass at a time (the worker's thread and direct callers)
        # a large batch's checks and upload copies (numpy's sums and copies release the GIL) spread over a few cores;
        # the threads start on first use
        self._prep_threads = min(PREP_THREADS, os.cpu_count() or 1)
        self._prep = ThreadPoolExecutor(self._prep_threads, thread_name_prefix="q3tts-align-prep")
        # the last class ends here: longer audio has words the head cannot place
        self.max_seconds = cfg.classify_num * cfg.timestamp_segment_time / 1000.0
        langs = self.supported_languages
        self._accepted = None if langs is None else frozenset(langs + ["auto"])  # words()' check, lower-cased

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, device: str | torch.device | None = None,
                        dtype: torch.dtype | str | None = None, compile: bool = False,
                        graphs: bool | None = None, resample_on_device: bool | None = None) -> "ForcedAligner":
        """Load a forced-aligner checkpoint (hub id or local directory in the official layout).

        Args:
            name_or_path: e.g. "Qwen/Qwen3-ForcedAligner-0.6B", or a directory with config.json, model.safetensors
                and the tokenizer files.
            device: default CUDA when available, else CPU.
            dtype: default bf16 on CUDA, fp32 on CPU.
            compile: torch.compile the decoder and encoder layers (norms, RoPE, the attention glue and the MLP's
                activations fused; the GEMMs and attention stay cuBLAS / SDPA). The first passes compile.
            graphs: batches of rows aligned as alone (and single utterances) run padded to a bucket of shapes, each
                bucket's pass captured as two CUDA graphs (audio encoder, LM) on first use, beside running synthesis
                (CUDA; elsewhere the padded pass runs as is). Default: on CUDA.
            resample_on_device: with graphs, resample 24 (or 8, 48) kHz input to 16 kHz on the aligner's device with
                soxr's own filter (q3tts.models.resample) instead of soxr on the CPU; default: on CUDA.
        """
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        d = resolve_model_dir(name_or_path, required=ALIGNER_FILES, weights=("model",))
        cfg = parse_aligner_config(read_json(d / "config.json"))
        aligner = cls(load_thinker(d, cfg, device, dtype), TextTokenizer(d), cfg, d, compile, graphs,
                      resample_on_device)
        if compile or aligner._padded is not None and aligner._padded.capture:
            aligner.warmup()
        return aligner

    def warmup(self) -> None:
        """Compile, load the kernels and capture the first graphs now, not in a caller's first pass (compiling holds
        the interpreter for seconds: a server's streams would stall behind it). A batch of one and a batch of two
        rows, one longer than an attention window: the shapes that torch.compile specializes (sizes 1 and more);
        other sizes reuse these compilations (graphs: each bucket is captured on first use). At WARMUP_RATE, the rate
        a synthesis's audio comes at (graphs: buckets are per input rate; its resampler is made here too)."""
        rng = np.random.default_rng(0)
        window_s = self.cfg.audio.n_window_infer * 160 / SAMPLE_RATE
        wav = lambda s: (0.1 * rng.standard_normal(int(s * WARMUP_RATE))).astype(np.float32)  # noqa: E731
        self.align(wav(1.5), WARMUP_RATE, "one two", "English")
        self.align([wav(1.5), wav(min(window_s + 3, self.max_seconds))], WARMUP_RATE, ["one two", "three four"],
                   "English", rows_alone=True)

    def _in_groups(self, fn, n: int, samples: int) -> list[tuple[tuple[int, int], Any]]:
        """fn(i) for i in range(n), rows in contiguous groups (lo, hi) in order, each with a call that waits for its
        group and returns [fn(lo), ..., fn(hi - 1)] (raising the group's first error). A batch of at least
        PREP_MIN_SAMPLES audio samples runs its groups on the prep threads, at least PREP_MIN_ROWS rows a group;
        a smaller one runs here, as one group."""
        k = min(self._prep_threads, n // PREP_MIN_ROWS) if samples >= PREP_MIN_SAMPLES else 1
        if k <= 1:
            out = [fn(i) for i in range(n)]
            return [((0, n), lambda: out)]
        bounds = [n * g // k for g in range(k + 1)]
        futs = [self._prep.submit(lambda lo, hi: [fn(i) for i in range(lo, hi)], lo, hi)
                for lo, hi in zip(bounds, bounds[1:])]
        return [((lo, hi), f.result) for lo, hi, f in zip(bounds, bounds[1:], futs)]

    @property
    def supported_languages(self) -> list[str] | None:
        """Lower-cased languages of config.json's support_languages (None: any language is split on spaces)."""
        return sorted({x.lower() for x in self.cfg.support_languages}) or None

    # ------------------------------------------------------------------ inputs
    def words(self, text: Any, language: Any, what: str = "") -> list[str]:
        """The words of text that align() times (ValueError naming the problem for bad text or language)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{what}text must be a non-empty string, got {text!r}"[:200])
        if not isinstance(language, str) or not language.strip():
            raise ValueError(f"{what}language must be a language name such as 'English' or 'Chinese', "
                             f"got {language!r}"[:200])
        if self._accepted is not None and language.lower() not in self._accepted:
            raise ValueError(f"{what}language {language!r} is not supported by this aligner; accepted: Auto, "
                             + ", ".join(x.capitalize() for x in self.supported_languages))
        return split_words(text, language)

    def _item(self, audio: Any, sample_rate: Any, text: Any, language: Any, i: int, ready: bool = True,
              copy: bool = True, finite: bool = True, check_text: bool = True) -> _Item:
        """Checked (ValueError naming the problem; its text first) and, with ready, prepared for the pass
        (_Item.ready). copy False: a float32 waveform is kept as the caller's array, not copied (align(), which
        returns before the caller can change it; a copy of a fresh array costs page faults). finite False: its
        samples are not read here (a pass over every sample, on the host's critical path before the device starts);
        _forward checks them (_Item.finite). check_text False: its text is kept unchecked (_Item.text)."""
        what = f"item {i}: " if i >= 0 else ""
        words = self.words(text, language, what) if check_text else None
        on_device = (isinstance(audio, torch.Tensor) and audio.is_cuda and audio.device == self.device
                     and audio.dtype == torch.float32 and audio.ndim == 1 and audio.numel() > 0)
        if on_device:  # kept where it is: the pass reads it there (align() returns before the caller can change it)
            wav = audio.detach()
        else:
            wav = np.asarray(audio.detach().float().cpu() if isinstance(audio, torch.Tensor) else audio)
            if wav.dtype.kind != "f" or wav.ndim not in (1, 2) or wav.size == 0:
                raise ValueError(f"{what}audio must be a non-empty float waveform [samples] (or 2-D with a channel "
                                 f"axis), got dtype {wav.dtype} shape {wav.shape}")
        try:
            sr = int(sample_rate)
        except (TypeError, ValueError):
            raise ValueError(f"{what}sample_rate must be an integer, got {sample_rate!r}") from None
        if not 8000 <= sr <= 192000:
            raise ValueError(f"{what}sample_rate {sr} is outside 8000..192000 Hz")
        if not on_device:
            wav = to_mono(wav.astype(np.float32, copy=copy))
        if finite and not (bool(torch.isfinite(wav).all()) if on_device else _finite(wav)):
            raise ValueError(f"{what}audio has NaN or infinite samples")
        if wav.shape[0] / sr > self.max_seconds:
            raise ValueError(f"{what}audio of {wav.shape[0] / sr:.1f} s is longer than this aligner's "
                             f"{self.max_seconds:g} s ({self.cfg.classify_num} timestamp classes); align it in parts")
        if resampled_length(wav.shape[0], sr, SAMPLE_RATE) < 2 * 160:
            # shorter than two mel frames: the reflect-padded STFT is undefined
            raise ValueError(f"{what}audio of {wav.shape[0] / sr * 1000:.0f} ms is too short to align")
        item = _Item(words, wav, sr, label=what, finite=finite, text=None if check_text else (text, language))
        return item.ready() if ready else item

    def _words_of(self, items: list[_Item]) -> None:
        """The words of the items whose text is not checked yet (ValueError naming the first bad one's problem)."""
        for it in items:
            if it.words is None:
                it.words, it.text = self.words(*it.text, it.label), None

    def _items(self, args: list[tuple[Any, Any, Any, Any, int]], samples: int) -> list[_Item]:
        """align()'s rows (audio, sample_rate, text, language, i) checked for the pass, their texts left to it (it
        checks them while their samples are written: _words_of): the first bad row's error, its text's before its
        audio's, as _item checks each row in turn."""
        try:
            return [it for _, done in self._in_groups(
                lambda i: self._item(*args[i], ready=False, copy=False, finite=False, check_text=False), len(args),
                samples) for it in done()]
        except ValueError:
            for a in args:  # the rows again, texts too, up to the first error (the bad audio's at the latest)
                self._item(*a, ready=False, copy=False, finite=False)
            raise

    # ------------------------------------------------------------------ the pass
    @torch.inference_mode()
    def align(self, audio: Any, sample_rate: int | list[int], text: str | list[str],
              language: str | list[str], rows_alone: bool = False) -> list[WordTime] | list[list[WordTime]]:
        """Word timestamps of one utterance, or of a batch.

        Args:
            audio: a waveform (numpy array or torch tensor, float, mono [samples] or 2-D with a channel axis), or a
                list of them for a batch.
            sample_rate: its rate in Hz (resampled to 16 kHz), or one per item.
            text: the transcript, or one per item.
            language: e.g. "English", "Chinese"; one for all items or one per item. Chinese (and any CJK ideograph)
                is aligned per character, Japanese per nagisa word (extra `q3tts[aligner-ja-ko]`), other languages
                per space-delimited word; "Auto" (a q3tts addition) splits as the other languages do.
            rows_alone: a batch row's features computed as if it were aligned alone (no padding from longer rows),
                so its words do not depend on its batch; False (default): padded as the official batch.

        Returns:
            A list of WordTime (word, start_s, end_s); for a batch, one such list per item.
        """
        batch = isinstance(audio, (list, tuple))
        if not batch:
            return self._run(self._items([(audio, sample_rate, text, language, -1)], 0))[0]
        n = len(audio)
        if n == 0:
            raise ValueError("audio is an empty list")
        per = {}
        for name, v in (("sample_rate", sample_rate), ("text", text), ("language", language)):
            per[name] = list(v) if isinstance(v, (list, tuple)) else [v] * n
            if len(per[name]) != n:
                raise ValueError(f"batch size mismatch: {n} audio, {len(per[name])} {name}")
        args = list(zip(audio, per["sample_rate"], per["text"], per["language"], range(n)))
        # the samples the checks read (_item: a conversion to float32, a tensor's copy, a mix to mono; a float32 [N]
        # array, or such a tensor on the device, is only looked at, a pass over it left to the device): what the prep
        # threads would share
        samples = sum(math.prod(a.shape) for a in audio if hasattr(a, "shape") and not (
            a.ndim == 1 and (isinstance(a, np.ndarray) and a.dtype == np.float32
                             or isinstance(a, torch.Tensor) and a.is_cuda and a.dtype == torch.float32)))
        return self._run(self._items(args, samples), rows_alone)

    def _features(self, items: list[_Item], rows_alone: bool) -> tuple[torch.Tensor, list[int]]:
        """The batch's log-mel [B, mel, F] in the model dtype (one STFT for all rows, on the aligner's device) and
        each row's frame count. NOTE(aligner): the official batch zero-pads the waveforms to the longest before the
        mel, so a shorter row's last frames (and its log floor) see the padding and its features depend on its
        batch; rows_alone gives every row the frames it has alone (its own reflect padding and floor)."""
        if rows_alone:
            wavs, frames = reflect_rows([it.wav for it in items])
            mel = log_mel(torch.from_numpy(wavs).to(self.device), self._filters, frames, center=False)
        else:
            L = max(it.wav.shape[0] for it in items)
            wavs = np.zeros((len(items), L), np.float32)
            for i, it in enumerate(items):
                wavs[i, :it.wav.shape[0]] = it.wav
            mel = log_mel(torch.from_numpy(wavs).to(self.device), self._filters)  # [B, mel, L // 160] fp32
            frames = [valid_frames(it.wav.shape[0], L) for it in items]
        return mel.to(self.dtype), frames

    def _run(self, items: list[_Item], rows_alone: bool = False) -> list[list[WordTime]]:
        return self._start(items, rows_alone)()

    @torch.inference_mode()  # every entry (align, the worker, a direct call): the graphs' inputs are inference tensors
    def _start(self, items: list[_Item], rows_alone: bool = False) -> Callable[[], list[list[WordTime]]]:
        """The batch's pass launched; the call returned waits for it and gives each row's words. The padded pass
        (graphs=True, rows aligned as alone or one utterance) returns while its results are on their way to the host,
        so the caller's host work until that call (AlignerWorker: the next pass's launch) overlaps the device's; the
        packed pass is done before it returns."""
        with self._lock:
            if self._padded is not None and (rows_alone or len(items) == 1):
                frames = [it.num_samples // HOP for it in items]  # a row's own frames (log_mel of it alone)
                launched = self._padded(items, frames)  # None: a row under one chunk (the packed pass)
                if launched is not None:
                    def finish() -> list[list[WordTime]]:
                        classes, finite = launched.result()
                        _raise_unless_finite(items, finite)
                        return self._times(items, classes)
                    return finish
            words = self._forward(items, rows_alone)
        return lambda: words

    def _prompts(self, items: list[_Item], frames: list[int]) -> list[np.ndarray]:
        """Each row's prompt ids: <|audio_start|>, tokens_after_cnn(frames) audio_pad, <|audio_end|>, the words with
        their <timestamp> pairs."""
        words_ids = self.tokenizer.encode_batch([prompt_text(it.words).split("<|audio_end|>", 1)[1] for it in items])
        return [np.array([self._ids["<|audio_start|>"]] + [self.cfg.audio_token_id] * tokens_after_cnn(f)
                         + [self._ids["<|audio_end|>"]] + w, np.int64) for f, w in zip(frames, words_ids)]

    def _forward(self, items: list[_Item], rows_alone: bool) -> list[list[WordTime]]:
        """The packed pass: every row's prompt packed end to end, one forward for the batch, one host sync (the
        classes)."""
        ts = self.cfg.timestamp_token_id
        self._words_of(items)  # (align()'s texts, where the padded pass did not check them)
        items = [it.ready() for it in items]
        mel, frames = self._features(items, rows_alone)
        audio = self.thinker.audio_tower(mel, frames)  # [N_audio, D], rows in order
        rows = self._prompts(items, frames)
        ids = np.concatenate(rows)  # [N]
        select = np.flatnonzero(ids == ts)  # the timestamp slots, row after row
        logits = self.thinker(torch.from_numpy(ids).to(self.device), Ragged.of([len(r) for r in rows], self.device),
                              audio, torch.from_numpy(select).to(self.device))  # [M, classify_num]
        classes = logits.argmax(-1).cpu().numpy()  # [M]: the slots row after row, 2 a word
        lens = np.array([2 * len(it.words) for it in items])
        at = np.zeros((len(items), max(int(lens.max()), 1)), classes.dtype)  # [B, n]: each row's from its start
        at[np.arange(at.shape[1])[None, :] < lens[:, None]] = classes
        return self._times(items, at)

    def _times(self, items: list[_Item], classes: np.ndarray) -> list[list[WordTime]]:
        """Each row's words timed from the classes [B, >= n] at its <timestamp> slots (its first 2 x words)."""
        seg = np.float32(self.cfg.timestamp_segment_time)
        # ms as the official computes them: int class x float32 segment time
        return word_times_padded([it.words for it in items], classes.astype(np.float32) * seg)


def _finite(wav: np.ndarray) -> bool:
    """Every sample finite: a finite sum needs every sample finite (NaN and inf carry through it): one pass, no
    temporary; a sum that overflows is checked sample by sample."""
    return bool(np.isfinite(wav.sum()) or np.isfinite(wav).all())


def _raise_unless_finite(items: list[_Item], finite: np.ndarray) -> None:
    """finite [B] bool, a row's samples all finite: the first row's error that is not."""
    if not finite.all():
        raise ValueError(f"{items[int(finite.argmin())].label}audio has NaN or infinite samples")


class AlignerWorker:
    """One ForcedAligner shared by many callers (the server's streams, a TTS facade): each `submit` is checked at
    once (a bad item fails alone, before any work), queued, and a background thread aligns everything waiting as
    one batch (up to max_batch rows, each row as if alone: rows_alone), launching each pass before it hands out the
    last one's words, so that a pass's host work overlaps the last one's device work. On CUDA the thread runs on its
    own stream, so synthesis steps queued meanwhile are not ordered behind the aligner's kernels, and each waveform
    is staged in page-locked memory at submission (the pass copies it straight to the device). busy (e.g. an engine's
    `not settled`): while it returns True a pass waits, at most max_defer_s from its oldest submission, so the
    aligner's work, which can wait, does not slow newcomers' admission and first audio.

        worker = AlignerWorker(aligner)
        words = await worker.align(wav, 24000, "Hello world.", "English")      # or worker.submit(...).result()
    """

    def __init__(self, aligner: ForcedAligner, max_batch: int = WORKER_MAX_BATCH,
                 busy: Callable[[], bool] | None = None, max_defer_s: float = WORKER_MAX_DEFER_S):
        self.aligner, self.max_batch = aligner, max_batch
        self.busy, self.max_defer_s = busy, max_defer_s
        self._queue: list[tuple[_Item, Future, float]] = []  # (item, its future, submitted at: time.monotonic())
        self._cond = threading.Condition()
        self._closed = False
        self._stream = torch.cuda.Stream(aligner.device) if aligner.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._loop, name="q3tts-aligner", daemon=True)
        self._thread.start()

    def submit(self, audio: Any, sample_rate: int, text: str, language: str) -> Future:
        """A Future of the utterance's [WordTime]; ValueError at once for bad input."""
        item = self.aligner._item(audio, sample_rate, text, language, -1, ready=False,
                                  copy=self._stream is None)  # resampled on the thread (a copy: pinned, or copy)
        if isinstance(item.wav, torch.Tensor):  # (made on another stream: the worker's pass reads a host copy)
            item.wav = item.wav.cpu().numpy()
        if self._stream is not None:
            item.pinned = torch.from_numpy(item.wav).pin_memory()
            item.wav = item.pinned.numpy()  # (the caller's array is not kept)
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the aligner worker is closed")
            self._queue.append((item, fut, time.monotonic()))
            self._cond.notify()
        return fut

    async def align(self, audio: Any, sample_rate: int, text: str, language: str) -> list[WordTime]:
        """submit, awaited (for asyncio callers: the server's HTTP and WebSocket paths)."""
        return await asyncio.wrap_future(self.submit(audio, sample_rate, text, language))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        # the pass launched last, its words not handed out yet: the next pass is launched before they are (its host
        # work overlaps the device's), and they are handed out before the thread waits for anything else
        launched: tuple[list[Future], Callable[[], list[list[WordTime]]]] | None = None
        while True:
            with self._cond:
                while not self._queue and not self._closed and launched is None:
                    self._cond.wait()
                if self._closed and not self._queue and launched is None:
                    return
                until = self._queue[0][2] + self.max_defer_s if self._queue else None
            if until is None or self.busy is not None and self.busy():
                self._hand_out(launched)
                launched = None
                if until is None:
                    continue
            while self.busy is not None and not self._closed and time.monotonic() < until and self.busy():
                time.sleep(WORKER_POLL_S)  # (utterances that come meanwhile join this pass)
            with self._cond:
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            batch = [(it, f) for it, f, _ in batch if f.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                with torch.inference_mode(), (torch.cuda.stream(self._stream) if self._stream else nullcontext()):
                    finish = self.aligner._start([it for it, _ in batch], rows_alone=True)
            except BaseException as e:  # noqa: BLE001 - the callers get the error; the worker lives on
                for _, f in batch:
                    f.set_exception(e)
                continue
            self._hand_out(launched)
            launched = ([f for _, f in batch], finish)

    @staticmethod
    def _hand_out(launched: tuple[list[Future], Callable[[], list[list[WordTime]]]] | None) -> None:
        """A launched pass's words (or its error) to its callers, once it is done."""
        if launched is None:
            return
        futs, finish = launched
        try:
            words = finish()
        except BaseException as e:  # noqa: BLE001 - the callers get the error; the worker lives on
            for f in futs:
                f.set_exception(e)
            return
        for f, w in zip(futs, words):
            f.set_result(w)
