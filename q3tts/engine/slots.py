"""Per-slot state: one row per slot of the persistent batch, each device tensor declared once with its reset value
and whether it follows its request when the engine compacts the rows (`move`), beside the host mirrors that let
the runner choose a graph without a device sync.

A new per-slot field is one line in `Slots.__init__` (or in `SlotSampling` for a sampling parameter).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..hostcopy import to_device
from ..sampling import TOPK_CAP, SamplingParams
from .memory import KV_SPARE


def alloc_kv(cfg, rows: int, max_len: int, block_size: int | None, num_blocks: int | None, device: torch.device,
             dtype: torch.dtype) -> tuple[torch.Tensor, int | None]:
    """The talker's KV cache -> (kv, number of blocks or None). Per slot: [layers, k/v, slots, kv heads,
    max_len + KV_SPARE, head_dim]; paged (block_size): a pool of blocks [layers, k/v, blocks, kv heads, block_size,
    head_dim] (default: as many as every slot's max_len needs, + block 0, the scratch block that the entries of
    positions a row has no block for, and the rows of free slots, point at)."""
    if block_size:
        num_blocks = num_blocks or rows * (max_len // block_size) + 1
        shape = (cfg.num_hidden_layers, 2, num_blocks, cfg.num_key_value_heads, block_size, cfg.head_dim)
    else:
        shape = (cfg.num_hidden_layers, 2, rows, cfg.num_key_value_heads, max_len + KV_SPARE, cfg.head_dim)
    return torch.zeros(*shape, device=device, dtype=dtype), num_blocks


@dataclass
class SlotSampling:
    """The sampling parameters of every slot, one tensor [S] each, named as SamplingParams' fields."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    repetition_penalty: torch.Tensor
    subtalker_temperature: torch.Tensor
    subtalker_top_p: torch.Tensor
    top_k: torch.Tensor
    subtalker_top_k: torch.Tensor
    do_sample: torch.Tensor
    subtalker_dosample: torch.Tensor

    def rows(self, r: slice) -> SlotSampling:
        """Views of rows r."""
        return SlotSampling(**{f.name: getattr(self, f.name)[r] for f in fields(self)})

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def host_rows(self, params: list[SamplingParams]) -> list[torch.Tensor]:
        """The fields' values for rows of these parameters, on the host: one tensor [N] per field, in fields order."""
        return [torch.tensor([getattr(p, f.name) for p in params], dtype=getattr(self, f.name).dtype)
                for f in fields(self)]


def _topk_ok(params: SamplingParams) -> bool:
    """Whether the capped sampler (topk instead of full sorts) draws the same tokens for these parameters."""
    fits = lambda sample, k: not sample or 1 <= k <= TOPK_CAP  # noqa: E731
    return fits(params.do_sample, params.top_k) and fits(params.subtalker_dosample, params.subtalker_top_k)


