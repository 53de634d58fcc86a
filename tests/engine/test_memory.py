"""Memory sizing arithmetic (q3tts.engine.memory): pure functions of byte counts, checked on CPU."""

import json
from pathlib import Path

import pytest

from q3tts.config import parse_model_config
from q3tts.engine import memory as M

REFERENCE = Path(__file__).resolve().parents[2] / "q3tts" / "reference"


def talker(model: str):
    return parse_model_config(json.loads((REFERENCE / f"{model}.config.json").read_text())).talker


def test_slot_bytes_of_the_real_models():
    # 28 layers x k/v x 8 KV heads x 128 x bf16 = 112 KiB of KV per position, plus the trailing text embedding
    for model, hidden in (("0.6B-CustomVoice", 1024), ("1.7B-CustomVoice", 2048)):
        sb = M.slot_bytes(talker(model), elem=2, vocoder_state=0)
        assert sb.per_position == 112 * 1024 + hidden * 2
        assert 0 < sb.fixed < 4 * M.MIB  # code-predictor KV (5 x 2 x 8 x 16 x 128 x 2 = 320 KiB) + history
    # the figure: 32 slots x 4096 positions of 0.6B = ~14.7 GB of KV (+ 268 MB trailing text)
    sb = M.slot_bytes(talker("0.6B-CustomVoice"))
    assert 32 * 4096 * 112 * 1024 == pytest.approx(15.03e9, rel=1e-3)
    assert 32 * sb(4096) < 15.5e9


def flat(per_position=1000, fixed=0, reserve=0):
    return M.SlotBytes(per_position, fixed), (lambda s, n: reserve)


def test_plan_keeps_4096_positions_and_fits_the_slots():
    per, res = flat(1000, 0, 10_000)
    p = M.plan(10_000 + 5 * 4096 * 1000 + 999, per, res)
    assert (p.max_slots, p.max_seq_len) == (5, 4096)
    assert p.state + p.workspace <= p.room


def test_plan_caps_the_slots_it_chooses_but_not_the_given_ones():
    per, res = flat()
    big = 10**15
    assert M.plan(big, per, res).max_slots == M.DEFAULT_MAX_SLOTS
    assert M.plan(big, per, res, cap_slots=200).max_slots == 200
    assert M.plan(big, per, res, max_slots=500).max_slots == 500


def test_plan_halves_positions_only_when_one_slot_does_not_fit():
    per, res = flat(1000)
    p = M.plan(1500 * 1000, per, res)  # one slot of 1024 positions fits, not of 2048
    assert (p.max_slots, p.max_seq_len) == (1, 1024)
    p = M.plan(2100 * 1000, per, res, max_slots=2)  # slots given: positions shrink to fit them
    assert (p.max_slots, p.max_seq_len) == (2, 1024)
    p = M.plan(10**9, per, res, max_seq_len=300)  # positions given: slots fill the room
    assert (p.max_slots, p.max_seq_len) == (32, 300)


def test_plan_reserve_may_grow_with_the_slots():
    per = M.SlotBytes(1, 0)
    p = M.plan(4096 * 10 + 1000 * 10, per, lambda s, n: 1000 * s, cap_slots=100)
    assert p.max_slots == 10


def test_plan_error_names_the_budget():
    per, res = flat(1000, 0, 10**6)
    with pytest.raises(ValueError, match=r"1 slot\(s\) x 256 positions need .* GiB.*budget.*--gpu-memory"):
        M.plan(10**6, per, res)
    with pytest.raises(ValueError, match="4 slot"):
        M.plan(10**6 + 3 * 256 * 1000, per, res, max_slots=4, max_seq_len=256)
    with pytest.raises(ValueError):
        M.plan(-5, per, res)  # the weights alone exceed the budget


