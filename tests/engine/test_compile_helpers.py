"""Compile helpers (q3tts.engine.compile_helpers): which warm-ups they take, when there are any, and on a GPU that a
cold start beside them computes what the engine computes without them."""

import os
import re
import types

import pytest
import torch

from q3tts.engine import compile_helpers
from q3tts.engine.compile_helpers import ENTRY, KERNELS, VOCODER, halves, helper_len, plan, shape_class, wanted
from tests.golden import fixtures as fx

from .fresh_process import run_child

# a 32-slot engine's warm-ups, in capture_runner's order (graphs.warm_ups)
NAMES = ["frame 1 full", "frame 1 capped", "frame 2 full", "frame 2 capped", "frame 4 full", "frame 4 capped",
         "frame 32 full", "frame 32 capped", "prefill 16", "prefill 32", "wave 16x32", "wave 32x64", "batch 2",
         "long 257"]


def test_each_shape_class_once_and_the_engines_first_left_to_it():
    assert [shape_class(n) for n in ("frame 1 capped", "frame 2 full", "frame 32 full", "frame 16 capped",
                                     "frame 32 capped", "prefill 256", "wave 32x64", "batch 2", "long 257")] == \
        ["frame 1 capped", "frame 2+ full", "frame 2+ full", "frame 2+ capped", "frame 17+ capped", "prefill", "wave",
         "batch 2", "long"]
    # a frame's two halves apart, dealt in order, the second round back from the last helper (a snake)
    f1c, f2f, f2c, f32c = (halves(n) for n in ("frame 1 capped", "frame 2 full", "frame 2 capped", "frame 32 capped"))
    assert f2c == ["frame 2 capped:codes", "frame 2 capped:talker"] and halves("prefill 16") == ["prefill 16"]
    five = plan(NAMES, 5)
    assert five == [[f1c[0], "wave 16x32", "batch 2"], [f1c[1], "prefill 16", "long 257"], [f2f[0], f32c[1]],
                    [f2f[1], f32c[0]], f2c]
    dealt = sorted(n for units in plan(NAMES, 2) for n in units)
    assert dealt == sorted(n for units in five for n in units)  # the same warm-ups, whatever the number of helpers
    assert plan(NAMES, 20) == [[n] for n in (*f1c, *f2f, *f2c, *f32c, "prefill 16", "wave 16x32", "batch 2",
                                             "long 257")]
    assert plan(NAMES[:1], 3) == []  # nothing but the engine's own first warm-up: no helper
    # Helpers deals the vocoder's warm-ups after the runner's
    assert plan([*NAMES, VOCODER], 5)[2] == [f2f[0], f32c[1], VOCODER]


def test_capped_frames_past_the_top_k_kernels_rows_are_a_class_of_their_own_except_batch_invariant(monkeypatch):
    """Capped frames of up to TOP_KERNEL_MAX_ROWS rows sample with the top-k kernel, more rows with torch's ops
    (kernels.sample_top_applies), which compile variants of their own; in batch-invariant mode every batch takes the
    kernel."""
    from q3tts import invariant
    from q3tts.kernels import TOP_KERNEL_MAX_ROWS
    edge = f"frame {TOP_KERNEL_MAX_ROWS} capped"
    past = f"frame {TOP_KERNEL_MAX_ROWS + 1} capped"
    assert shape_class(edge) != shape_class(past) == f"frame {TOP_KERNEL_MAX_ROWS + 1}+ capped"
    monkeypatch.setattr(invariant, "ENABLED", True)
    assert shape_class(edge) == shape_class(past) == "frame 2+ capped"


def test_a_helpers_runner_has_the_positions_of_every_warm_up_and_no_more():
    """The engine's geometry but the fewest positions (a power of two) that still hold each warm-up's prompt: the
    prefill graphs' and waves' lengths and the long prompt one past the last prefill graph's (graphs.warm_ups)."""
    engine = types.SimpleNamespace(max_len=4096, prefill_graph_lens=[16, 32, 64, 128, 256], wave_lens=[32, 64, 128])
    assert helper_len(engine) == 512  # the long prompt: 257 tokens, and a position past it
    assert helper_len(types.SimpleNamespace(**vars(engine) | {"max_len": 256})) == 256  # never more than the engine's
    assert helper_len(types.SimpleNamespace(max_len=4096, prefill_graph_lens=[], wave_lens=[])) == 64


