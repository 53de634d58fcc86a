"""The compile cache: where q3tts points torch's caches (and where it leaves the user's choice), and a real hit
across processes: a second process compiles nothing that the first one compiled."""

import os

import pytest

from q3tts.engine.compile import (
    compile_fn,
    default_compile_cache,
    describe_counts,
    portable_guards,
    use_compile_cache,
)
from q3tts.server.settings import parse_args

from .fresh_process import run_child


@pytest.fixture
def env(monkeypatch, tmp_path):
    """No cache variable set; XDG_CACHE_HOME in tmp_path (every variable is restored after the test)."""
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "Q3TTS_COMPILE_CACHE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("Q3TTS_PRECOMPILE", "1")  # (compile_fn's tests: Dynamo's entries asked for)
    return monkeypatch


def test_default_is_a_per_user_directory_that_survives(env, tmp_path):
    path = use_compile_cache()
    assert path == default_compile_cache() and path.startswith(str(tmp_path / "xdg" / "q3tts" / "compile" / "torch-"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path and os.path.isdir(path)
    assert "TRITON_CACHE_DIR" not in os.environ  # Triton's kernels follow (torch's triton/ subfolder)


def test_the_users_own_setting_wins(env, tmp_path):
    env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    # ... unless it is torch's own /tmp default, which torch writes into the environment once it has compiled
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    env.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert use_compile_cache() == default_compile_cache()
    # Q3TTS_COMPILE_CACHE, then an explicit argument, win over it
    env.setenv("Q3TTS_COMPILE_CACHE", str(tmp_path / "q3"))
    assert use_compile_cache() == str(tmp_path / "q3") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert use_compile_cache(tmp_path / "arg") == str(tmp_path / "arg") == os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_off_leaves_torchs_defaults(env, tmp_path):
    assert use_compile_cache(False) is None and use_compile_cache("off") is None
    env.setenv("Q3TTS_COMPILE_CACHE", "off")
    assert use_compile_cache() is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_serve_flag_and_environment(env, tmp_path):
    assert parse_args([], environ={}).compile_cache is None
    assert parse_args(["--compile-cache", "/c"], environ={}).compile_cache == "/c"
    assert parse_args([], environ={"Q3TTS_COMPILE_CACHE": "off"}).compile_cache == "off"


def test_dynamo_entries_are_for_one_engine_processes(monkeypatch):
    """Off unless asked for (a library process may build engines one after another); `q3tts serve` and `q3tts warmup`
    turn them on (serve_precompile) unless the user set Q3TTS_PRECOMPILE."""
    from q3tts.engine.compile import serve_precompile, want_precompile
    monkeypatch.delenv("Q3TTS_PRECOMPILE", raising=False)
    assert not want_precompile()
    serve_precompile()
    assert want_precompile()
    monkeypatch.setenv("Q3TTS_PRECOMPILE", "0")
    serve_precompile()
    assert not want_precompile()


def test_precompiling_is_off_where_the_entries_are(monkeypatch):
    """Where no Dynamo entry is saved, the engine's precompiling window leaves torch's switch alone: under it Dynamo
    drops the identity guards of whatever it traces."""
    import torch._dynamo

    from q3tts.engine.compile import precompiling
    monkeypatch.delenv("Q3TTS_PRECOMPILE", raising=False)
    with precompiling(True):
        assert not torch._dynamo.config.caching_precompile
    monkeypatch.setenv("Q3TTS_PRECOMPILE", "1")
    with precompiling(True):
        assert torch._dynamo.config.caching_precompile
    with precompiling(False):
        assert not torch._dynamo.config.caching_precompile


def test_describe_counts():
    zero = {"fx_hit": 0, "fx_miss": 0, "aot_hit": 0, "aot_miss": 0, "traced": 0, "dynamo_hit": 0, "dynamo_miss": 0}
    assert describe_counts(zero, dict(zero, fx_hit=3, traced=3)) == (
        "3 graphs from the compile cache, 0 compiled (warm); Dynamo: 3 graphs traced, 0 functions' entries installed")
    assert "2 compiled (cold)" in describe_counts(zero, dict(zero, fx_miss=2, traced=2))
    # AOTAutograd entries found count as from the cache (a compile helper's graphs come so)
    assert describe_counts(zero, dict(zero, aot_hit=17, aot_miss=5, fx_miss=5, traced=22)).startswith(
        "17 graphs from the compile cache, 5 compiled (partly warm)")
    assert "(warm); Dynamo: 0 graphs traced, 5 functions' entries installed" in describe_counts(zero,
                                                                                               dict(zero, dynamo_hit=5))


def _double(x):
    return x * 2


def test_a_corrupt_dynamo_entry_is_traced_as_usual(env, tmp_path):
    import torch
    from torch._dynamo.package import CompilePackage
    from torch._dynamo.utils import counters
    use_compile_cache(tmp_path / "cc")
    entry = tmp_path / "cc" / "dynamo" / CompilePackage.source_id_from_fn(_double)
    entry.mkdir(parents=True)
    (entry / "entry").write_bytes(b"not a pickle")
    errors = counters["dynamo_cache"]["dynamo_cache_error"]
    f = compile_fn(_double, backend="eager")
    assert counters["dynamo_cache"]["dynamo_cache_error"] == errors + 1
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))


