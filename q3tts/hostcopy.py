"""Many small host tensors to the device in one copy.

A copy from pageable host memory is synchronous (the host waits for the device to drain): admitting a wave of
newcomers made one per id list, index and sampling parameter. `to_device` packs them into one pinned staging buffer,
copies it asynchronously and hands back typed views of the device copy.
"""

from __future__ import annotations

import torch

ALIGN = 8  # bytes: every section starts where any dtype's view of it may (int64, float64)


def to_device(tensors: list[torch.Tensor], device: torch.device, pack: bool | None = None) -> list[torch.Tensor]:
    """Host tensors (any dtypes and shapes) -> the same values on `device`, in one non-blocking copy on CUDA.

    pack (default: device is CUDA): stage them in one byte buffer (pinned on CUDA) and return views of its copy;
    else each tensor `.to(device)` (on the CPU: the tensors themselves).
    NOTE(pinned-lifetime): the staging buffer comes from torch's caching host allocator, which records the copy's
    event and reuses the memory only after it, so it may go out of scope before the copy has run.
    """
    if not (device.type == "cuda" if pack is None else pack):
        return [t.to(device) for t in tensors]
    offsets, n = [], 0
    for t in tensors:
        n = -(-n // ALIGN) * ALIGN
        offsets.append(n)
        n += t.numel() * t.element_size()
    buf = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for t, o in zip(tensors, offsets):
        buf[o:o + t.numel() * t.element_size()].view(t.dtype).copy_(t.detach().reshape(-1))
    dev = buf.to(device, non_blocking=True)
    return [dev[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for t, o in zip(tensors, offsets)]