class Slots:
    """S slots' state on `device`. D hidden size, V code-0 vocabulary, max_len positions; table_width: the paged
    cache's blocks per slot (None: not paged)."""

    def __init__(self, S: int, D: int, V: int, max_len: int, device: torch.device, dtype: torch.dtype,
                 table_width: int | None = None):
        self.num_rows, self.device = S, device
        self._fields: list[tuple[torch.Tensor, object, bool]] = []  # (tensor, reset value, moves with its request)
        f = self._field
        long, f32, b = torch.long, torch.float32, torch.bool
        self.position = f((), long)  # next cache position
        self.num_generated = f((), long)  # code-0 tokens sampled so far
        self.last_hidden = f((D,), dtype)
        self.last_code0 = f((), long)
        self.seen = f((V,), b)  # code-0 history for the repetition penalty
        self.trailing = f((max_len, D), dtype)  # the embedded text still to come, one token per frame
        self.trailing_len = f((), long)
        self.seed = f((), long)
        self.sampling = SlotSampling(
            temperature=f((), f32, 1.0), top_p=f((), f32, 1.0), repetition_penalty=f((), f32, 1.0),
            subtalker_temperature=f((), f32, 1.0), subtalker_top_p=f((), f32, 1.0),
            top_k=f((), long), subtalker_top_k=f((), long), do_sample=f((), b), subtalker_dosample=f((), b))
        # paged: each slot's blocks in position order (entry 0: the scratch block)
        self.block_table = f((table_width,), long) if table_width else None
        self.active = f((), b, True, moves=False)  # rows whose frame counts (a row waiting for text sits out)
        self.topk_ok = f((), b, True)  # the row fits the capped sampler (batch-invariant mode: DepthLoop.draw)
        # host mirrors
        self.position_cpu = [0] * S  # picks the length bucket without a device sync
        self.topk_ok_cpu = [True] * S  # every row fits the capped sampler: picks the graph
        self.active_cpu = [True] * S

    def _field(self, shape: tuple, dtype: torch.dtype, fill=0, moves: bool = True) -> torch.Tensor:
        t = torch.full((self.num_rows, *shape), fill, dtype=dtype, device=self.device)
        self._fields.append((t, fill, moves))
        return t

    def admit(self, lo: int, params: list[SamplingParams], positions: list[int], trailing: torch.Tensor,
              trailing_lens: list[int]) -> torch.Tensor:
        """N newcomers into rows [lo, lo+N): their parameters, positions (prompt lengths), no history, and their
        embedded trailing text (trailing [sum S_i, D]: row i's trailing_lens[i] rows after row i-1's). Every host
        value in one copy (hostcopy.to_device) and one write per field for the wave: no host sync.
        Returns the positions on the device [N]."""
        N = len(params)
        r = slice(lo, lo + N)
        topk_ok = [_topk_ok(p) for p in params]
        ints = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        # the packed trailing rows' destinations: (row, position)
        rows = torch.repeat_interleave(torch.arange(lo, lo + N), ints(trailing_lens))
        cols = torch.cat([torch.arange(n) for n in trailing_lens] or [ints([])])
        host = [*self.sampling.host_rows(params), torch.tensor(topk_ok), ints([p.seed for p in params]),
                ints(trailing_lens), ints(positions), rows, cols]
        *sampling, topk, seed, trailing_len, position, rows, cols = to_device(host, self.device)
        for t, v in zip(self.sampling.tensors(), sampling):
            t[r] = v
        self.topk_ok[r], self.seed[r], self.trailing_len[r], self.position[r] = topk, seed, trailing_len, position
        self.trailing[rows, cols] = trailing.to(self.trailing.dtype)
        self.seen[r] = False
        self.num_generated[r] = 0
        self.topk_ok_cpu[r] = topk_ok
        self.position_cpu[r] = positions
        return position

    def move(self, src: int, dst: int) -> None:
        """Compaction: the request in row src continues in row dst (paged: src's table row points at scratch)."""
        for t, _, moves in self._fields:
            if moves:
                t[dst] = t[src]
        if self.block_table is not None:
            self.block_table[src] = 0
        self.position_cpu[dst] = self.position_cpu[src]
        self.topk_ok_cpu[dst] = self.topk_ok_cpu[src]

    def set_blocks(self, rows: list[tuple[int, list[int]]]) -> None:
        """Paged: (slot, its blocks in position order) -> the slots' block table rows (the rest -> scratch)."""
        if not rows:
            return
        W = self.block_table.shape[1]
        table, slots = to_device([torch.tensor([blocks + [0] * (W - len(blocks)) for _, blocks in rows]),
                                  torch.tensor([s for s, _ in rows])], self.device)  # one copy, no sync
        self.block_table[slots] = table

    def reset(self) -> None:
        """Every row back to its initial state (after warm-ups wrote into free rows)."""
        for t, fill, _ in self._fields:
            t.fill_(fill)
        self.position_cpu = [0] * self.num_rows
        self.topk_ok_cpu = [True] * self.num_rows
        self.active_cpu = [True] * self.num_rows

    def set_active(self, B: int, active: list[bool]) -> None:
        """Rows [0, B) take part in the next frame where active is True (written only when it changed)."""
        if active != self.active_cpu[:B]:
            self.active[:B] = torch.tensor(active, device=self.device)
            self.active_cpu[:B] = active