def test_real_model_budgets():
    """0.6B: one stream fits 3 GB (weights ~2.04 GB, bf16); no flags on a 16 GB GPU start with >= 16 slots x 4096."""
    cfg = talker("0.6B-CustomVoice")
    per = M.slot_bytes(cfg)
    weights = int(2.04e9)

    def fit(budget, **kw):
        return M.plan(budget - weights, per, lambda s, n: M.workspace(cfg, s, n), **kw)

    one = fit(int(3e9), max_slots=1)
    assert one.max_seq_len >= 512  # > 30 s of audio after a prompt
    p16 = fit(M.budget_bytes(16 * 10**9))
    assert p16.max_seq_len == 4096 and p16.max_slots >= 16
    p80 = fit(M.budget_bytes(80 * 10**9), max_seq_len=512, cap_slots=10**4)  # 20 s streams on an H100
    assert p80.max_slots > 500


def test_workspace_is_bounded_by_caps_not_slots():
    cfg = talker("0.6B-CustomVoice")
    assert M.vocoder_workspace(1, 16, 64) < M.vocoder_workspace(4, 16, 64) == M.vocoder_workspace(1000, 16, 64)
    assert M.prefill_workspace(cfg, 4096, 8192, 1000) == M.prefill_workspace(cfg, 4096, 8192, 2)
    assert M.prefill_workspace(cfg, 512, 8192, 1) < M.prefill_workspace(cfg, 512, 8192, 16)


def test_budget_bytes():
    assert M.budget_bytes(80 * 10**9) == 72 * 10**9
    assert M.budget_bytes(80 * 10**9, 0.5) == 40 * 10**9
    assert M.budget_bytes(80 * 10**9, 0.5, 3) == 3 * 10**9  # an absolute budget wins
    for bad in ((0.0, None), (1.5, None), (None, 0)):
        with pytest.raises(ValueError):
            M.budget_bytes(10**9, *bad)


def test_alloc_len_is_the_runners_rounding():
    assert [M.alloc_len(n) for n in (1, 64, 65, 300, 4096, 4097)] == [64, 64, 128, 512, 4096, 8192]


