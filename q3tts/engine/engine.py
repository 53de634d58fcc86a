"""The engine: continuous batching of talker frames, streaming vocoding, per-request outputs.

    step():  schedule (cancel, compact, admit) -> run (prefill the newcomers in one batch, one frame for every
             row) -> update (record frames, finish on EOS / length) -> vocode (the chunks that are due)

A request stops when it samples EOS (allowed from its third code on) or when it has sampled
`max_new_tokens` codes; as upstream, the code 0 sampled last is dropped, so at most
max_new_tokens - 1 frames come out (also capped by the KV cache: max_seq_len - prompt length).
Rows join and leave the batch at every frame; a finished row is simply left out of the next frame,
so nothing of it can leak into the others.

Offline requests (stream=None) only collect codes; the caller decodes them with upstream's decoder
for parity. Streaming requests get AudioChunks from the exact stateful decoder (q3tts.engine.vocoder).

Deadline-aware streaming (q3tts.engine.deadline; on CUDA by default, $Q3TTS_DEADLINE or Engine(deadline=) set it): the
scheduler admits newcomers as the running streams' slack allows, and the chunks that are due go nearest deadline
first (a stream about to run dry at once, several of its chunks together if it was left waiting); the step's phases
are measured into the policy's moving averages after every step (its knobs: $Q3TTS_DEADLINE_<NAME>,
DeadlinePolicy.from_env). A stream's audio is cut into the same chunks whatever the timing: the same bits.

Streamed text (PreparedRequest.text, q3tts.inputs.text): a request waits until its text fills the prompt,
then every newly committed text token is handed to its row (all rows' in one call per step); frame k runs once
token k is there (or the text is complete), so the frames equal those of the whole text whatever the pace of the
text.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .. import invariant
from ..inputs.request import PreparedRequest
from ..models.loaders import Checkpoint
from . import compile_helpers
from .artifact import load_artifact
from .compile import (
    compile_counts,
    describe_counts,
    flush_precompiled,
    precompiling,
    use_compile_cache,
    want_compile,
)
from .compile_helpers import Source
from .deadline import DeadlinePolicy, chunk_cut, full_chunks
from .deadline import wanted as deadline_wanted
from .memory import size_engine
from .request import EngineRequest, RequestStatus, StreamOptions
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerOutput
from .turn import HostTurn, device_wait
from .vocoder import StreamingVocoder

log = logging.getLogger("q3tts.engine")


@dataclass(slots=True)
class AudioChunk:
    request_id: str
    audio: np.ndarray  # [num_frames * 1920] float32, 24 kHz
    sample_rate: int
    frame_index: int  # index of the chunk's first frame
    num_frames: int
    is_last: bool
    finish_reason: str | None  # on the last chunk: "stop" (EOS), "length", "abort" or "error"
    elapsed_s: float  # since the request arrived
    error: str | None = None
    word_timestamps: list | None = None  # on an utterance's last chunk when asked for (api): [WordTime]


@dataclass(slots=True)
class EngineCounters:
    """Cumulative totals of where the engine's time goes (read by the server's /metrics)."""

    steps: int = 0
    admitted: int = 0  # requests prefilled
    admission_wait_s: float = 0.0  # summed over admitted requests: arrival -> its prefill starts
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("admit", "decode", "vocode"), 0.0))


class Engine:
    def __init__(self, ckpt: Checkpoint, max_slots: int | None = 8, max_seq_len: int | None = 4096,
                 max_queue: int = 256, use_cuda_graphs: bool | None = None, compile: bool | None = None,
                 gpu_memory_utilization: float | None = None, gpu_memory: float | None = None,
                 kv_block_size: int | None = None, compile_cache: str | bool | None = None,
                 batch_invariant: bool | None = None, compile_artifact: str | None = None,
                 deadline: bool | None = None):
        """max_slots / max_seq_len None: fitted to the memory budget (q3tts.engine.memory.size_engine): a fraction
        of the GPU (gpu_memory_utilization, default 0.9; on a CPU of the host memory available, default 0.5) or
        gpu_memory GB. kv_block_size (e.g. 64): a paged KV cache, whose blocks follow the positions streams use (as
        many as the budget holds) instead of max_seq_len positions per slot from the start. compile_cache: where
        torch.compile's caches live (q3tts.engine.compile: default a per-user directory that survives
        restarts; False: torch's). compile_artifact: a file from `q3tts warmup --save` loaded into that cache
        before anything compiles (q3tts.engine.artifact). batch_invariant: q3tts.invariant's switch, set for the
        process (None: as it is). deadline: deadline-aware streaming (q3tts.engine.deadline; None: as
        $Q3TTS_DEADLINE says, unset: on for CUDA, off on a CPU); off: admission by count and token budget, chunks when
        full. A bad $Q3TTS_DEADLINE or $Q3TTS_DEADLINE_<NAME> fails here, before anything is built (ValueError naming
        the accepted values)."""
        if deadline is None:
            deadline = deadline_wanted(os.environ, ckpt.device.type)
        policy = DeadlinePolicy.from_env(os.environ) if deadline else None
        if batch_invariant is not None:
            invariant.set_enabled(batch_invariant)
        t0, counts = time.perf_counter(), compile_counts()
        self.ckpt = ckpt
        max_slots, max_seq_len, num_blocks = size_engine(ckpt, max_slots, max_seq_len, gpu_memory_utilization,
                                                         gpu_memory, block_size=kv_block_size)
        self.artifact = None  # the loaded compiled artifact's header (None: none, or it did not apply)
        if compile_artifact and want_compile(ckpt.device, compile):
            # before the runner's torch.compile calls: they install the Dynamo entries the artifact put in the cache
            use_compile_cache(compile_cache)
            self.artifact = load_artifact(compile_artifact, ckpt)
        elif compile_artifact:
            log.warning("compiled artifact %s unused: torch.compile is off", compile_artifact)
        self.runner = ModelRunner(ckpt.talker, ckpt.tts_pad_embed, max_slots=max_slots, max_len=max_seq_len,
                                  use_cuda_graphs=use_cuda_graphs, compile=compile, block_size=kv_block_size,
                                  num_blocks=num_blocks, compile_cache=compile_cache)
        # a runner that compiles lazily (no CUDA graphs: at the first requests) records its compilations then
        self._precompile_in_steps = self.runner.compiled and not self.runner.use_graphs
        self._traced_flushed = counts["traced"]  # Dynamo's graphs traced when its entries were last written
        with precompiling(self.runner.compiled):
            frame_graphs = self.runner.capture_graphs(Source(
                str(ckpt.model_dir), str(ckpt.device), str(ckpt.dtype).removeprefix("torch."), ckpt.quantization,
                max_slots, self.runner.max_len))
            compile_helpers.dismiss()  # helpers started at launch that the cold start did not take
            self.vocoder = StreamingVocoder(ckpt.code2wav, max_slots, use_graphs=self.runner.use_graphs,
                                            compiled=self.runner.compiled)
            self.num_graphs = frame_graphs + self.vocoder.capture_graphs()  # CUDA graphs of the frames and the vocoder
        self.policy = policy
        self.scheduler = Scheduler(max_slots, max_queue, eos=ckpt.cfg.talker.codec_eos_token_id,
                                   num_blocks=num_blocks or 0, block_size=kv_block_size or 0, policy=self.policy)
        # a step's host work before a consumer's event loop (q3tts.engine.turn): where steps are mostly device time
        self.turn = HostTurn(enabled=self.runner.use_graphs)
        if self.runner.compiled and self.runner.use_graphs:
            flush_precompiled()  # every compilation is done: a restart installs their Dynamo entries
        if self.runner.compiled or self.runner.use_graphs:  # (on CPU the compilations come with the first request)
            log.info("engine built in %.1f s: %d CUDA graphs, %s; compile cache %s; deadline policy %s",
                     time.perf_counter() - t0, self.num_graphs, describe_counts(counts),
                     self.runner.compile_cache or ("torch's default" if self.runner.compiled else "unused"),
                     "on" if self.policy else "off")
        self._ids = itertools.count()
        self._lock = threading.Lock()  # add/abort/text may come from another thread than step()
        self.wake = threading.Event()  # set when there may be new work: a request, a cancellation, text
        self._text_news = False
        self._held: list[EngineRequest] = []  # the requests of the step in progress
        self.failed_ids: list[str] = []  # the requests a step that raised held (it finished them with an error)
        self.counters = EngineCounters()
        # NOTE(settled): no request waits for a slot and every streaming row that can run has sent its first audio;
        # set after each step (False at once when a request comes), read by other threads to hold back work that can
        # wait (the forced aligner's worker) while newcomers are admitted and their first chunks made
        self.settled = True
        self.owner = None  # the AsyncEngine whose thread steps it (q3tts.engine.async_engine): the only one that may

    # ------------------------------------------------------------------ requests in
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, prepared: PreparedRequest, stream: StreamOptions | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    before_queue: Callable[[EngineRequest], None] | None = None) -> EngineRequest:
        """Queue a prepared request. stream=None: offline, codes only. ValueError if it cannot fit the cache.
        arrival_time: when the caller got it (default now); before_queue(req) runs before a step can see it."""
        req = EngineRequest(request_id=request_id or self.new_request_id(), prepared=prepared, stream=stream)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        if prepared.layout is not None:
            self._set_prompt(req, prepared.layout)
        else:
            prepared.text.on_change = self._on_text
        if before_queue is not None:
            before_queue(req)
        with self._lock:
            self.scheduler.add(req)
        self.settled = False
        self.wake.set()
        return req

    def _set_prompt(self, req: EngineRequest, lay) -> None:
        self.runner.check_prompt(len(lay), len(lay.trailing_ids))
        req.prepared.layout = lay
        req.max_frames = min(req.prepared.params.max_new_tokens - 1, self.runner.max_len - len(lay),
                             req.prepared.frame_cap() or self.runner.max_len)  # runaway guard (streamed: once closed)
        req.text_fed = len(lay.trailing_ids)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.scheduler.abort(request_id)
        self.wake.set()

    def has_work(self) -> bool:
        with self._lock:  # add_request may append to the queue from another thread while this reads it
            return self._text_news or self.scheduler.has_work()

    def wait_for_work(self, timeout: float = 0.05) -> bool:
        """True if a step has something to do now; else wait up to `timeout` for news (a request, a cancellation,
        text: `wake`) and return False, so the caller looks again. The one idle wait of every step loop."""
        if self.has_work():
            return True
        self.wake.wait(timeout)
        self.wake.clear()
        return False

    def _on_text(self) -> None:
        self._text_news = True
        self.wake.set()

    def _feed_text(self) -> list[EngineRequest]:
        """Streamed texts: lay out the prompt of a waiting request once its text suffices, and hand the running
        ones their newly committed text. A text that cannot be spoken (empty, too long) fails its request;
        those are returned."""
        self._text_news = False
        failed = []
        for req in [r for r in self.scheduler.waiting if r.prepared.text is not None and not r.prompt_ready]:
            text = req.prepared.text
            try:
                if text.error:
                    raise ValueError(text.error)
                lay = text.layout()
                if lay is not None:
                    self._set_prompt(req, lay)
                    req.text_done = text.closed
            except ValueError as e:
                failed.append(req)
                req.error = str(e)
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        feeds = []  # (slot, start, ids): embedded for every row at once
        for req in [r for r in self.scheduler.running.values() if r.prepared.text is not None and not r.text_done]:
            ids, req.text_done = req.prepared.text.take()
            if req.text_done:  # the whole text is known: the runaway guard
                req.max_frames = min(req.max_frames, req.prepared.frame_cap() or req.max_frames)
            if req.text_fed + len(ids) > self.runner.max_len:
                failed.append(req)
                req.error = (f"the text is too long: more than {self.runner.max_len} streamed text tokens for the "
                             "engine's max_seq_len; send shorter utterances")
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            elif ids:
                feeds.append((req.slot, req.text_fed, ids))
                req.text_fed += len(ids)
        self.runner.append_text(feeds)
        return failed

    # ------------------------------------------------------------------ the step
    def step(self) -> list[AudioChunk]:
        """One step. If it raises (a bug, a device error), the requests it held are finished with the error and
        their slots and vocoder rows freed (failed_ids); queued requests were not touched and go on."""
        self._held = []
        try:
            with precompiling(self._precompile_in_steps), self.turn.hold():
                out = self._step()
            if self._precompile_in_steps:
                self._flush_step_entries()
            return out
        except Exception as e:
            with self._lock:
                for req in self._held:
                    req.error = req.error or f"{type(e).__name__}: {e}"
                    self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
                    self._release_vocoder(req)
                    req.stream_done = True
            self.failed_ids = [r.request_id for r in self._held]
            raise

    def _flush_step_entries(self) -> None:
        """A runner that compiles in its steps (no CUDA graphs): the Dynamo entries of what this step traced written
        to the compile cache, as a start that captures graphs writes its own (a restart installs them)."""
        traced = compile_counts()["traced"]
        if traced != self._traced_flushed:
            self._traced_flushed = traced
            flush_precompiled()

    def _step(self) -> list[AudioChunk]:
        t0 = time.perf_counter()
        with self._lock:
            failed = self._feed_text()
            t_text = time.perf_counter()
            sched = self.scheduler.schedule()
            self._held = [r for r in failed + sched.aborted + sched.rows if not r.stream_done]
        codes0 = self._admit(sched)
        t1 = time.perf_counter()
        frame = self.runner.decode_frame(len(sched.rows), sched.active) if any(sched.active) else None
        self.scheduler.update_from_output(sched, codes0, frame)
        t2 = time.perf_counter()
        chunks = self._vocode([r for r in failed + sched.aborted + sched.rows if r.stream is not None])
        t3 = time.perf_counter()
        c = self.counters
        c.steps += 1
        for phase, dt in zip(("admit", "decode", "vocode"), (t1 - t0, t2 - t1, t3 - t2)):
            c.phase_s[phase] += dt
        if self.policy is not None:
            self.policy.record(t1 - t_text, len(sched.prefill), t2 - t1 if frame is not None else None,
                                     t3 - t2 if any(ch.num_frames for ch in chunks) else None,
                                     alone_max=self.runner.prefill_alone_max(),  # the prefill's regimes (PrefillCost)
                                     text_s=t_text - t0)  # every step's: not the newcomers' cost
        self.settled = self.scheduler.queue_depth == 0 and all(
            r.first_sent_at is not None or r.stream is None or r.stream_done or not r.can_run for r in sched.rows)
        return chunks

    def _admit(self, sched: SchedulerOutput) -> list[int]:
        """Close up the rows (compaction), release cancelled streams, then embed the newcomers' prompts and prefill
        them in one batched talker forward (the runner's) -> their code 0 of frame 0."""
        for src, dst in sched.moves:
            self.runner.move_slot(src, dst)
        if sched.blocks:
            self.runner.slots.set_blocks([(r.slot, r.blocks) for r in sched.blocks if not r.status.finished])
        for req in sched.aborted:
            self._release_vocoder(req)  # nothing more is decoded for it
        if not sched.prefill:
            return []
        now = time.perf_counter()
        self.counters.admitted += len(sched.prefill)
        self.counters.admission_wait_s += sum(now - r.arrival_time for r in sched.prefill)
        lo = len(sched.decode)
        assert [r.slot for r in sched.prefill] == list(range(lo, lo + len(sched.prefill))), "newcomers: rows [B, B+N)"
        codes0 = self.runner.admit(lo, [r.prepared for r in sched.prefill])  # [N] on the device
        streaming = [r for r in sched.prefill if r.stream is not None]
        for req, row in zip(streaming, self.vocoder.open([r.prepared.ref_codes for r in streaming])):
            req.vocoder_row = row
        with device_wait():
            return codes0.tolist()  # the wave's host sync, once the vocoder rows' host work overlapped its prefill

    def _release_vocoder(self, req: EngineRequest) -> None:
        if req.vocoder_row is not None:
            self.vocoder.close(req.vocoder_row)
            req.vocoder_row = None

    def _vocode(self, reqs: list[EngineRequest]) -> list[AudioChunk]:
        """Decode the chunks that are due (by deadline with the policy, else full chunks), in that order; each
        advances its request's playback clock."""
        work, sizes, final, meta = [], [], [], []
        plan = (self.policy.plan_chunks(reqs, time.perf_counter(), self.scheduler.num_ready)
                if self.policy is not None else full_chunks(reqs))
        for r, n in plan:
            if n > 0:
                work.append((r.vocoder_row, r.frames[r.frames_vocoded: r.frames_vocoded + n]))
                sizes.append(chunk_cut(r.stream, r.frames_vocoded, n))
                final.append(r.status.finished)  # its row is released below: its last chunk may be padded
            meta.append((r, n, r.status.finished))
        decoded = iter(self.vocoder.decode(work, sizes, final))
        now = time.perf_counter()
        chunks = []
        for r, n, last in meta:
            audio = next(decoded) if n > 0 else np.zeros(0, dtype=np.float32)
            chunks.append(AudioChunk(r.request_id, audio, self.ckpt.sample_rate, r.frames_vocoded, n, last,
                                     r.status.reason if last else None, now - r.arrival_time, r.error))
            r.sent(n, len(audio) / self.ckpt.sample_rate, now)
            if last:
                self._release_vocoder(r)
                r.stream_done = True
        return chunks
