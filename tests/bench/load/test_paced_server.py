"""bench/load/paced_server.py's prefill table: the wave's wait by its size (exact at a given W, linear between, the
last two points' line past the last) and its command line (a malformed table or one beside --prefill-ms refused;
--alone-max only with a table)."""

import argparse

import numpy as np
import pytest

from bench.load.paced_server import main, parse_prefill_table, prefill_wait_s

MEASURED = "1:3.68,2:6.55,4:11.67,5:32.11,8:36.4,16:30.34,32:53.85,64:104.4"


def test_parse_sorts_by_wave_size():
    assert parse_prefill_table("4:11.67, 1:3.68,2:6.55") == [(1, 3.68), (2, 6.55), (4, 11.67)]


def test_wait_is_exact_at_given_sizes_and_linear_between():
    table = parse_prefill_table(MEASURED)
    for w, ms in table:
        assert prefill_wait_s(table, w) == pytest.approx(ms / 1000)
    assert prefill_wait_s(table, 3) == pytest.approx((6.55 + 11.67) / 2 / 1000)
    assert prefill_wait_s(table, 12) == pytest.approx((36.4 + 30.34) / 2 / 1000)  # falls: the table is not monotone
    assert prefill_wait_s(table, 48) == pytest.approx((53.85 + 104.4) / 2 / 1000)


def test_wait_extrapolates_the_last_two_points_and_starts_from_zero():
    table = parse_prefill_table(MEASURED)
    assert prefill_wait_s(table, 128) == pytest.approx((104.4 + 2 * (104.4 - 53.85)) / 1000)
    assert prefill_wait_s(table, 0) == 0.0
    sparse = parse_prefill_table("4:12,8:20")  # below the first given W: on the line from (0, 0)
    assert prefill_wait_s(sparse, 2) == pytest.approx(0.006) and prefill_wait_s(sparse, 10) == pytest.approx(0.024)
    assert prefill_wait_s(parse_prefill_table("8:40,16:8"), 64) == 0.0  # a falling line never waits below 0


@pytest.mark.parametrize("bad", ["", "1", "1:", "x:3", "0:3", "1:-2", "1:3,1:4", "1:nan", "2.5:3"])
def test_malformed_tables_are_refused_with_the_entry_named(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="W:ms pairs"):
        parse_prefill_table(bad)


@pytest.mark.parametrize("other", [["--prefill-ms", "5"], ["--prefill-ms-per-request", "0"]])
def test_table_beside_the_linear_model_is_an_argparse_error(other, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--prefill-table", "1:3"] + other)
    assert exc.value.code == 2 and "--prefill-table replaces --prefill-ms" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--alone-max", "4"], ["--prefill-table", "1:3", "--alone-max", "-1"]])
def test_alone_max_needs_a_table_and_a_count(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and "--alone-max" in capsys.readouterr().err


def test_the_paced_runner_tells_its_regimes():
    """Given alone_max (a table's stand-in for a CUDA runner's prefill graphs) the engine is told that; else the CPU
    runner's answer (no prefill graphs: 0)."""
    from bench.load.paced_server import PacedRunner

    class CPU:
        def prefill_alone_max(self, graphs=True):
            return 0

    assert PacedRunner(CPU(), 0.0, 0.0, alone_max=10).prefill_alone_max() == 10
    assert PacedRunner(CPU(), 0.0, 0.0).prefill_alone_max() == 0


def test_host_ms_is_spent_busy_on_the_stepping_thread():
    """--host-ms: each frame's part that holds the GIL is a busy loop on the engine's thread (its CPU time), before the
    GIL-free wait (a sleep: no CPU time)."""
    import time

    from bench.load.paced_server import PacedRunner

    class Runner:
        K = 2

    busy = PacedRunner(Runner(), 0.0, decode_s=0.01, host_s=0.02)
    t0, c0 = time.perf_counter(), time.thread_time()
    out = busy.decode_frame(3, [True] * 3)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert out.codes.shape == (3, 2) and wall >= 0.03
    assert cpu >= 0.007  # the 20 ms spin (on a busy machine the scheduler may take part of it); the sleep adds none
    idle = PacedRunner(Runner(), 0.0, decode_s=0.02)
    c0 = time.thread_time()
    idle.decode_frame(3, [True] * 3)
    assert time.thread_time() - c0 < 0.01


def test_prefill_host_share_holds_that_share_of_the_wait():
    """--prefill-host-share: that share of an admission's wait is a busy loop (the stepping thread's CPU time), the
    rest a sleep; a share outside 0-1 is refused."""
    import time

    from bench.load.paced_server import PacedRunner

    runner = PacedRunner(object(), 0.03, 0.0, prefill_host_share=0.5)
    t0, c0 = time.perf_counter(), time.thread_time()
    assert runner.prefill_batch(0, [None] * 2, [], []) == [1, 1]
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert wall >= 0.03 and 0.005 <= cpu < 0.03  # 15 ms busy (less where the scheduler takes part of it), 15 asleep
    asleep = PacedRunner(object(), 0.03, 0.0)
    c0 = time.thread_time()
    asleep.prefill_batch(0, [None] * 2, [], [])
    assert time.thread_time() - c0 < 0.005


def test_prefill_host_share_outside_0_1_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--prefill-host-share", "1.5"])
    assert exc.value.code == 2 and "--prefill-host-share" in capsys.readouterr().err


def test_host_ops_launch_that_many_torch_calls_per_frame_and_per_newcomer():
    """--host-ops N: N torch calls (each lets the GIL go, as a launch does) per frame, and per newcomer of a wave."""
    from bench.load import paced_server as ps

    class Runner:
        K = 2

    runner = ps.PacedRunner(Runner(), 0.0, 0.0, host_ops=5)
    before = float(ps._OP[0])
    runner.decode_frame(3, [True] * 3)
    assert float(ps._OP[0]) - before == 5
    runner.prefill_batch(0, [None] * 3, [], [None] * 3)
    assert float(ps._OP[0]) - before == 5 + 15


def test_the_paced_vocoder_waits_per_call_and_per_frame():
    """--vocode-ms-per-frame: a step's vocoding waits its base and a part per frame it decodes (here 3 + 5 x 4 ms);
    the audio is noise (not silence, which would cost nothing to encode or compress), each chunk its own slice."""
    import time

    from bench.load.paced_server import PacedVocoder

    voc = PacedVocoder(None, 0.003, 0.004)
    t0 = time.perf_counter()
    wavs = voc.decode([(0, [0] * 2), (1, [0] * 3)])
    assert time.perf_counter() - t0 >= 0.003 + 5 * 0.004
    assert [len(w) for w in wavs] == [2 * 1920, 3 * 1920]
    assert all(w.dtype == np.float32 and 0.2 < float(np.abs(w).mean()) < 0.3 for w in wavs)  # uniform +-0.5: mean 0.25
    assert not np.array_equal(wavs[0], wavs[1][: 2 * 1920])
    t0 = time.perf_counter()
    assert voc.decode([]) == [] and time.perf_counter() - t0 < 0.003  # nothing due: no wait
