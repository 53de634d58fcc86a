"""Continuous batching policy, pure Python: which requests join the batch this step.

Requests join as soon as a slot is free and leave the moment they finish or are cancelled. The
newcomers of a step are prefilled in one padded batch [N, Lmax]: at most `max_prefills_per_step` of them
and N * Lmax <= `max_prefill_tokens` (the first always goes), so a burst of arrivals does not stall the
running streams for long. With a DeadlinePolicy (q3tts.engine.deadline) the policy sizes the wave among those:
the most whose estimated prefill fits into the running streams' slack, never a wave in the expensive middle between
the runner's prefill graph replays and its batched forward (the first whenever no stream is at risk, and those that
have waited the policy's max_wait_s in any case); its max_wave, if set, replaces max_prefills_per_step. The
engine's step is schedule() -> run (runner) -> update_from_output() -> vocode.

Paged KV cache (num_blocks > 0): blocks of block_size positions are handed out as rows need them. A newcomer gets
the blocks of its prompt and first frame, and is admitted only while one spare block per running row remains; a
running row gets its next block when its next frame crosses into it, and sits the frame out while none is free
(finishing rows free theirs at once); if every row is waiting for a block, the newest of them fails ("error").
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .deadline import DeadlinePolicy
from .request import EngineRequest, RequestStatus


class QueueFullError(RuntimeError):
    pass


@dataclass(slots=True)
class SchedulerOutput:
    moves: list[tuple[int, int]] = field(default_factory=list)  # compaction (src slot, dst slot), applied in order
    aborted: list[EngineRequest] = field(default_factory=list)  # cancelled since the last step (slots freed)
    decode: list[EngineRequest] = field(default_factory=list)  # running before this step, in rows [0, B)
    prefill: list[EngineRequest] = field(default_factory=list)  # admitted now, in rows [B, B+N)
    active: list[bool] = field(default_factory=list)  # per row: its frame can run (streamed text has arrived)
    blocks: list[EngineRequest] = field(default_factory=list)  # paged: rows whose blocks changed (set their table)

    @property
    def rows(self) -> list[EngineRequest]:
        """The requests of this step's frame, row by row."""
        return self.decode + self.prefill


@dataclass(slots=True)
class FrameResult:
    """What the runner made for a SchedulerOutput's rows (see ModelRunner)."""

    codes: Any  # [B, K] the frame each row completed, as B rows [K] (on the device: they stay there for the vocoder)
    next_code0: list[int]  # [B] code 0 sampled for the next frame


