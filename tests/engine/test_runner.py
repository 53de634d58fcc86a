"""The runner's admission of a wave of newcomers: a constant number of launches and copies, whatever the wave."""

import dataclasses

import torch

from q3tts.engine.engine import Engine
from tests.golden import fixtures as fx
from tests.models.test_talker import _row_by_row, _wave


def test_a_wave_is_one_text_projection_and_one_copy(monkeypatch):
    """runner.admit of a wave of several prompts: one text projection call (before: one or two per prompt), one
    staged copy for the embedding and one for the slots' fields; every row's state as the per-prompt path writes."""
    from q3tts.models.talker import TextProjection, embed_prompt
    talker, ps = _wave("cv06")
    calls = {"projection": 0, "talker": 0, "slots": 0}
    orig = TextProjection.forward

    def counted(self, x):
        calls["projection"] += 1
        return orig(self, x)

    import q3tts.engine.slots as slots_mod
    import q3tts.models.talker as talker_mod
    for mod, key in ((talker_mod, "talker"), (slots_mod, "slots")):
        def staged(tensors, device, pack=None, _key=key, _orig=mod.to_device):
            calls[_key] += 1
            return _orig(tensors, device, pack=True)  # staged in one buffer as on CUDA (views of its copy)
        monkeypatch.setattr(mod, "to_device", staged)
    monkeypatch.setattr(TextProjection, "forward", counted)
    runner = Engine(fx.tts("cv06").ckpt, max_slots=len(ps) + 1, max_seq_len=256).runner
    with torch.inference_mode():
        runner.admit(1, ps)
    assert calls == {"projection": 1, "talker": 1, "slots": 1}
    _row_by_row(monkeypatch)  # the per-prompt path's rows (the BLAS may round a row by the rows beside it)
    with torch.inference_mode():
        runner.admit(1, ps)
        alone = [embed_prompt(talker, p.layout, p.speaker_embedding, p.ref_codes) for p in ps]
    s = runner.slots
    for i, (p, (pre, trail)) in enumerate(zip(ps, alone)):
        row, S = 1 + i, trail.shape[0]
        assert torch.equal(s.trailing[row, :S], trail) and int(s.trailing_len[row]) == S
        assert s.position_cpu[row] == int(s.position[row]) == pre.shape[0] and int(s.num_generated[row]) == 1
        assert int(s.seed[row]) == p.params.seed
        for f in dataclasses.fields(s.sampling):
            assert getattr(s.sampling, f.name)[row] == torch.tensor(getattr(p.params, f.name),
                                                                    dtype=getattr(s.sampling, f.name).dtype), f.name
