"""Where torch.compile keeps what it compiles, so that a restart reuses it.

Inductor's FX graph cache and the AOTAutograd cache (both on by default in torch 2.13) and, on CUDA, the
Triton kernels of the graphs live under TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_<user>: lost on
reboot and in a fresh container, so every start of the server compiled everything again (244 s on an H100,
~120 s with that cache warm). q3tts points it at a per-user directory that survives, unless the user chose one:

    compile_cache argument (a directory, or False: leave torch's defaults)
    > $Q3TTS_COMPILE_CACHE (a directory, or "off")
    > $TORCHINDUCTOR_CACHE_DIR set by the user
    > $XDG_CACHE_HOME/q3tts/compile/torch-<version> ($XDG_CACHE_HOME: default ~/.cache)

Triton's kernels go under the same directory (torch's triton/<device> subfolder) unless TRITON_CACHE_DIR is set.
Entries are keyed by hashes that include torch's own source (torch_key) and the compiled code, so versions never
collide; the default directory still names the torch version, so an old one can simply be deleted.
Dynamo's tracing is not cached: a warm start still traces every compiled function (seconds, not minutes).
"""

from __future__ import annotations

import logging
import os

import torch

ENV = "Q3TTS_COMPILE_CACHE"
OFF = ("0", "off", "false", "no", "none")
log = logging.getLogger("q3tts.engine")


def default_compile_cache() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "q3tts", "compile", "torch-" + torch.__version__.replace("+", "-"))


def _torch_default() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return os.path.abspath(default_cache_dir())


def use_compile_cache(setting: str | os.PathLike | bool | None = None) -> str | None:
    """Point torch's compile caches at the directory `setting` resolves to (see the module doc) before anything
    compiles; returns that directory, or None where q3tts leaves torch's defaults (False / "off").

    Args:
        setting: a directory; None or True: $Q3TTS_COMPILE_CACHE, else the user's TORCHINDUCTOR_CACHE_DIR, else the
            per-user default; False: off.
    """
    if setting is None or setting is True:
        setting = os.environ.get(ENV) or None
        user = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        # (torch writes its /tmp default into the environment once it has compiled: that one is not the user's)
        if setting is None and user and os.path.abspath(user) != _torch_default():
            return user
    if setting is False or (isinstance(setting, str) and setting.strip().lower() in OFF):
        return None
    path = os.path.abspath(os.path.expanduser(os.fspath(setting or default_compile_cache())))
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path  # torch reads it at every cache access, not only at import
    return path


def compile_counts() -> dict[str, int]:
    """Process totals of the compile caches: FX graphs (Inductor) and AOTAutograd entries, found or compiled."""
    from torch._dynamo.utils import counters
    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {"fx_hit": ind["fxgraph_cache_hit"], "fx_miss": ind["fxgraph_cache_miss"],
            "aot_hit": aot["autograd_cache_hit"], "aot_miss": aot["autograd_cache_miss"]}


def describe_counts(before: dict[str, int], after: dict[str, int] | None = None) -> str:
    """The compilations between two compile_counts(), e.g. '12 graphs from the compile cache, 0 compiled (warm)'."""
    after = after or compile_counts()
    hit, miss = after["fx_hit"] - before["fx_hit"], after["fx_miss"] - before["fx_miss"]
    state = "nothing compiled" if not hit + miss else "warm" if not miss else "cold" if not hit else "partly warm"
    return f"{hit} graphs from the compile cache, {miss} compiled ({state})"