def test_the_kernels_unit_runs_one_row_frames_of_both_samplers_uncompiled():
    """helper_process.eager_frames (KERNELS): the one-row frames run with every compiled function uncompiled (their
    purpose is q3tts's own kernels, compiled by Triton, not Inductor's graphs), and the runner's state moves on as a
    frame's does."""
    from q3tts.engine.compile import compile_counts
    from q3tts.engine.helper_process import eager_frames
    from q3tts.engine.runner import ModelRunner
    from q3tts.models.talker import Talker
    cfg = fx.tts("cv06").ckpt.talker.cfg
    torch.manual_seed(0)
    # a talker of its own: compile=True compiles its layers in place (the shared fixture's stay uncompiled)
    runner = ModelRunner(Talker(cfg).eval(), torch.zeros(cfg.hidden_size), max_slots=2, max_len=64,
                         use_cuda_graphs=False, compile=True)
    before = compile_counts()
    calls = []
    talker = runner._frame_talker
    runner._frame_talker = lambda *key: (calls.append(key), talker(*key))
    with torch.inference_mode():
        eager_frames(runner)
    assert calls == [(1, 64, False), (1, 64, True)]
    assert compile_counts()["traced"] == before["traced"]  # nothing traced, so nothing compiled
    assert runner.slots.position[0].item() == 1  # the last frame advanced row 0 from position 0


@pytest.mark.parametrize("setting, runner", [
    (None, {}),  # off unless asked for (a library process)
    ("0", {}),
    ("none", {}),
    ("auto", {"compiled": False}),
    ("auto", {"use_graphs": False}),
    ("2", {"block_table": torch.zeros(1)}),  # paged: its warm-ups are per span
])
def test_no_helpers_where_they_cannot_help(monkeypatch, setting, runner):
    if setting is None:
        monkeypatch.delenv(compile_helpers.ENV, raising=False)
    else:
        monkeypatch.setenv(compile_helpers.ENV, setting)
    fake = types.SimpleNamespace(**({"compiled": True, "use_graphs": True, "block_table": None} | runner))
    assert wanted(fake) == 0


def test_the_helpers_process_is_a_module_with_its_main():
    import importlib
    assert callable(importlib.import_module(ENTRY).main)


def test_a_bad_setting_names_the_accepted_values(monkeypatch):
    monkeypatch.setenv(compile_helpers.ENV, "many")
    fake = types.SimpleNamespace(compiled=True, use_graphs=True, block_table=None)
    with pytest.raises(ValueError, match="expected auto, 0 \\(off\\) or a number"):
        wanted(fake)


def test_a_waiting_helper_ends_without_work():
    """A helper started at launch waits for its work on stdin; the end of stdin ends it, with nothing done."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", ENTRY], input="", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout == "", out.stderr[-2000:]


def test_prestart_only_for_a_cold_start_on_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_helpers.ENV, "auto")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)  # room for 3 helpers
    monkeypatch.delenv("Q3TTS_COMPILE", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert compile_helpers.prestart("cpu", str(tmp_path)) == 0
    warm = tmp_path / "warm"
    (warm / "dynamo").mkdir(parents=True)
    (warm / "dynamo" / "entry").write_text("")  # a Dynamo entry in the cache: a warm start
    assert compile_helpers.prestart("cuda", str(warm)) == 0
    monkeypatch.setenv("Q3TTS_COMPILE", "0")
    assert compile_helpers.prestart("cuda", str(tmp_path / "cold")) == 0
    monkeypatch.setenv("Q3TTS_COMPILE", "1")
    try:  # a cold cache on a GPU (as far as prestart can tell): three wait, until the engine dismisses them
        assert compile_helpers.prestart("cuda", str(tmp_path / "cold")) == 3
        procs = list(compile_helpers._waiting)
        assert all(p.poll() is None for p in procs)
        if os.path.exists(f"/proc/{procs[0].pid}/environ"):  # (Linux) each with its share of the 8 cores' pool
            env = open(f"/proc/{procs[0].pid}/environ", "rb").read().split(b"\0")
            assert b"TORCHINDUCTOR_COMPILE_THREADS=2" in env and compile_helpers.ENV.encode() + b"=0" in env
    finally:
        compile_helpers.dismiss()
    assert compile_helpers._waiting == [] and all(p.poll() is not None for p in procs)


def test_helpers_share_the_cores_compile_pool_unless_the_user_sized_it(monkeypatch):
    """Inductor sizes each process's compile pool by all the cores: a helper gets the cores over the helpers asked for
    and the engine (at least 1); a pool size the user set stays."""
    monkeypatch.setenv(compile_helpers.ENV, "auto")
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)  # 5 helpers (MAX_HELPERS) and the engine
    assert compile_helpers.helper_env()["TORCHINDUCTOR_COMPILE_THREADS"] == "2"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)  # 1 helper
    assert compile_helpers.helper_env()["TORCHINDUCTOR_COMPILE_THREADS"] == "2"
    monkeypatch.setenv(compile_helpers.ENV, "3")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert compile_helpers.helper_env()["TORCHINDUCTOR_COMPILE_THREADS"] == "16"
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    assert compile_helpers.helper_env()["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert compile_helpers.helper_env()[compile_helpers.ENV] == "0"  # no helpers of their own


def started(stdout, reports, name):
    """A helper's 'start NAME' line on its stdout (a queue that Reports.follow reads), once the follower has read it."""
    import time
    stdout.put(f"start {name}\n")
    deadline = time.monotonic() + 30
    while name not in reports.spans and time.monotonic() < deadline:
        time.sleep(0.001)


