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


def test_paged_blocks_follow_positions_and_come_back():
    """Blocks of 4 positions: a prompt of 10 takes 3 (positions 0..10), admission keeps a spare per running row,
    a row gets its next block when its next frame crosses into it, waits without one, and finishing frees them."""
    s = Scheduler(max_slots=3, num_blocks=1 + 8, block_size=4)  # 8 blocks + scratch
    a, b, c = req(0), req(1), req(2)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    # a: 3 blocks (8 free >= 3 + 0), b: 3 (5 free >= 3 + 1), c would need 3 + 2 spare > 2 free: waits
    assert out.prefill == [a, b] and out.blocks == [a, b] and len(s.free_blocks) == 2
    assert 0 not in a.blocks + b.blocks and len(set(a.blocks + b.blocks)) == 6
    a.frames += [None] * 2  # next position 12: a needs its 4th block
    out = s.schedule()
    assert out.active == [True, True] and out.blocks == [a] and len(a.blocks) == 4 and len(s.free_blocks) == 1
    a.frames += [None] * 4
    b.frames += [None] * 2  # both cross again: a (row 0) takes the last block, b waits
    out = s.schedule()
    assert out.active == [True, False] and len(a.blocks) == 5 and len(b.blocks) == 3 and s.free_blocks == []
    s.finish(b, RequestStatus.FINISHED_STOPPED)
    assert len(s.free_blocks) == 3 and b.blocks == []
    out = s.schedule()  # c needs 3 blocks + a spare for a: 4 > 3, it waits
    assert out.rows == [a] and out.prefill == [] and len(s.free_blocks) == 3
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert out.prefill == [c] and len(c.blocks) == 3 and len(s.free_blocks) == 5


def test_paged_a_pool_where_nothing_can_run_fails_the_newest():
    s = Scheduler(max_slots=2, num_blocks=1 + 7, block_size=4)
    a, b = req(0), req(1)
    s.add(a)
    s.add(b)
    s.schedule()  # 3 + 3 blocks, 1 free
    a.frames += [None] * 2
    b.frames += [None] * 2
    out = s.schedule()  # a takes the last one, b waits
    assert out.active == [True, False]
    a.frames += [None] * 4
    out = s.schedule()  # both wait: b (the newest) fails, its blocks come back
    assert b.status == RequestStatus.FINISHED_ERROR and "KV-cache" in b.error and len(s.free_blocks) == 3
    assert out.active == [False, False]
    out = s.schedule()
    assert out.rows == [a] and out.active == [True] and len(a.blocks) == 5
