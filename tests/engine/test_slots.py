"""Per-slot state declared once: a write lands in one row, a move carries every moving field (and the host mirrors),
a reset gives every field its declared initial value."""

import dataclasses

import torch

from q3tts.engine.slots import Slots
from q3tts.sampling import SamplingParams


def test_write_move_reset():
    s = Slots(3, D=4, V=8, max_len=6, device=torch.device("cpu"), dtype=torch.float32, table_width=2)
    fresh = [t.clone() for t, _, _ in s._fields]
    params = SamplingParams(temperature=0.5, top_k=7, top_p=0.9, do_sample=True, subtalker_top_k=100, seed=11)
    s.admit(2, [params], [4], torch.ones(3, 4), [3])
    assert s.seed[2] == 11 and s.trailing_len[2] == 3 and torch.equal(s.trailing[2, :3], torch.ones(3, 4))
    assert s.position[2] == 4 and s.position_cpu[2] == 4 and s.num_generated[2] == 0
    for f in dataclasses.fields(s.sampling):
        assert getattr(s.sampling, f.name)[2] == getattr(params, f.name), f.name
    assert s.topk_ok_cpu[2] is False  # subtalker_top_k 100 does not fit the capped sampler
    s.position[2], s.position_cpu[2], s.block_table[2] = 5, 5, torch.tensor([3, 4])
    s.active[2] = False
    before = [(t, t[2].clone(), t[0].clone(), moves) for t, _, moves in s._fields]
    s.move(2, 0)
    for t, src, dst, moves in before:
        assert torch.equal(t[0], src if moves else dst)
    assert s.active[0] and s.position_cpu[0] == 5 and s.topk_ok_cpu[0] is False
    assert s.block_table[2].tolist() == [0, 0]  # the vacated row points at the scratch block
    s.set_blocks([(1, [5]), (2, [6, 7])])
    assert s.block_table.tolist() == [[3, 4], [5, 0], [6, 7]]  # a short row's rest points at the scratch block
    s.reset()
    assert all(torch.equal(t, f) for (t, _, _), f in zip(s._fields, fresh))
    assert s.position_cpu == [0, 0, 0] and s.topk_ok_cpu == [True] * 3 and s.active_cpu == [True] * 3
    assert s.sampling.temperature.eq(1).all() and s.sampling.top_k.eq(0).all()
