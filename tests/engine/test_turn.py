"""q3tts.engine.turn: a step's host work before an event loop's Python; the loop runs while the engine waits for the
device."""

import threading
import time

import pytest
import torch

from q3tts.engine.turn import HostTurn, device_wait


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_check_in_returns_at_once_while_no_step_holds_the_turn():
    for enabled in (True, False):
        turn = HostTurn(enabled)
        t0 = time.perf_counter()
        for _ in range(1000):
            turn.wait()
        assert time.perf_counter() - t0 < 0.1


def test_a_check_in_waits_for_the_steps_device_wait():
    """The consumer's check-in returns once the engine's thread waits for the device, not before."""
    turn, events = HostTurn(True, max_wait_s=5.0), []
    held, done = threading.Event(), threading.Event()

    def engine():
        with turn.hold():
            held.set()
            time.sleep(0.05)  # host work
            events.append("device wait")
            with device_wait():
                done.wait(5)
            events.append("back")

    t = in_thread(engine)
    held.wait(5)
    turn.wait()
    events.append("checked in")
    done.set()
    t.join(5)
    assert events == ["device wait", "checked in", "back"]


def check_in_beside_a_step(turn: HostTurn, step_s: float) -> float:
    """Seconds a check-in takes while another thread is in a step of step_s s of host work (no device wait)."""
    inside = threading.Event()

    def engine():
        with turn.hold():
            inside.set()
            time.sleep(step_s)

    t = in_thread(engine)
    inside.wait(5)
    t0 = time.perf_counter()
    turn.wait()
    took = time.perf_counter() - t0
    t.join(5)
    return took


def test_a_disabled_turn_is_never_held():
    assert check_in_beside_a_step(HostTurn(False), 0.5) < 0.1  # not the step's 0.5 s


def test_a_check_in_waits_at_most_max_wait():
    assert 0.04 < check_in_beside_a_step(HostTurn(True, max_wait_s=0.05), 1.0) < 0.5


def test_device_wait_outside_a_step_does_nothing():
    with device_wait():
        pass
    turn = HostTurn(True)
    with turn.hold():
        with device_wait():
            assert not turn._lock.locked()  # the consumers' turn meanwhile
        assert turn._lock.locked()
    assert not turn._lock.locked()


def step_under_busy_loop(enabled: bool, launches: int = 300, busy_s: float = 0.2) -> float:
    """ms of a step of `launches` torch calls (each lets the GIL go) while another thread runs Python for busy_s,
    checking in every few microseconds."""
    turn, x = HostTurn(enabled), torch.zeros(8)
    start, took = threading.Event(), []

    def engine():
        start.wait(5)
        with turn.hold():
            t0 = time.perf_counter()
            for _ in range(launches):
                x.add_(1)
            took.append(time.perf_counter() - t0)

    t = in_thread(engine)
    end = time.perf_counter() + busy_s
    start.set()
    while time.perf_counter() < end and not took:
        s = 0
        for i in range(200):  # Python that lets no GIL go
            s += i
        turn.wait()
    t.join(10)
    return took[0] * 1000


def test_a_busy_event_loop_does_not_convoy_the_steps_launches():
    """Without the turn, each launch of the step gives the GIL to the busy thread, which keeps it until the
    interpreter forces a switch: the step drags on while the other thread runs. With it the step's launches run
    as if alone."""
    torch.set_num_threads(1)
    free = min(step_under_busy_loop(False) for _ in range(3))
    if free < 20:
        pytest.skip(f"this machine hands the GIL back at once ({free:.1f} ms for the step beside a busy thread): no "
                    "convoy to prevent")
    turn = min(step_under_busy_loop(True) for _ in range(3))
    assert turn < free / 4, (turn, free)
