"""hostcopy.to_device: many host tensors of any dtype and shape staged in one buffer give back their own values."""

import torch

from q3tts.hostcopy import to_device


def test_staged_tensors_come_back_with_their_values_dtypes_and_shapes():
    host = [torch.arange(5), torch.tensor([0.1, -2.5, 3e-8], dtype=torch.float32), torch.tensor([True, False, True]),
            torch.randn(3, 4).to(torch.bfloat16), torch.zeros(0, dtype=torch.long), torch.tensor([7], dtype=torch.int32),
            torch.randn(2, 3, dtype=torch.float64), torch.arange(6).view(2, 3).t(), torch.tensor(9).expand(4)]
    out = to_device(host, torch.device("cpu"), pack=True)
    assert len(out) == len(host)
    for h, o in zip(host, out):
        assert o.dtype == h.dtype and o.shape == h.shape and torch.equal(o, h)
    base = out[0].untyped_storage().data_ptr()  # all views of the one staged buffer
    assert all(o.untyped_storage().data_ptr() == base for o in out)
    assert to_device(host[:2], torch.device("cpu"))[0] is host[0]  # unstaged on the CPU: the tensors themselves


def test_fill_sections_are_written_in_place_staged_or_not():
    from q3tts.hostcopy import Fill
    table = torch.randn(10, 3).to(torch.bfloat16)
    ids = torch.tensor([4, 0, 4, 9])
    gather = Fill((4, 3), torch.bfloat16, lambda out: torch.index_select(table, 0, ids, out=out))
    for pack in (True, False):
        a, rows, b = to_device([torch.arange(3), gather, torch.tensor([True])], torch.device("cpu"), pack=pack)
        assert torch.equal(rows, table[ids]) and rows.dtype == torch.bfloat16
        assert torch.equal(a, torch.arange(3)) and bool(b)


def test_every_staged_section_is_aligned_as_a_fresh_allocation():
    from q3tts.hostcopy import ALIGN
    host = [torch.arange(3), torch.tensor([True]), torch.randn(5).to(torch.bfloat16), torch.zeros(0), torch.arange(7)]
    out = to_device(host, torch.device("cpu"), pack=True)
    base = out[0].data_ptr()
    assert ALIGN % 16 == 0 and all((o.data_ptr() - base) % ALIGN == 0 for o in out)
