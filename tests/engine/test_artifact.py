"""The compiled artifact (q3tts.engine.artifact): its file format, what it is tied to (a mismatch, a corrupt or a
foreign file: a warning and a cold start), the Triton cache's relocation, and a real start in a fresh process with
an empty compile cache that traces and compiles nothing that the artifact holds and decodes the same codes."""

import io
import json
import logging
import os
import tarfile

import pytest
import torch

from q3tts.engine import artifact
from q3tts.engine.artifact import (
    MAGIC,
    fingerprint,
    load_artifact,
    mismatches,
    read_artifact,
    save_artifact,
)
from q3tts.models.loaders import load_checkpoint

from .fresh_process import run_child


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from q3tts.randomckpt import make_tiny
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d)
    return load_checkpoint(d, device="cpu")


def test_round_trip_and_fingerprint(ckpt, tmp_path):
    f = tmp_path / "a.q3c"
    header = save_artifact(f, ckpt, {"max_slots": 2})
    got, sections = read_artifact(f)
    assert got == header and got["built"]["max_slots"] == 2
    assert got["fingerprint"] == fingerprint(ckpt)
    fp = got["fingerprint"]
    assert fp["torch"] == torch.__version__ and fp["device"] == "cpu" and fp["dtype"] == "float32"
    assert fp["talker"]["hidden_size"] == ckpt.cfg.talker.hidden_size and fp["quantization"] == "none"
    assert [k for k, _ in got["sections"]] == list(sections) and "torch" in sections
    assert not os.path.exists(f"{f}.tmp")


