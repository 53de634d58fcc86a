"""bench.load.gil_burst: a trial's marks come in the order they happen."""

from bench.load.gil_burst import trial


def test_a_trial_marks_wake_turn_and_step_in_order():
    for turn_on in (False, True):
        r = trial("asyncio", turn_on, requests=4, work_us=100, ops=10)
        assert 0 <= r["woke"] <= r["held"] <= r["done"] and r["burst"] >= 0