class Scheduler:
    def __init__(self, max_slots: int, max_queue: int = 256, max_prefills_per_step: int = 16,
                 max_prefill_tokens: int = 8192, eos: int = -1, num_blocks: int = 0, block_size: int = 0,
                 policy: DeadlinePolicy | None = None):
        self.policy = policy  # None: admission by count and token budget only
        self.max_slots, self.max_queue, self.max_prefills_per_step = max_slots, max_queue, max_prefills_per_step
        self.max_prefill_tokens, self.eos = max_prefill_tokens, eos
        self.block_size = block_size
        self.free_blocks: list[int] = list(range(num_blocks - 1, 0, -1)) if num_blocks else []  # 0: scratch
        self.paged = num_blocks > 0
        self.waiting: deque[EngineRequest] = deque()
        self.running: dict[int, EngineRequest] = {}  # slot -> request
        self.free_slots: list[int] = list(range(max_slots - 1, -1, -1))
        self._aborts: list[str] = []

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def num_ready(self) -> int:
        """Queued requests whose prompt is ready to prefill (a streamed text's request is queued from its first piece,
        before its prompt is: until then no newcomer the running streams make room for)."""
        return sum(r.prompt_ready for r in self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        """Something a step would do: a cancellation, a newcomer whose prompt is ready, a row that can run."""
        return bool(self._aborts or any(r.prompt_ready for r in self.waiting)
                    or any(r.can_run for r in self.running.values()))

    def add(self, req: EngineRequest) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"server busy: {len(self.waiting)} requests already queued (max_queue "
                                 f"{self.max_queue}); retry later")
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        """Cancel at the next schedule() (a no-op for an unknown or finished request)."""
        self._aborts.append(request_id)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Apply the cancellations, keep the running requests in rows [0, B) and admit newcomers into [B, B+N)
        (requests whose streamed text is not yet enough for their prompt wait, without holding up the others).
        now: the time the policy's slack is read at (default time.perf_counter())."""
        out = SchedulerOutput()
        for rid in self._aborts:
            req = self.find(rid)
            if req is not None and not req.status.finished:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                out.aborted.append(req)
        self._aborts.clear()
        out.moves = self.compact()
        out.decode = [self.running[s] for s in sorted(self.running)]
        self.free_slots.sort(reverse=True)
        max_len = 0  # Lmax of the padded prefill batch
        ready = [r for r in self.waiting if r.prompt_ready]
        most = self.max_prefills_per_step
        if self.policy is not None:
            now = time.perf_counter() if now is None else now
            for r in ready:
                r.ready_at = now if r.ready_at is None else r.ready_at
            most = self.policy.max_wave or most
        # the candidates: first come, first served, while slots, the token budget and (paged) blocks allow
        take, forced, free_blocks = [], 0, len(self.free_blocks)
        for req in ready:
            if len(take) == min(len(self.free_slots), most):
                break
            L = max(max_len, req.num_prompt_tokens)
            if take and (len(take) + 1) * L > self.max_prefill_tokens:
                break  # the next one waits for the next step
            if self.paged:
                need = req.num_prompt_tokens // self.block_size + 1  # positions 0..L (its first frame writes L)
                if free_blocks < need + len(self.running) + len(take):  # keep a spare block per running row
                    break
                free_blocks -= need
            max_len = L
            take.append(req)
            if self.policy is not None and self.policy.waited(req, now):
                forced = len(take)  # it goes, and those before it
        if self.policy is not None:  # how many of them the running rows' slack allows
            take = take[:self.policy.wave(len(take), forced, self.policy.admission_budget(out.decode, now))]
        for req in take:
            if self.paged:
                need = req.num_prompt_tokens // self.block_size + 1
                req.blocks = [self.free_blocks.pop() for _ in range(need)]
                out.blocks.append(req)
            self.waiting.remove(req)
            req.slot = self.free_slots.pop()  # the lowest free slot: after compaction, rows [B, B+N)
            req.status = RequestStatus.RUNNING
            self.running[req.slot] = req
            out.prefill.append(req)
        out.active = [r.can_run for r in out.rows]
        if self.paged:
            self._grow(out)
        return out

    def _grow(self, out: SchedulerOutput) -> None:
        """Paged: the next block of every row whose next frame needs it; without one it sits the frame out."""
        waiting = []
        for row, req in enumerate(out.rows):
            if out.active[row] and len(req.blocks) <= req.next_position // self.block_size:
                if self.free_blocks:
                    req.blocks.append(self.free_blocks.pop())
                    if req not in out.blocks:
                        out.blocks.append(req)
                else:
                    out.active[row] = False
                    waiting.append(req)
        if waiting and not any(out.active):  # nothing runs, so nothing frees a block: give up the newest
            victim = max(waiting, key=lambda r: r.arrival_time)
            victim.error = (f"out of KV-cache memory: all {len(self.running)} running streams need a new block; "
                            "lower max_concurrent or raise the memory budget")
            self.finish(victim, RequestStatus.FINISHED_ERROR)

    def update_from_output(self, sched: SchedulerOutput, prefill_code0: list[int], out: FrameResult | None) -> None:
        """Record each active row's frame (out is None when no row was active) and finish the requests that are
        done: EOS sampled (a newcomer's frame-0 code too), or max_frames reached. Their slots are free at once;
        the next schedule() closes the holes."""
        for req, code0 in zip(sched.prefill, prefill_code0):
            if code0 == self.eos:
                self.finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.max_frames <= 0:
                self.finish(req, RequestStatus.FINISHED_LENGTH)
        for row, req in enumerate(sched.rows):
            if out is None or req.status.finished or not sched.active[row]:
                continue  # sat the frame out, or finished at its prefill: the frame made for its row is dropped
            req.frames.append(out.codes[row])
            if out.next_code0[row] == self.eos:
                self.finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.num_frames >= req.max_frames:
                self.finish(req, RequestStatus.FINISHED_LENGTH)
    def compact(self) -> list[tuple[int, int]]:
        """Keep the running requests in slots [0, num_running): move the highest into the lowest hole.
        Returns the (src, dst) moves for the runner to apply, in order."""
        moves = []
        self.free_slots.sort(reverse=True)  # pop() gives the lowest
        while self.running and self.free_slots and self.free_slots[-1] < max(self.running):
            src, dst = max(self.running), self.free_slots.pop()
            req = self.running.pop(src)
            req.slot = dst
            self.running[dst] = req
            self.free_slots.append(src)
            self.free_slots.sort(reverse=True)
            moves.append((src, dst))
        return moves

    def finish(self, req: EngineRequest, status: RequestStatus) -> None:
        """Mark req finished and free its slot at once (a no-op for a request already finished)."""
        if req.status.finished:
            return
        req.status = status
        self.free_blocks.extend(reversed(req.blocks))
        req.blocks = []
        if req.slot is not None and self.running.get(req.slot) is req:
            del self.running[req.slot]
            self.free_slots.append(req.slot)
        elif req in self.waiting:
            self.waiting.remove(req)

    def find(self, request_id: str) -> EngineRequest | None:
        for r in (*self.running.values(), *self.waiting):
            if r.request_id == request_id:
                return r
        return None
