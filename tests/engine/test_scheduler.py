"""The scheduler is pure Python: admission, slot reuse, queue bound, abort, prefill budget."""

from types import SimpleNamespace

import pytest

from q3tts.engine.request import EngineRequest, RequestStatus
from q3tts.engine.scheduler import QueueFullError, Scheduler


def req(i, num_prompt_tokens=10):
    return EngineRequest(request_id=f"r{i}", prepared=SimpleNamespace(layout=range(num_prompt_tokens), text=None))


def test_admits_up_to_free_slots_and_reuses_freed_slots():
    s = Scheduler(max_slots=2, max_queue=10, max_prefills_per_step=4)
    rs = [req(i) for i in range(4)]
    for r in rs:
        s.add(r)
    out = s.schedule()
    assert [r.request_id for r in out.prefill] == ["r0", "r1"] and out.decode == []
    assert {r.slot for r in out.prefill} == {0, 1} and s.queue_depth == 2
    s.finish(rs[0], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()  # r1 moves into the hole (running rows stay [0, B)), r2 takes the freed row
    assert out.moves == [(1, 0)] and rs[1].slot == 0
    assert [r.request_id for r in out.prefill] == ["r2"] and rs[2].slot == 1
    assert [r.request_id for r in out.decode] == ["r1"] and out.rows == [rs[1], rs[2]]


def test_queue_bound_and_abort_of_waiting_request():
    s = Scheduler(max_slots=1, max_queue=2)
    a, b, c = req(0), req(1), req(2)
    s.add(a)
    s.add(b)
    with pytest.raises(QueueFullError, match="max_queue 2"):
        s.add(c)
    s.finish(s.find("r1"), RequestStatus.FINISHED_ABORTED)
    assert s.queue_depth == 1 and b.status.reason == "abort"


def test_prefills_per_step_bounded():
    s = Scheduler(max_slots=8, max_prefills_per_step=3)
    for i in range(8):
        s.add(req(i))
    assert len(s.schedule().prefill) == 3 and len(s.schedule().prefill) == 3


def test_defaults_admit_a_burst_in_one_step():
    s = Scheduler(max_slots=32)
    for i in range(20):
        s.add(req(i))
    out = s.schedule()
    assert len(out.prefill) == 16 and [r.slot for r in out.prefill] == list(range(16))


def test_prefill_token_budget_bounds_the_padded_batch():
    s = Scheduler(max_slots=8, max_prefill_tokens=100)
    for i, n in enumerate([20, 30, 10, 40, 500, 5]):
        s.add(req(i, n))
    # 3 x 30 = 90 fits; a fourth would pad to 4 x 40 = 160
    assert [r.request_id for r in s.schedule().prefill] == ["r0", "r1", "r2"]
    # 40 alone; 2 x 500 is over: first come, first served, r5 does not jump the queue
    assert [r.request_id for r in s.schedule().prefill] == ["r3"]
    assert [r.request_id for r in s.schedule().prefill] == ["r4"]  # over the budget alone: still admitted
    assert [r.request_id for r in s.schedule().prefill] == ["r5"]
