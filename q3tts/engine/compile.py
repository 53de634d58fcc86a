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
Dynamo's own output (the traced bytecode and its guards, per compiled function) is cached too, by torch's
"caching precompile" (torch._dynamo.package: one entry per function under <cache>/dynamo/, and inside
torch.compiler.save_cache_artifacts(), hence in q3tts's compiled artifact): a warm or artifact start installs those
entries when it calls torch.compile and traces nothing they cover (BENCHMARKS.md: start-up). `compile_fn` scopes it to
q3tts's own functions (a function compiled with it on must have guards that can be saved: another library's
torch.compile'd functions stay as torch makes them). On with $Q3TTS_PRECOMPILE=1, which `q3tts serve` and
`q3tts warmup` set unless the user did: one engine a process. Off by default elsewhere: a library process may build
engines one after another, and the GPU suite, which does so in processes sharing one cache, failed with it on
(BENCHMARKS.md: start-up).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import types

import torch

from .. import invariant
from ..models.codec import TransformerLayer
from ..models.layers import DecoderLayer
from ..sampling import sample, sample_topk, talker_logits_rules

ENV = "Q3TTS_COMPILE_CACHE"
PRECOMPILE_ENV = "Q3TTS_PRECOMPILE"
# Guards that check an object's identity (a module, function, class, closure or dict version): they cannot be saved
# (torch.compile raises in its package); a fresh process has other objects anyway, and the code they stand for is
# checked by the package's source hashes instead (torch._dynamo.package.SourceInfo)
IDENTITY_GUARDS = frozenset(("DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH",
                             "CLOSURE_MATCH", "WEAKREF_ALIVE"))
OFF = ("0", "off", "false", "no", "none")
log = logging.getLogger("q3tts.engine")


def want_compile(device: torch.device, flag: bool | None) -> bool:
    """Default: on for CUDA (set Q3TTS_COMPILE=0 to disable), off on CPU."""
    if flag is not None:
        return flag
    env = os.environ.get("Q3TTS_COMPILE")
    return env == "1" if env is not None else device.type == "cuda"


def _settings() -> None:
    """Dynamo's and Inductor's settings for q3tts's compiled functions (set once per process, before any compiles)."""
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


def compile_layers(talker: torch.nn.Module) -> None:
    """torch.compile each decoder layer's forward (fuses norms, RoPE and the attention glue into a few kernels).
    One compiled function serves every layer instance; batch and length are dynamic, so a handful of compilations
    cover all graph buckets."""
    _settings()
    cuda = next(talker.parameters()).device.type == "cuda"
    fwd = compile_fn(DecoderLayer.forward, cuda=cuda, dynamic=True, fullgraph=True)
    for m in talker.modules():
        if isinstance(m, DecoderLayer) and not isinstance(m.forward, functools.partial):
            m.forward = functools.partial(fwd, m)


def compile_codec(cuda: bool):
    """The streaming vocoder's pre-transformer layer compiled (TransformerLayer.forward: its norms, RoPE, layer scales
    and residual adds fused into a few kernels, where eager each is a launch or more in every vocoder call), rows and
    frames dynamic: a function for Code2Wav.decode_step's `layer`. The modules stay eager: the offline decodes, of
    other lengths, would compile while serving. cuda: it runs on CUDA (portable_guards)."""
    _settings()
    return compile_fn(TransformerLayer.forward, cuda=cuda, dynamic=True, fullgraph=True)


def compile_model(talker: torch.nn.Module, on: bool) -> tuple:
    """The runner's compiled functions: with `on`, the talker's layers compiled in place (compile_layers) and
    (sample, sample_topk, talker_logits_rules) compiled with dynamic batch; else the plain samplers."""
    fns = (sample, sample_topk, talker_logits_rules)
    if not on:
        return fns
    compile_layers(talker)
    cuda = next(talker.parameters()).device.type == "cuda"
    compiled = tuple(compile_fn(f, cuda=cuda, dynamic=True) for f in fns)
    # NOTE(invariant): eager torch reduces each row alone (sorts, softmax, cumsum); Inductor compiles 1 row and n rows
    # apart, and may reduce them differently
    return (sample, *compiled[1:]) if invariant.ENABLED else compiled


def want_precompile() -> bool:
    """Dynamo's output cached with the compile cache and the artifact: $Q3TTS_PRECOMPILE set and not 0/off (the
    CLI's serve and warmup set it: serve_precompile)."""
    return os.environ.get(PRECOMPILE_ENV, "0").strip().lower() not in OFF


def serve_precompile() -> None:
    """A process that builds one engine (`q3tts serve`, `q3tts warmup`, bench.startup's starts): Dynamo's entries on
    unless $Q3TTS_PRECOMPILE says otherwise."""
    os.environ.setdefault(PRECOMPILE_ENV, "1")


def portable_guards(entries, cuda: bool = False) -> list[bool]:
    """torch.compile's guard_filter_fn for precompiled functions: keep what describes the inputs (tensor dtypes,
    devices, sizes and strides, the symbolic shapes' ranges, constants and, on a CPU, the global state), drop the
    identity guards (IDENTITY_GUARDS) and any guard on a Python function (a compiled layer's forward is torch's
    wrapper function, which torch saves as a placeholder: its type guard would fail in every later process).
    cuda: the functions run on CUDA, where the global state's guard (GLOBAL_STATE) goes too: it holds torch's CPU
    thread count, which differs between the machine that built an artifact and the one that loads it (or under
    taskset, or a container's CPU limit), and a saved entry whose guard failed is traced again whole
    (BENCHMARKS.md: start-up); CUDA code does not depend on that count. Its other fields (grad mode, autocast,
    default dtype, the deterministic and TF32 switches) are q3tts's own in a precompiling process: only `q3tts
    serve` and `q3tts warmup` turn it on, and the engine calls its compiled functions in inference mode (which the
    tensors' dispatch-key guards check), never under autocast, and sets none of the rest. On a CPU it stays:
    Inductor's C++ kernels are built for the thread count.
    NOTE(guards): in-process this trusts that q3tts never rebinds a function or module its compiled code inlined."""
    drop = IDENTITY_GUARDS | {"GLOBAL_STATE"} if cuda else IDENTITY_GUARDS
    return [e.guard_type not in drop and not IDENTITY_GUARDS.intersection(e.derived_guard_types or ())
            and not (e.has_value and isinstance(e.value, types.FunctionType)) for e in entries]


@contextlib.contextmanager
def precompiling(on: bool = True):
    """Within: torch.compile of q3tts's functions records Dynamo's output for the caches (torch's caching precompile;
    its switch is per thread from torch 2.13 on, so the thread that compiles must be inside). Nothing where
    want_precompile() is False: under that switch Dynamo also drops the identity guards (ID_MATCH, DICT_VERSION) of
    whatever it traces, which only a saved entry needs (portable_guards chooses them there)."""
    import torch._dynamo
    if not on or not want_precompile():
        yield
        return
    with torch._dynamo.config.patch(caching_precompile=True):
        yield


def compile_fn(fn, cuda: bool = False, **kw):
    """torch.compile(fn, **kw), precompiled unless want_precompile() is False: its Dynamo entry is looked up in the
    compile cache now (a hit installs the traced code and guards: no tracing at the first call), and what it compiles
    later (inside `precompiling`) is recorded for flush_precompiled and save_cache_artifacts. An entry that does not
    install here (another q3tts, a changed source) is a warning and a normal compilation. cuda: fn runs on CUDA
    (portable_guards)."""
    if not want_precompile():
        return torch.compile(fn, **kw)
    from torch._dynamo.utils import counters
    try:
        hits = counters["dynamo_cache"]["dynamo_cache_hit"]
        # NOTE(precompile): an installed entry's guards are built now, and a tensor's dispatch-key guard takes in the
        # thread's dispatch state of this moment: the engine calls its compiled functions in inference mode (and
        # traced them so), so they are built in it too (else no inference tensor would ever pass them)
        with precompiling(), torch.inference_mode():
            out = torch.compile(fn, options={"guard_filter_fn": functools.partial(portable_guards, cuda=cuda)}, **kw)
        if counters["dynamo_cache"]["dynamo_cache_hit"] > hits:
            _skip_installed_ids()
        return out
    except Exception as e:  # noqa: BLE001 (torch's package loader raises what it likes; any failure: trace as usual)
        log.warning("cached Dynamo entry of %s not used, tracing it: %s: %s", getattr(fn, "__qualname__", fn),
                    type(e).__name__, e)
    return torch.compile(fn, **kw)


_ID_SUFFIX = re.compile(r"_(\d+)$")


def _skip_installed_ids() -> None:
    """NOTE(precompile): a trace names the globals it installs from one process-wide counter
    (torch._dynamo.bytecode_transformation.unique_id: '__builtins_dict___2'), and an installed entry brings the names
    of the process that saved it: a later trace here (a variant the cache does not hold) would take one of them and
    fail ("Name '__builtins_dict___2' already exists in scope"). So the counter moves past every such name present."""
    import itertools
    import sys

    from torch._dynamo import bytecode_transformation as bt
    top = -1
    for m in list(sys.modules.values()):
        names = getattr(m, "__dict__", None)
        if isinstance(names, dict):
            for k in list(names):
                if isinstance(k, str) and k.startswith("__") and (hit := _ID_SUFFIX.search(k)):
                    top = max(top, int(hit.group(1)))
    nxt = next(bt._unique_id_counter)
    bt._unique_id_counter = itertools.count(max(nxt, top + 1))


def flush_precompiled() -> int:
    """Write the Dynamo entries this process recorded (compile_fn's functions, compiled inside `precompiling`) into
    the compile cache's dynamo/ folder, so that a restart installs them -> the number written. (save_cache_artifacts
    does it too, for the artifact.)"""
    if not want_precompile():
        return 0
    try:
        from torch._dynamo.precompile_context import PrecompileContext
        with precompiling():
            entries, _ = PrecompileContext.create_cache_entries()
            if entries:
                PrecompileContext.save_to_dynamo_cache()
        return len(entries)
    except Exception as e:  # noqa: BLE001 (a failed write costs the next start its tracing, never this one)
        log.warning("Dynamo entries not written to the compile cache: %s: %s", type(e).__name__, e)
        return 0


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
    """Process totals of the compile caches: FX graphs (Inductor) and AOTAutograd entries, found or compiled; Dynamo's
    graphs traced (`traced`) and its cached entries installed or not found (per compiled function)."""
    from torch._dynamo.utils import counters
    ind, aot, dyn = counters["inductor"], counters["aot_autograd"], counters["dynamo_cache"]
    return {"fx_hit": ind["fxgraph_cache_hit"], "fx_miss": ind["fxgraph_cache_miss"],
            "aot_hit": aot["autograd_cache_hit"], "aot_miss": aot["autograd_cache_miss"],
            "traced": counters["stats"]["unique_graphs"], "dynamo_hit": dyn["dynamo_cache_hit"],
            "dynamo_miss": dyn["dynamo_cache_miss"] + dyn["dynamo_cache_error"]}


def dynamo_seconds() -> float:
    """Seconds this process spent in Dynamo's compilation of frames: tracing and the backend it calls (on a warm start
    without Dynamo's entries mostly tracing, Inductor's part coming from the cache), or installing cached entries."""
    from torch._dynamo.utils import compilation_time_metrics
    return sum(sum(v) for k, v in compilation_time_metrics.items() if k.endswith("compile_inner"))


def describe_counts(before: dict[str, int], after: dict[str, int] | None = None) -> str:
    """The compilations between two compile_counts(), e.g. '12 graphs from the compile cache, 0 compiled (warm);
    Dynamo: 12 graphs traced, 0 functions' entries installed'."""
    after = after or compile_counts()
    # a graph from the cache is an AOTAutograd entry found (it holds Inductor's graph: no FX lookup follows) or, where
    # none was, an FX graph found
    hit = sum(after[k] - before[k] for k in ("fx_hit", "aot_hit"))
    miss = after["fx_miss"] - before["fx_miss"]
    traced, installed = (after.get(k, 0) - before.get(k, 0) for k in ("traced", "dynamo_hit"))
    found = hit + installed
    state = "nothing compiled" if not found + miss else "warm" if not miss else "cold" if not found else "partly warm"
    return (f"{hit} graphs from the compile cache, {miss} compiled ({state}); Dynamo: {traced} graphs traced, "
            f"{installed} functions' entries installed")
