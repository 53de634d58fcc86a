"""The scheduler is pure Python: admission, slot reuse, queue bound, abort."""

import pytest

from q3tts.engine.request import EngineRequest, RequestStatus
from q3tts.engine.scheduler import QueueFullError, Scheduler


def req(i):
    return EngineRequest(request_id=f"r{i}", prepared=None)


def test_admits_up_to_free_slots_and_reuses_freed_slots():
    s = Scheduler(max_slots=2, max_queue=10, max_prefills_per_step=4)
    rs = [req(i) for i in range(4)]
    for r in rs:
        s.add(r)
    out = s.schedule()
    assert [r.request_id for r in out.prefill] == ["r0", "r1"] and out.decode == []
    assert {r.slot for r in out.prefill} == {0, 1} and s.queue_depth == 2
    s.finish(rs[0], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert [r.request_id for r in out.prefill] == ["r2"] and rs[2].slot == rs[0].slot
    assert [r.request_id for r in out.decode] == ["r1"]


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