def test_an_entry_that_fails_to_install_is_a_warning(env, tmp_path, monkeypatch, caplog):
    import logging

    import torch
    from torch._dynamo import package

    def broken(fn):
        raise AttributeError("'_Missing' object has no attribute '_torchdynamo_inline'")
    use_compile_cache(tmp_path / "cc")
    monkeypatch.setattr(package.DynamoCache, "load", broken)
    with caplog.at_level(logging.WARNING, "q3tts.engine"):
        f = compile_fn(_double, backend="eager")
    assert "cached Dynamo entry of _double not used, tracing it: AttributeError" in caplog.text
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))


def test_portable_guards_keep_what_describes_the_inputs():
    from types import SimpleNamespace as E
    entries = [E(guard_type="TENSOR_MATCH", derived_guard_types=(), has_value=True, value=1),
               E(guard_type="SHAPE_ENV", derived_guard_types=(), has_value=False, value=None),
               E(guard_type="MODULE_MATCH", derived_guard_types=(), has_value=True, value=os),
               E(guard_type="BUILTIN_MATCH", derived_guard_types=("ID_MATCH",), has_value=True, value=len),
               E(guard_type="TYPE_MATCH", derived_guard_types=(), has_value=True, value=_double),
               E(guard_type="EQUALS_MATCH", derived_guard_types=(), has_value=True, value=False),
               E(guard_type="GLOBAL_STATE", derived_guard_types=(), has_value=False, value=None)]
    assert portable_guards(entries) == [True, True, False, False, False, True, True]
    # on CUDA the global state (with torch's CPU thread count) goes too: the other machine's count must not retrace
    assert portable_guards(entries, cuda=True) == [True, True, False, False, False, True, False]


# Two decoder layers (two instances: one compiled function must serve both) through compile_layers, as the talker's.
CHILD = """
import json, os, torch
torch.set_num_threads(int(os.environ.get("CHILD_THREADS", "1")))
dev = os.environ.get("CHILD_DEVICE", "cpu")
from q3tts.config import DecoderLayerConfig
from q3tts.engine.compile import compile_counts, use_compile_cache
from q3tts.engine.compile import compile_layers, flush_precompiled, precompiling
from q3tts.models.layers import AttnContext, DecoderLayer, rope_cos_sin, rope_inv_freq
use_compile_cache()  # from Q3TTS_COMPILE_CACHE
cfg = DecoderLayerConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=8)
torch.manual_seed(0)
layers = torch.nn.ModuleList(DecoderLayer(cfg) for _ in range(2)).to(dev)
compile_layers(layers)
L, n = 5, 16
kv = torch.zeros(2, 2, 1, 2, n, 16, device=dev)
pos = torch.arange(L, device=dev)[None]
cos, sin = rope_cos_sin(pos, rope_inv_freq(16, 10000.0).to(dev), torch.float32)
ctx = AttnContext(pos, (torch.arange(n, device=dev)[None] <= pos[0][:, None])[None, None])
with precompiling(), torch.inference_mode():  # (as the engine compiles: its Dynamo entry is recorded)
    x = torch.randn(1, L, 32, device=dev)
    for i, layer in enumerate(layers):
        x = layer(x, cos, sin, kv[i][0], kv[i][1], ctx)
flush_precompiled()  # (the engine does it once its graphs are captured)
counts = compile_counts()
# another variant, traced in a process that may have installed a saved entry (torch names their globals alike)
y = torch.randn(1, L, 32, device=dev)  # not an inference tensor: a new variant
with torch.inference_mode():
    layers[0](y, cos, sin, kv[0][0], kv[0][1], ctx)
print(json.dumps({"counts": counts, "out": x.flatten().tolist(), "variant_traced": compile_counts()["traced"]}))
"""


def child_runner(tmp_path, script: str = CHILD):
    """run(**env) -> the script's JSON (CHILD's by default), run in a fresh process on the compile cache tmp_path/cc."""
    return lambda **env: run_child(script, Q3TTS_COMPILE_CACHE=str(tmp_path / "cc"), **env)