def test_the_engine_waits_for_a_warm_up_a_helper_is_compiling_and_for_no_other():
    import queue
    import threading
    reports = compile_helpers.Reports()
    stdout = queue.Queue()  # a helper's stdout, line by line (None: it has ended)
    follower = threading.Thread(target=reports.follow, args=(iter(stdout.get, None),), daemon=True)
    follower.start()

    assert reports.wait_any(["frame 2 full"]) == 0.0  # no helper has started it: the engine runs it at once
    started(stdout, reports, "frame 2 full:talker")
    threading.Timer(0.3, stdout.put, args=("done frame 2 full:talker\n",)).start()
    assert 0.25 < reports.wait_any(["frame 2 full"]) < 10  # a half started: the engine waits until it is done
    assert reports.wait_any(["frame 2 full"]) == 0.0
    started(stdout, reports, "prefill 16")
    assert 0.15 < reports.wait_any(["prefill 16"], timeout=0.2) < 5  # a helper that hangs: the engine goes on
    stdout.put(None)  # the helper ends without finishing it (it failed): nothing more to wait for
    follower.join(10)
    assert reports.wait_any(["prefill 16"]) == 0.0 and reports.wait_any(["wave 16x32"]) == 0.0
    assert 0.15 < sum(reports.waits.values()) < 10
    # the log's account: each warm-up's span after the work was sent (unfinished: nan) and the engine's waits
    told = reports.describe()
    assert re.fullmatch(r"frame 2 full:talker [\d.]+-[\d.]+ s, prefill 16 [\d.]+-nan s after the work was sent; the "
                        r"engine waited for frame 2 full:talker 0\.\d s, prefill 16 0\.\d s", told), told


def test_the_engine_runs_what_it_can_while_a_helper_compiles_a_class_and_its_members_after_it():
    """Helpers.in_turn: a class whose first warm-up a helper is compiling waits, with its members; the engine first
    takes the classes a helper has compiled, then those no helper has, then those a helper has still to start (each
    group in order); with nothing else left it waits for a helper, whichever finishes first; a helper that ends
    without finishing leaves its warm-ups to the engine."""
    import math
    import queue
    import threading
    helpers = compile_helpers.Helpers(None, None, [])  # no processes: the reports are this test's
    reports = helpers.reports
    units = [(n, None) for n in ("frame 1 full", "frame 1 capped", "frame 2 full", "frame 4 full", "frame 2 capped",
                                 "prefill 16", "prefill 32", "wave 16x32", "batch 2")]
    f1c, f2f, f2c = (halves(n) for n in ("frame 1 capped", "frame 2 full", "frame 2 capped"))
    dealt = {"a": [*f1c, "wave 16x32", "batch 2"], "b": [*f2f, *f2c]}
    lines = {h: queue.Queue() for h in dealt}  # the two helpers' stdout
    for h, q in lines.items():
        reports.deal(dealt[h])
        threading.Thread(target=reports.follow, args=(iter(q.get, None), dealt[h]), daemon=True).start()

    started(lines["a"], reports, f1c[0])
    started(lines["b"], reports, f2f[0])
    lines["b"].put(f"done {f2f[0]}\n")
    started(lines["b"], reports, f2f[1])
    assert reports.state("frame 2 full") == "busy"  # a class is done when both its halves are
    lines["b"].put(f"done {f2f[1]}\n")
    started(lines["b"], reports, f2c[0])
    order = helpers.in_turn(units)
    assert reports.state("frame 2 full") == "done" and reports.state("wave 16x32") == "queued"
    assert reports.state("frame 1 capped") == "busy"  # one half busy, the other still to start
    # b's finished class with its member, then the classes no helper has, then a's warm-ups it has still to start
    assert [next(order)[0] for _ in range(7)] == ["frame 2 full", "frame 4 full", "frame 1 full", "prefill 16",
                                                  "prefill 32", "wave 16x32", "batch 2"]
    # only the classes the helpers are compiling are left: the engine waits for the first half to finish; b has the
    # other half of frame 2 capped still to start, so the engine takes the class
    threading.Timer(0.3, lines["b"].put, args=(f"done {f2c[0]}",)).start()
    assert next(order)[0] == "frame 2 capped"
    assert 0.25 < reports.waits[f2c[0]] < 10 and reports.state("frame 2 capped") == "queued"
    lines["a"].put(None)  # a ends (failed), frame 1 capped unfinished: the engine's now
    assert [n for n, _ in order] == ["frame 1 capped"]
    assert reports.state("frame 1 capped") == "none" and math.isnan(reports.spans[f1c[0]][1])
    assert reports.state("batch 2") == "none"  # dealt to a, never started, and a has ended


