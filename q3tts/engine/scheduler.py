"""Continuous batching policy, pure Python: which requests join the batch this step.

Requests join as soon as a slot is free and leave the moment they finish, fail or are cancelled. The
newcomers of a step are prefilled in one padded batch [N, Lmax]: at most `max_prefills_per_step` of them
and N * Lmax <= `max_prefill_tokens` (the first always goes), so a burst of arrivals does not stall the
running streams for long.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import EngineRequest, RequestStatus


class QueueFullError(RuntimeError):
    pass


@dataclass(slots=True)
class SchedulerOutput:
    prefill: list[EngineRequest] = field(default_factory=list)  # newly admitted, slot assigned
    decode: list[EngineRequest] = field(default_factory=list)  # running before this step


class Scheduler:
    def __init__(self, max_slots: int, max_queue: int = 256, max_prefills_per_step: int = 16,
                 max_prefill_tokens: int = 8192):
        self.max_slots, self.max_queue, self.max_prefills_per_step = max_slots, max_queue, max_prefills_per_step
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[EngineRequest] = deque()
        self.running: dict[int, EngineRequest] = {}  # slot -> request
        self.free_slots: list[int] = list(range(max_slots - 1, -1, -1))

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: EngineRequest) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"server busy: {len(self.waiting)} requests already queued (max_queue "
                                 f"{self.max_queue}); retry later")
        self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(decode=list(self.running.values()))
        self.free_slots.sort(reverse=True)
        max_len = 0  # Lmax of the padded prefill batch
        while self.waiting and self.free_slots and len(out.prefill) < self.max_prefills_per_step:
            max_len = max(max_len, self.waiting[0].num_prompt_tokens)
            if out.prefill and (len(out.prefill) + 1) * max_len > self.max_prefill_tokens:
                break  # first come, first served: the next one waits for the next step
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop()  # the lowest free slot: after compaction, rows [B, B+N)
            req.status = RequestStatus.RUNNING
            self.running[req.slot] = req
            out.prefill.append(req)
        return out

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
