"""The compile policy (what torch.compile compiles, with which Inductor settings) and where its caches live.

Inductor's FX graph cache and the AOTAutograd cache (both on by default in torch 2.13) and, on CUDA, the
Triton kernels of the graphs live under TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_<user>: lost on
reboot and in a fresh container, so every start of the server compiled everything again (BENCHMARKS.md: start-up).
q3tts points it at a per-user directory that survives, unless the user chose one:

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

import functools
import logging
import os

import torch

from .. import invariant
from ..models.layers import DecoderLayer
from ..sampling import sample, sample_topk, talker_logits_rules

ENV = "Q3TTS_COMPILE_CACHE"
OFF = ("0", "off", "false", "no", "none")
log = logging.getLogger("q3tts.engine")


def want_compile(device: torch.device, flag: bool | None) -> bool:
    """Default: on for CUDA (set Q3TTS_COMPILE=0 to disable), off on CPU."""
    if flag is not None:
        return flag
    env = os.environ.get("Q3TTS_COMPILE")
    return env == "1" if env is not None else device.type == "cuda"


def compile_layers(talker: torch.nn.Module) -> None:
    """torch.compile each decoder layer's forward (fuses norms, RoPE and the attention glue into a few kernels).
    One compiled function serves every layer instance; batch and length are dynamic, so a handful of compilations
    cover all graph buckets."""
    import torch._dynamo
    import torch._inductor.config
    import torch.fx.experimental._config as fx_config
    # room for the layer's variants (batch buckets x spans x the code predictor's steps)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # NOTE(compile): no duck shaping: two sizes equal at compile time would share one symbol, so a prefill whose span
    # (64) equalled the head dim (64) was compiled for that span only, and every longer prompt recompiled
    fx_config.use_duck_shape = False
    # NOTE(compile): float attributes (the norms' eps) as constants: else Dynamo first makes them symbolic floats,
    # finds Inductor cannot keep them so, and restarts the whole trace
    torch._dynamo.config.specialize_float = True
    # NOTE(compile): no matmul padding: Inductor's pad_mm pass guards the attended span, so longer spans compiled
    # every layer variant again; the dims it would pad are multiples of 64 already
    torch._inductor.config.shape_padding = False
    # NOTE(pdl): Inductor's own kernels stay out of programmatic dependent launch (triton.enable_pdl); only the
    # engine's kernels (q3tts.kernels) use it. An Inductor kernel waits only for the buffers its graph's previous
    # node wrote while ours let the next kernel start early (bf16 graph and eager codes parted with PDL in part of
    # the graphs); Inductor's static launcher cannot launch PDL kernels (slower warm starts); and the frame time
    # did not change beyond the machines' spread (BENCHMARKS.md).
    fwd = torch.compile(DecoderLayer.forward, dynamic=True, fullgraph=True)
    for m in talker.modules():
        if isinstance(m, DecoderLayer) and not isinstance(m.forward, functools.partial):
            m.forward = functools.partial(fwd, m)


def compile_model(talker: torch.nn.Module, on: bool) -> tuple:
    """The runner's compiled functions: with `on`, the talker's layers compiled in place (compile_layers) and
    (sample, sample_topk, talker_logits_rules) compiled with dynamic batch; else the plain samplers."""
    fns = (sample, sample_topk, talker_logits_rules)
    if not on:
        return fns
    compile_layers(talker)
    compiled = tuple(torch.compile(f, dynamic=True) for f in fns)
    # NOTE(invariant): eager torch reduces each row alone (sorts, softmax, cumsum); Inductor compiles 1 row and n rows
    # apart, and may reduce them differently
    return (sample, *compiled[1:]) if invariant.ENABLED else compiled


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