CHILD = """
import json, logging, sys, torch
from q3tts import TTS
from q3tts.engine.compile import compile_counts
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("q3tts.engine").addHandler(Keep())
logging.getLogger("q3tts.engine").setLevel(logging.INFO)
ckpt, cache = sys.argv[1:3]
from q3tts.engine import compile_helpers
prestarted = compile_helpers.prestart("cuda", cache)  # as `q3tts serve` does at launch
tts = TTS.from_pretrained(ckpt, device="cuda", dtype=torch.float32, compile=True, max_batch_size=4, max_seq_len=1024,
                          compile_cache=cache)
p = tts.prepare_custom_voice("Helpers compile beside the engine.", "vivian", "English", do_sample=False,
                             subtalker_dosample=False, max_new_tokens=41)
codes = tts.generate_codes(p)
print(json.dumps({"counts": compile_counts(), "codes": codes[0].tolist(), "prestarted": prestarted,
                  "helpers": [m for m in lines if m.startswith("compile helpers")]}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 4, reason="compile helpers need 4 cores or more")
def test_a_cold_start_with_helpers_computes_what_the_engine_computes(tmp_path):
    """A fresh process on an empty compile cache with two helpers started before the engine (as at a server's
    launch): the engine takes them, none fails (one may still be running when the engine is done, then it is
    stopped), the engine finds graphs they compiled though their runners have a fraction of its positions
    (helper_len: 512 of 1024), and the codes are those of an engine built here (the compile cache this process
    uses: graphs the helpers did not make)."""
    from q3tts import TTS
    from q3tts.engine.engine import Engine
    from tests.engine.steps import generate_codes
    ckpt = fx.checkpoint("cv06")
    out = run_child(CHILD, str(ckpt), str(tmp_path / "cache"), timeout=600, Q3TTS_PRECOMPILE="1",
                    Q3TTS_COMPILE_HELPERS="2", TORCHINDUCTOR_COMPILE_THREADS="4")
    started, finished = out["helpers"]
    assert out["prestarted"] == 2 and started.startswith("compile helpers: 2 processes"), out["helpers"]
    assert f"'{VOCODER}'" in started and f"[['{KERNELS}', " in started, out["helpers"]
    assert " 0 failed; the engine waited " in finished, out["helpers"]
    assert out["counts"]["dynamo_hit"] == 0, out["counts"]  # a cold start: nothing installed from the cache
    # the classes the helpers compiled, the engine traced and found in the cache (AOTAutograd entries)
    assert out["counts"]["aot_hit"] >= 2, (out["counts"], out["helpers"])
    tts = TTS.from_pretrained(ckpt, device="cuda", dtype=torch.float32)
    p = tts.prepare_custom_voice("Helpers compile beside the engine.", "vivian", "English", do_sample=False,
                                 subtalker_dosample=False, max_new_tokens=41)
    here = generate_codes(Engine(tts.ckpt, max_slots=4, max_seq_len=256), p)[0]
    assert here.shape == (40, 16) and here.tolist() == out["codes"]
