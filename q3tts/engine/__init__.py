"""The engine wing's face: what the API and the server use, and all they import from it.

    AsyncEngine (the one loop that steps an Engine; submit / generate / generate_codes / stream; step_stream: its
    stream where other work shares the GPU), Engine,
    AudioChunk, StreamOptions, QueueFullError, the compile-cache counters and the default slot count.

Exported lazily (module __getattr__): importing a light module of the wing (the scheduler, the request types) or
reading DEFAULT_MAX_SLOTS does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "AsyncEngine": "async_engine", "BlockingHandle": "async_engine", "EngineStats": "async_engine",
    "RequestHandle": "async_engine", "step_stream": "async_engine",
    "AudioChunk": "engine", "Engine": "engine", "EngineCounters": "engine",
    "RequestStatus": "request", "StreamOptions": "request",
    "QueueFullError": "scheduler",
    "compile_counts": "compile", "describe_counts": "compile",
    "DEFAULT_MAX_SLOTS": "memory",
}
__all__ = ["DEFAULT_MAX_SLOTS", "AsyncEngine", "AudioChunk", "BlockingHandle", "Engine", "EngineCounters",
           "EngineStats", "QueueFullError", "RequestHandle", "RequestStatus", "StreamOptions", "compile_counts",
           "describe_counts", "step_stream"]

if TYPE_CHECKING:
    from .async_engine import AsyncEngine, BlockingHandle, EngineStats, RequestHandle, step_stream
    from .compile import compile_counts, describe_counts
    from .engine import AudioChunk, Engine, EngineCounters
    from .memory import DEFAULT_MAX_SLOTS
    from .request import RequestStatus, StreamOptions
    from .scheduler import QueueFullError


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