def test_cpu_engine_fits_host_memory(monkeypatch):
    """On a CPU the slots and positions not given fit a share of the host's available memory, at most CPU_MAX_SLOTS
    slots (the server's defaults once asked 30 GB of fp32 KV for 0.6B: 32 slots x 4096 positions x 224 KiB)."""
    from tests.golden.fixtures import tts
    ckpt = tts("cv06").ckpt
    assert ckpt.device.type == "cpu"
    avail = {"bytes": 64 * 10**9}
    monkeypatch.setattr(M, "_host_available", lambda: avail["bytes"])
    assert M.size_engine(ckpt, None, None) == (M.CPU_MAX_SLOTS, M.DEFAULT_SEQ_LEN, None)
    assert M.size_engine(ckpt, 3, 100) == (3, 100, None)
    assert M.size_engine(ckpt, 3, 100, block_size=64) == (3, 100, 3 * 128 // 64 + 1)  # paged: as much as contiguous
    # a host with room for ~2 slots of 4096 positions (after the workspace reserve) at the default share
    cfg, elem = ckpt.cfg.talker, ckpt.dtype.itemsize
    per = M.slot_bytes(cfg, elem, M.vocoder_state_bytes(ckpt.code2wav, ckpt.dtype))
    need2 = 2 * per(4096) + M.workspace(cfg, 2, 4096, elem)
    avail["bytes"] = int(need2 / M.HOST_MEMORY_FRACTION) + 1
    assert M.size_engine(ckpt, None, None) == (2, M.DEFAULT_SEQ_LEN, None)
    assert M.host_room() <= avail["bytes"] * M.HOST_MEMORY_FRACTION
    assert M.host_room(memory_gb=1000.0) == avail["bytes"]  # never more than is available
    with pytest.raises(ValueError, match="memory budget"):
        M.size_engine(ckpt, None, None, gpu_memory=0.01)


def test_offline_decode_groups_bound_rows_x_frames():
    from q3tts.api import _decode_groups
    assert _decode_groups([10, 20, 30]) == [[0, 1, 2]]
    assert _decode_groups([300] * 5) == [[0, 1, 2], [3, 4]]
    assert _decode_groups([5000]) == [[0]]  # one row always goes
    assert _decode_groups([]) == []


def test_server_memory_flags():
    from q3tts.server.settings import parse_args
    s = parse_args([], environ={})
    assert (s.max_concurrent, s.max_seq_len, s.memory_budget) == (None, None, {})
    s = parse_args(["--gpu-memory", "3"], environ={"Q3TTS_GPU_MEMORY_UTILIZATION": "0.5"})
    assert s.memory_budget == {"gpu_memory_utilization": 0.5, "gpu_memory": 3.0}
    assert parse_args(["--kv-block-size", "64"], environ={}).memory_budget == {"kv_block_size": 64}
    for bad in (["--gpu-memory-utilization", "1.5"], ["--gpu-memory", "0"], ["--max-concurrent", "0"],
                ["--kv-block-size", "48"], ["--kv-block-size", "128"]):
        with pytest.raises(SystemExit):
            parse_args(bad, environ={})


def test_size_engine_on_a_simulated_cuda_device(monkeypatch):
    """The CUDA path of size_engine with the device's figures faked: a 16 GB GPU, then a 3 GB budget."""
    import torch

    from tests.golden.fixtures import tts
    real = tts("cv06").ckpt

    class Ckpt:
        cfg, code2wav, dtype = real.cfg, real.code2wav, torch.bfloat16
        device = torch.device("cuda")

    held = {"bytes": 2 * 10**9}  # the weights
    fraction = {"f": 1.0}
    total = 16 * 10**9
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (total - held["bytes"] - 5 * 10**8, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: held["bytes"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: held["bytes"])
    def get_fraction(d):  # as torch's: a device without an index is refused
        assert isinstance(d, int) or torch.device(d).index is not None, d
        return fraction["f"]
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", get_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    per = M.slot_bytes(real.cfg.talker).per_position  # the tiny model's: a few KiB per position
    slots, n, _ = M.size_engine(Ckpt, None, None)
    assert (slots, n) == (M.DEFAULT_MAX_SLOTS, M.DEFAULT_SEQ_LEN)  # tiny model: the cap binds
    assert M.size_engine(Ckpt, 7, None) == (7, M.DEFAULT_SEQ_LEN, None)
    # the budget: what is left after the weights, less the workspace reserve, holds ~k slots x 4096 positions
    ws = M.workspace(real.cfg.talker, 1, 4096)
    k = 3
    budget_gb = (held["bytes"] + ws + k * (per * 4096 + M.slot_bytes(real.cfg.talker).fixed + 4 * M.MIB)) / 1e9
    slots, n, _ = M.size_engine(Ckpt, None, None, gpu_memory=budget_gb)
    assert n == 4096 and 1 <= slots <= k
    with pytest.raises(ValueError, match="budget"):
        M.size_engine(Ckpt, None, None, gpu_memory=2.1)  # 0.1 GB after the weights: not even one slot
    # explicit sizes beyond the budget: a warning without a budget flag, an error with one
    fraction["f"] = 2.2e9 / total  # a process limited to 2.2 GB (torch.cuda.set_per_process_memory_fraction)
    assert M.size_engine(Ckpt, 4, 4096) == (4, 4096, None)
    with pytest.raises(ValueError):
        M.size_engine(Ckpt, 4, 4096, gpu_memory_utilization=0.9)


def test_paged_blocks():
    other = M.SlotBytes(10, 0)
    # room for 100 blocks of 64 positions x 1000 bytes beside 4 slots' other state
    assert M.paged_blocks(100 * 64 * 1000 + 4 * 10 * 4096, 4, 4096, 64, 1000, other) == 100
    assert M.paged_blocks(10**12, 4, 512, 64, 1000, other) == 4 * 512 // 64 + 1  # never more than contiguous
    assert M.paged_blocks(8 * 64 * 1000, 1, 512, 64, 1000, other) is None  # one full stream + scratch: 9 blocks