@pytest.mark.slow  # a cold Inductor compile on the CPU: ~45 s of the ~90 s on a loaded 2-core box
def test_second_process_hits_the_cache(tmp_path):
    run = child_runner(tmp_path)
    cold, warm = run(Q3TTS_PRECOMPILE="1"), run(Q3TTS_PRECOMPILE="1")
    untraced = run()  # (off unless asked for: a library process)
    pick = ("fx_hit", "fx_miss", "aot_hit", "aot_miss", "traced", "dynamo_hit")
    # one graph for both layers, traced and compiled once, no AOTAutograd miss beyond it (a Dynamo restart, as float
    # attributes once caused, would show one)
    assert {k: cold["counts"][k] for k in pick} == {"fx_hit": 0, "fx_miss": 1, "aot_hit": 0, "aot_miss": 1,
                                                    "traced": 1, "dynamo_hit": 0}, cold
    # a restart installs Dynamo's entry with its compiled graph: nothing traced, nothing looked up in Inductor's cache
    assert {k: warm["counts"][k] for k in pick} == {"fx_hit": 0, "fx_miss": 0, "aot_hit": 0, "aot_miss": 0,
                                                    "traced": 0, "dynamo_hit": 1}, warm
    assert warm["out"] == cold["out"]
    assert warm["variant_traced"] == 1  # a variant the entry does not cover is traced as usual, after it
    # without Dynamo's entries (Q3TTS_PRECOMPILE=0): traced again, its graph from Inductor's cache, the same bits
    # (AOTAutograd's entry is looked up apart: the precompiling start saved it bundled, keyed otherwise)
    assert {k: untraced["counts"][k] for k in ("fx_hit", "fx_miss", "traced", "dynamo_hit")} == {
        "fx_hit": 1, "fx_miss": 0, "traced": 1, "dynamo_hit": 0}, untraced
    assert untraced["out"] == cold["out"]
    assert any((tmp_path / "cc" / "dynamo").iterdir())


# One compiled function, its entry recorded and written; the thread count and portable_guards' cuda flag from the env
THREADS_CHILD = """
import json, os, torch
torch.set_num_threads(int(os.environ["CHILD_THREADS"]))
from q3tts.engine.compile import compile_counts, compile_fn, flush_precompiled, precompiling, use_compile_cache
use_compile_cache()
def double_plus(x):
    return x * 2 + 1
f = compile_fn(double_plus, cuda=os.environ["CHILD_CUDA"] == "1", dynamic=False)
with precompiling(), torch.inference_mode():
    out = f(torch.arange(4.0))
flush_precompiled()
print(json.dumps({"counts": compile_counts(), "out": out.tolist()}))
"""


@pytest.mark.parametrize("cuda", [False, True])
def test_another_thread_count_traces_again_only_where_the_global_state_is_guarded(tmp_path, cuda):
    """The global state's guard holds torch's CPU thread count: a restart with another count installs the saved entry,
    then traces again where that guard was saved (a CPU's functions), and not where portable_guards dropped it (the
    CUDA engine's: the other machine's count must not cost it its entries)."""
    run = child_runner(tmp_path, THREADS_CHILD)
    cold, warm = (run(Q3TTS_PRECOMPILE="1", CHILD_CUDA=str(int(cuda)), CHILD_THREADS=str(n)) for n in (1, 2))
    assert cold["counts"]["traced"] == 1 and warm["counts"]["dynamo_hit"] == 1, (cold, warm)
    assert warm["counts"]["traced"] == (0 if cuda else 1), warm
    assert warm["out"] == cold["out"] == [1.0, 3.0, 5.0, 7.0]


@pytest.mark.gpu
def test_a_restart_with_another_thread_count_installs_the_entry_on_cuda(tmp_path):
    """On CUDA a restart whose torch CPU thread count is not the compiling process's (another machine loading an
    artifact, taskset, a container's CPU limit) installs the saved entry and traces nothing: the global state's guard,
    which holds that count, is not saved there (portable_guards)."""
    run = child_runner(tmp_path)
    cold = run(Q3TTS_PRECOMPILE="1", CHILD_DEVICE="cuda", CHILD_THREADS="1")
    warm = run(Q3TTS_PRECOMPILE="1", CHILD_DEVICE="cuda", CHILD_THREADS="3")
    assert cold["counts"]["traced"] == 1 and cold["counts"]["dynamo_hit"] == 0, cold
    assert warm["counts"]["traced"] == 0 and warm["counts"]["dynamo_hit"] == 1, warm
    assert warm["out"] == cold["out"]
