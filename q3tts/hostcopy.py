"""Many small host tensors to the device in one copy.

A copy from pageable host memory is synchronous (the host waits for the device to drain): admitting a wave of
newcomers made one per id list, index and sampling parameter. `to_device` packs them into one pinned staging buffer,
copies it asynchronously and hands back typed views of the device copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

# bytes: every section starts where any dtype's view of it may, and aligned as a fresh allocation for the kernels
# that read it (Triton specializes a pointer by its 16-byte alignment: a less aligned view would compile another
# variant; vectorized loads)
ALIGN = 64


class Fill(NamedTuple):
    """A section written in place on the host (e.g. rows gathered straight into the staging buffer: no tensor of
    its own to allocate, fault in and copy again): fill(out) writes out [shape] of dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Callable[[torch.Tensor], object]


def to_device(tensors: list[torch.Tensor | Fill], device: torch.device, pack: bool | None = None) -> list[torch.Tensor]:
    """Host tensors (any dtypes and shapes) or Fill sections -> the same values on `device`, in one non-blocking copy
    on CUDA.

    pack (default: device is CUDA): stage them in one byte buffer (pinned on CUDA) and return views of its copy;
    else each tensor `.to(device)` (on the CPU: the tensors themselves; a Fill: a tensor of its own, filled).
    NOTE(pinned-lifetime): the staging buffer comes from torch's caching host allocator, which records the copy's
    event and reuses the memory only after it, so it may go out of scope before the copy has run.
    """
    if not (device.type == "cuda" if pack is None else pack):
        return [_filled(t, torch.empty(t.shape, dtype=t.dtype)).to(device) if isinstance(t, Fill) else t.to(device)
                for t in tensors]
    offsets, sizes, n = [], [], 0
    for t in tensors:
        n = -(-n // ALIGN) * ALIGN
        offsets.append(n)
        sizes.append(math.prod(t.shape) * t.dtype.itemsize)
        n += sizes[-1]
    buf = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for t, o, size in zip(tensors, offsets, sizes):
        out = buf[o:o + size].view(t.dtype).view(t.shape)
        _filled(t, out) if isinstance(t, Fill) else out.copy_(t.detach())
    dev = buf.to(device, non_blocking=True)
    return [dev[o:o + size].view(t.dtype).view(t.shape) for t, o, size in zip(tensors, offsets, sizes)]


def ints_to_device(values, device: torch.device) -> torch.Tensor:
    """A list (or array) of ints -> int64 [len] on device, through to_device: no host sync on CUDA (torch.as_tensor
    of a list on CUDA copies from pageable memory and waits for the device to drain)."""
    return to_device([torch.as_tensor(values, dtype=torch.int64)], device)[0]


def _filled(f: Fill, out: torch.Tensor) -> torch.Tensor:
    f.fill(out)
    return out