def test_a_failed_write_leaves_no_file_behind(ckpt, tmp_path, monkeypatch):
    f = tmp_path / "a.q3c"

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(artifact.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        save_artifact(f, ckpt)
    assert list(tmp_path.iterdir()) == []


def test_mismatch_names_the_fields(ckpt):
    here = fingerprint(ckpt)
    other = dict(here, torch="0.0.1", device_name="NVIDIA H100 80GB HBM3 sm_90")
    diff = mismatches(other, here)
    assert len(diff) == 2 and diff[0].startswith("device_name: built for 'NVIDIA H100") and "torch" in diff[1]
    assert mismatches(here, here) == []


def _write(path, header: dict, body: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(MAGIC + len(raw).to_bytes(8, "little") + raw + body)


def test_an_artifact_for_something_else_is_a_warning_and_a_cold_start(ckpt, tmp_path, caplog, monkeypatch):
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda b: loaded.append(b))
    f = tmp_path / "a.q3c"
    save_artifact(f, ckpt)
    header, sections = read_artifact(f)
    for field, value in (("dtype", "bfloat16"), ("quantization", "int8"), ("q3tts", "0.0.0"),
                         ("device_name", "NVIDIA A10G sm_86")):
        fp = dict(header["fingerprint"], **{field: value})
        _write(f, dict(header, fingerprint=fp), b"".join(sections.values()))
        caplog.clear()
        with caplog.at_level(logging.WARNING, "q3tts.engine"):
            assert load_artifact(f, ckpt) is None
        assert f"{field}: built for {value!r}" in caplog.text and "cold start" in caplog.text
    assert loaded == []  # nothing reached torch's caches
    _write(f, header, b"".join(sections.values()))
    assert load_artifact(f, ckpt) == header and len(loaded) == (1 if sections["torch"] else 0)


@pytest.mark.parametrize("content", [b"", b"not an artifact", MAGIC, MAGIC + (5).to_bytes(8, "little") + b"{oops",
                                     MAGIC + (1 << 40).to_bytes(8, "little")])
def test_corrupt_files_are_a_warning_and_a_cold_start(ckpt, tmp_path, caplog, content):
    f = tmp_path / "bad.q3c"
    f.write_bytes(content)
    with caplog.at_level(logging.WARNING, "q3tts.engine"):
        assert load_artifact(f, ckpt) is None
    assert "cold start" in caplog.text and str(f) in caplog.text


def test_truncated_and_other_formats(ckpt, tmp_path):
    f = tmp_path / "a.q3c"
    header = save_artifact(f, ckpt)
    data = f.read_bytes()
    if header["sections"][0][1]:
        f.write_bytes(data[:-1])
        with pytest.raises(ValueError, match="truncated artifact"):
            read_artifact(f)
    _write(f, dict(header, format=99))
    with pytest.raises(ValueError, match="artifact format 99"):
        read_artifact(f)


def test_a_missing_file_is_an_error(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="q3tts warmup --save"):
        load_artifact(tmp_path / "nope.q3c", ckpt)


def test_triton_cache_moves_with_its_group_files(tmp_path):
    """Triton's group files name their children by absolute path: a cache extracted elsewhere points at itself."""
    old, new = tmp_path / "builder" / "triton", tmp_path / "here" / "triton"
    (old / "KEY").mkdir(parents=True)
    (old / "KEY" / "k.cubin").write_bytes(b"\x7fELF")
    (old / "KEY" / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.cubin": f"{old}/KEY/k.cubin"}}))
    data = artifact._tar(str(old))
    artifact._untar(data, str(new), str(old))
    group = json.loads((new / "KEY" / "__grp__k.json").read_text())
    assert group == {"child_paths": {"k.cubin": f"{new}/KEY/k.cubin"}}
    assert (new / "KEY" / "k.cubin").read_bytes() == b"\x7fELF"
    # a second process unpacking the same artifact over it replaces whole files and leaves no scratch behind
    artifact._untar(data, str(new), str(old))
    assert sorted(p.name for p in new.iterdir()) == ["KEY"] and json.loads((new / "KEY" / "__grp__k.json").read_text()) == group
    # a member that would land outside the cache is refused
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../evil")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.TarError):
        artifact._untar(buf.getvalue(), str(new), None)
    assert not (tmp_path / "here" / "evil").exists()


# One start as the server's engine makes it (compiled, 1 slot), a short greedy request; "save": the artifact after it
CHILD = """
import json, sys, torch
torch.set_num_threads(1)
from q3tts import TTS
from q3tts.engine.artifact import save_artifact
from q3tts.engine.compile import compile_counts
mode, ckpt, cache, art = sys.argv[1:5]
tts = TTS.from_pretrained(ckpt, device="cpu", compile=True, max_batch_size=1, max_seq_len=256, compile_cache=cache,
                          compile_artifact=art if mode == "load" else None)
kw = {"max_new_tokens": 8, "seed": 0, "do_sample": False, "subtalker_dosample": False}
codes = tts.generate_codes(tts.prepare_custom_voice("Hello.", tts.get_supported_speakers()[0], **kw))
if mode == "save":
    save_artifact(art, tts.ckpt)
print(json.dumps({"counts": compile_counts(), "codes": codes[0].tolist(), "loaded": tts.engine.artifact is not None}))
"""


def child_runner(tmp_path):
    """A tiny checkpoint in tmp_path; run(mode, cache) -> the CHILD's JSON, a start in a fresh process on the compile
    cache tmp_path/cache ("save": then the artifact tmp_path/engine.q3c; "load": with it; else neither)."""
    from q3tts.randomckpt import make_tiny
    make_tiny(tmp_path / "tiny")
    return lambda mode, cache: run_child(CHILD, mode, str(tmp_path / "tiny"), str(tmp_path / cache),
                                         str(tmp_path / "engine.q3c"), timeout=600,
                                         Q3TTS_PRECOMPILE="1")  # (as serve / warmup)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(run, the cold start's JSON): one start that compiled on the CPU into the compile cache cache-builder
    (Inductor's C++ kernels: gcc) and saved the artifact after its first request. The tests below start fresh
    processes from what it left: the artifact on an empty cache, and a restart on its cache."""
    run = child_runner(tmp_path_factory.mktemp("artifact"))
    return run, run("save", "cache-builder")


@pytest.mark.slow  # its fixture's start compiles on the CPU
def test_fresh_process_with_the_artifact_compiles_nothing(built):
    run, cold = built
    c = cold["counts"]
    assert c["fx_miss"] > 0 and c["fx_hit"] == 0 and c["traced"] == c["fx_miss"] and c["dynamo_hit"] == 0, c
    warm = run("load", "cache-fresh")  # another, empty compile cache: only the artifact can supply the graphs
    assert warm["loaded"]
    # every compiled function's Dynamo entry installed from it (the layers, the step compiled whole, the samplers):
    # nothing traced, nothing compiled. The streaming vocoder's pre-transformer layer is looked up too (6 functions), but
    # no streamed request ran it, so it has no entry
    w = warm["counts"]
    assert w["traced"] == 0 and w["fx_miss"] == 0 and w["aot_miss"] == 0, w
    assert c["dynamo_miss"] == 6 and w["dynamo_hit"] == 5, (c, w)
    assert warm["codes"] == cold["codes"]


@pytest.mark.slow  # its fixture's start compiles on the CPU
def test_a_restart_installs_what_the_first_requests_compiled(built):
    """On a CPU the engine compiles in its first steps, not at the build: those steps write their Dynamo entries
    into the compile cache, so a restart on it traces and compiles nothing."""
    run, cold = built
    assert cold["counts"]["traced"] > 0 and cold["counts"]["dynamo_hit"] == 0, cold["counts"]
    warm = run("restart", "cache-builder")
    w = warm["counts"]
    assert w["traced"] == 0 and w["fx_miss"] == 0 and w["dynamo_hit"] == 5, w
    assert warm["codes"] == cold["codes"]
