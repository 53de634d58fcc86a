"""The engine: continuous batching of talker frames, streaming vocoding, per-request outputs.

    step():  schedule -> run (prefill the newcomers in one batch, one frame for everyone running) -> vocode + update

A request stops when it samples EOS (allowed from its third code on) or when it has sampled
`max_new_tokens` codes; as upstream, the code 0 sampled last is dropped, so at most
max_new_tokens - 1 frames come out (also capped by the KV cache: max_seq_len - prompt length).
Rows join and leave the batch at every frame; a finished row is simply left out of the next frame,
so nothing of it can leak into the others.

Offline requests (stream=None) only collect codes; the caller decodes them with upstream's decoder
for parity. Streaming requests get AudioChunks from the exact stateful decoder (q3tts.engine.vocoder).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.talker import embed_prompt
from .request import EngineRequest, RequestStatus, StreamOptions
from .runner import ModelRunner
from .scheduler import Scheduler
from .vocoder import StreamingVocoder


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


@dataclass(slots=True)
class EngineCounters:
    """Cumulative totals of where the engine's time goes (read by the server's /metrics)."""

    steps: int = 0
    admitted: int = 0  # requests prefilled
    admission_wait_s: float = 0.0  # summed over admitted requests: arrival -> its prefill starts
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("admit", "decode", "vocode"), 0.0))


class Engine:
    def __init__(self, tts, max_slots: int = 8, max_seq_len: int = 4096, max_queue: int = 256,
                 use_cuda_graphs: bool | None = None, compile: bool | None = None):
        self.tts = tts
        self.runner = ModelRunner(tts.talker, tts.tts_pad_embed, max_slots=max_slots, max_len=max_seq_len,
                                  use_cuda_graphs=use_cuda_graphs,
                                  compile=compile if compile is not None else tts.compile)
        self.runner.capture_graphs()
        self.scheduler = Scheduler(max_slots, max_queue)
        self.vocoder = StreamingVocoder(tts.code2wav, max_slots, use_graphs=self.runner.use_graphs,
                                        compile=self.runner.compiled)
        self.vocoder.capture_graphs()
        self.eos = tts.cfg.talker.codec_eos_token_id
        self._ids = itertools.count()
        self._lock = threading.Lock()  # add/abort may come from another thread than step()
        self._aborts: list[str] = []
        self.counters = EngineCounters()

    # ------------------------------------------------------------------ requests in
    def add_request(self, prepared, stream: StreamOptions | None = None, request_id: str | None = None) -> EngineRequest:
        """Queue a prepared request (q3tts.api.PreparedRequest). stream=None: offline, codes only."""
        if stream is not None:
            stream.validate()
        req = EngineRequest(request_id=request_id or f"req-{next(self._ids)}", prepared=prepared,
                            stream=stream)
        with self._lock:
            self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborts)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[AudioChunk]:
        aborted = []
        with self._lock:
            aborts, self._aborts = self._aborts, []
            for rid in aborts:
                req = self.scheduler.find(rid)
                if req is not None and not req.status.finished:
                    self._finish(req, RequestStatus.FINISHED_ABORTED)  # frees the slot now
                    self._release_vocoder(req)  # nothing more is decoded for it
                    aborted.append(req)
        t0 = time.perf_counter()
        self._compact()  # running requests fill rows [0, B), so the newcomers get rows [B, B+N)
        with self._lock:
            sched = self.scheduler.schedule()
        self._admit(sched.prefill)
        self._compact()  # newcomers that finished at once (EOS, length, error) leave holes
        t1 = time.perf_counter()
        running = sorted(self.scheduler.running.values(), key=lambda r: r.slot)
        if running:
            self._decode(running)
        t2 = time.perf_counter()
        touched = [r for r in aborted + sched.prefill + sched.decode if r.stream is not None]
        chunks = self._vocode(list(dict.fromkeys(touched)))
        c = self.counters
        c.steps += 1
        for phase, dt in zip(("admit", "decode", "vocode"), (t1 - t0, t2 - t1, time.perf_counter() - t2)):
            c.phase_s[phase] += dt
        return chunks

    def _release_vocoder(self, req: EngineRequest) -> None:
        if req.vocoder_row is not None:
            self.vocoder.close(req.vocoder_row)
            req.vocoder_row = None

    def _finish(self, req: EngineRequest, status: RequestStatus) -> None:
        slot = req.slot
        self.scheduler.finish(req, status)
        if slot is not None:
            self.runner.free_slot(slot)

    def _compact(self) -> None:
        with self._lock:
            moves = self.scheduler.compact()
        for src, dst in moves:
            self.runner.move_slot(src, dst)

    def _admit(self, reqs: list[EngineRequest]) -> None:
        """Embed each newcomer's prompt (per request), then prefill them all in one batched talker forward.
        A request that fails (bad prompt, too long) finishes with an error alone; the others go on."""
        admitted = []  # (request, prefill [L, D], trailing [S, D])
        for req in reqs:
            pr = req.prepared
            try:
                with torch.inference_mode():
                    pre, trail = embed_prompt(self.tts.talker, pr.layout, pr.speaker_embedding, pr.ref_codes)
                self.runner.check_prompt(pre.shape[0], trail.shape[0])
            except ValueError as e:
                req.error = str(e)
                self._finish(req, RequestStatus.FINISHED_ERROR)
                continue
            admitted.append((req, pre, trail))
        if not admitted:
            return
        now = time.perf_counter()
        self.counters.admitted += len(admitted)
        self.counters.admission_wait_s += sum(now - a[0].arrival_time for a in admitted)
        if len(admitted) < len(reqs):
            # close up the failed requests' rows; the moved newcomers hold nothing yet (position 0, so no KV
            # moves) and prefill_batch overwrites their state
            self._compact()
            admitted.sort(key=lambda a: a[0].slot)
        lo = self.scheduler.num_running - len(admitted)
        assert [a[0].slot for a in admitted] == list(range(lo, lo + len(admitted))), "newcomers: rows [B, B+N)"
        codes0 = self.runner.prefill_batch(lo, [a[1] for a in admitted], [a[2] for a in admitted],
                                           [a[0].prepared.params for a in admitted])
        streaming = [a[0] for a in admitted if a[0].stream is not None]
        for req, row in zip(streaming, self.vocoder.open([r.prepared.ref_codes for r in streaming])):
            req.vocoder_row = row
        for (req, pre, _), code0 in zip(admitted, codes0):
            pr = req.prepared
            req.max_frames = min(pr.params.max_new_tokens - 1, self.runner.max_len - pre.shape[0])
            if code0 == self.eos:
                self._finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.max_frames <= 0:
                self._finish(req, RequestStatus.FINISHED_LENGTH)

    def _decode(self, reqs: list[EngineRequest]) -> None:
        assert [r.slot for r in reqs] == list(range(len(reqs))), "running requests must fill rows [0, B)"
        out = self.runner.decode_frame(len(reqs))
        for row, r in enumerate(reqs):
            r.frames.append(out.codes[row])
            if out.next_code0[row] == self.eos:
                self._finish(r, RequestStatus.FINISHED_STOPPED)
            elif r.num_frames >= r.max_frames:
                self._finish(r, RequestStatus.FINISHED_LENGTH)

    def _vocode(self, reqs: list[EngineRequest]) -> list[AudioChunk]:
        """Decode every chunk that is due: full chunks while running, the remainder at the end."""
        work, meta = [], []
        for r in reqs:
            if r.status == RequestStatus.FINISHED_ABORTED:
                meta.append((r, 0, True))  # nothing more is decoded for a cancelled request
                continue
            pending = r.num_frames - r.frames_vocoded
            last = r.status.finished
            n = pending if last else (r.next_chunk_size() if pending >= r.next_chunk_size() else 0)
            if n > 0:
                work.append((r.vocoder_row, torch.stack(r.frames[r.frames_vocoded: r.frames_vocoded + n])))
            if n > 0 or last:
                meta.append((r, n, last))
        decoded = iter(self.vocoder.decode(work))
        now = time.perf_counter()
        chunks = []
        for r, n, last in meta:
            if n > 0:
                audio = next(decoded)
            else:
                audio = np.zeros(0, dtype=np.float32)
            chunks.append(AudioChunk(r.request_id, audio, self.tts.sample_rate, r.frames_vocoded, n, last,
                                     r.status.reason if last else None, now - r.arrival_time, r.error))
            r.frames_vocoded += n
            r.chunks_emitted += 1
            if last:
                self._release_vocoder(r)
                r.stream_done = True
        return chunks

    # ------------------------------------------------------------------ offline
    def run_to_completion(self, reqs: list[EngineRequest]) -> list[AudioChunk]:
        chunks = []
        while any(not r.status.finished for r in reqs) or self._aborts:
            chunks += self.step()
        return chunks

    def generate_codes(self, prepared: list) -> list[torch.Tensor]:
        """Offline: codes [T_i, K] for each prepared request (queued beyond max_slots as needed)."""
        reqs = [self.add_request(p) for p in prepared]
        self.run_to_completion(reqs)
        for r in reqs:
            if r.status == RequestStatus.FINISHED_ERROR:
                raise ValueError(r.error)
        K = self.runner.K
        return [torch.stack(r.frames) if r.frames else torch.zeros(0, K, dtype=torch.long) for r in reqs]
