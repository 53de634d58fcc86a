"""Checkpoint loading: missing files, keys and shapes are errors that name them."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from q3tts import TTS
from tests.golden import fixtures as fx


def _copy(tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(fx.checkpoint("cv06"), d)
    return d


def test_missing_files_are_named(tmp_path):
    d = _copy(tmp_path)
    (d / "merges.txt").unlink()
    (d / "speech_tokenizer" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="merges.txt.*speech_tokenizer/model.safetensors"):
        TTS.from_pretrained(d, device="cpu")


def test_not_a_directory_and_no_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        TTS.from_pretrained(tmp_path / "nope", device="cpu")
    with pytest.raises(FileNotFoundError, match="could not find model 'nobody/no-such-model'"):
        TTS.from_pretrained("nobody/no-such-model", device="cpu")


def test_missing_unexpected_and_misshaped_keys_are_named(tmp_path):
    d = _copy(tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    del sd["talker.codec_head.weight"]
    sd["talker.extra.weight"] = torch.zeros(2)
    sd["talker.model.norm.weight"] = torch.zeros(7)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        TTS.from_pretrained(d, device="cpu")
    msg = str(e.value)
    assert "missing keys: codec_head.weight" in msg and "unexpected keys: extra.weight" in msg
    assert "model.norm.weight checkpoint (7,)" in msg


def test_sharded_checkpoint_loads(tmp_path):
    d = _copy(tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[: len(keys) // 2]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in keys[len(keys) // 2:]}, str(d / "model-00002-of-00002.safetensors"))
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: f"model-0000{1 if i < len(keys) // 2 else 2}-of-00002.safetensors" for i, k in enumerate(keys)}}))
    tts = TTS.from_pretrained(d, device="cpu")
    assert tts.cfg.tts_model_type == "custom_voice"


def test_unsupported_model_type(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tokenizer_type"] = "qwen3_tts_tokenizer_25hz"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="only the 12 Hz"):
        TTS.from_pretrained(d, device="cpu")


@pytest.mark.gpu
def test_text_embedding_stays_in_host_memory_on_cuda():
    """On a GPU the text table is looked up in host memory; the projected rows equal a lookup on the device."""
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cuda", dtype=torch.float32)
    talker = tts.ckpt.talker
    table = talker.model.text_embedding.weight
    assert table.device.type == "cpu" and talker.codec_head.weight.device.type == "cuda"
    ids = torch.tensor([[0, 7, table.shape[0] - 1]], device="cuda")
    with torch.inference_mode():
        got = talker.embed_text(ids)
        want = talker.text_projection(table.cuda()[ids])
    assert got.device.type == "cuda" and torch.equal(got, want)


def test_no_weight_stays_mapped_to_the_checkpoint_file():
    """NOTE(no-mmap): safetensors' tensors map the file; every loaded weight is a copy of its own (the speech tokenizer
    is fp32 like a CPU model, so a tensor taken as it is would have stayed in the mapping)."""
    import os
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs Linux's /proc/self/maps")
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cpu")
    spans = []
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(".safetensors"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            spans.append((lo, hi))
    params = [*tts.ckpt.talker.parameters(), *tts.ckpt.code2wav.parameters()]
    assert params and all(not lo <= p.data_ptr() < hi for p in params for lo, hi in spans)


def test_assigned_tensors_must_have_the_modules_dtypes():
    from q3tts.weights import cast_tensors, load_module
    with torch.device("meta"):
        m = torch.nn.Linear(3, 2)
    t = cast_tensors({"weight": torch.ones(2, 3, dtype=torch.int32), "bias": torch.zeros(2)}, torch.device("cpu"),
                     torch.float32)
    with pytest.raises(ValueError, match="weight checkpoint torch.int32 vs model torch.float32"):
        load_module(m, t, "x.safetensors", assign=True)
    t["weight"] = t["weight"].float()
    load_module(m, t, "x.safetensors", assign=True)
    assert m.weight.device.type == "cpu" and torch.equal(m.weight, torch.ones(2, 3))
