"""Voice cloning end to end vs the official qwen-tts 0.1.1, the ICL guards, and Voice files.

Fixtures: tests/golden/make_golden_voice.py (tiny base06 checkpoint, reference clips at 16 / 22.05 /
44.1 / 48 kHz, mono and stereo, WAV / FLAC / MP3 / Opus). Measured: ref_code and generated codes equal,
x-vector relative error <= 1.6e-7, audio max abs error <= 6.3e-6 (bound 1e-4)."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from q3tts.config import parse_model_config
from q3tts.inputs.voice import (
    ICL_SILENCE_SECONDS,
    RefTextWarning,
    Voice,
    VoiceCloner,
    ref_text_mismatch,
    speech_units,
)
from tests.golden import fixtures as fx
from tests.golden.voice import MANIFEST, clip, cloner, outputs

SPK_REL_TOL = 1e-4
WAV_TOL = 1e-4


def ref_text(name: str) -> str:
    return MANIFEST["clips"][name]["ref_text"]


def assert_item(item, spk_key: str, code_key: str | None):
    ref = outputs()[spk_key]
    emb = torch.as_tensor(item.ref_spk_embedding)
    assert ((emb - ref).norm() / ref.norm()).item() <= SPK_REL_TOL
    if code_key is None:
        assert item.ref_code is None and item.x_vector_only_mode and not item.icl_mode
    else:
        assert item.icl_mode and not item.x_vector_only_mode
        assert torch.equal(item.ref_code, outputs()[code_key]), code_key


# --------------------------------------------------------------------------- prompt items vs official
@pytest.mark.filterwarnings("error::q3tts.inputs.voice.RefTextWarning")
@pytest.mark.parametrize("name", sorted(MANIFEST["clips"]))
def test_prompt_item_matches_official(name):
    item, = cloner().create_voice_clone_prompt(clip(name), ref_text=ref_text(name), append_silence=False)
    assert_item(item, f"{name}.spk", f"{name}.ref_code")
    assert item.ref_text == ref_text(name)


@pytest.mark.parametrize("name", MANIFEST["data_url_clips"])
def test_data_url_input_matches_official(name):
    ext = Path(clip(name)).suffix[1:]
    url = f"data:audio/{ext};base64," + base64.b64encode(Path(clip(name)).read_bytes()).decode()
    item, = cloner().create_voice_clone_prompt(url, ref_text=ref_text(name), append_silence=False)
    assert_item(item, f"dataurl_{name}.spk", f"dataurl_{name}.ref_code")


@pytest.mark.parametrize("batch", MANIFEST["batches"], ids=lambda b: b["name"])
def test_batch_matches_official(batch):
    """Lists per argument; one sample rate -> one padded batch (upstream), mixed rates -> one by one."""
    rows = batch["rows"]
    items = cloner().create_voice_clone_prompt([clip(c) for c, _ in rows], ref_text=[ref_text(c) for c, _ in rows],
                                               x_vector_only_mode=[m == "xvec" for _, m in rows], append_silence=False)
    assert len(items) == len(rows)
    for j, (it, (_, mode)) in enumerate(zip(items, rows)):
        assert_item(it, f"{batch['name']}.spk.{j}", None if mode == "xvec" else f"{batch['name']}.ref_code.{j}")


# --------------------------------------------------------------------------- end to end vs official
def _generate(items, kw):
    tts = fx.tts("base06")
    prepared = tts.prepare_voice_clone(kw["text"], kw["language"], voice_clone_prompt=items,
                                       non_streaming_mode=kw["non_streaming_mode"], **MANIFEST["greedy"])
    codes = tts.generate_codes(prepared)
    wavs = tts.decode(codes, [p.ref_codes for p in prepared])
    full = [c if p.ref_codes is None else torch.cat([p.ref_codes, c]) for c, p in zip(codes, prepared)]
    return full, wavs


@pytest.mark.parametrize("case", MANIFEST["e2e"], ids=lambda c: c["name"])
def test_generate_voice_clone_matches_official(case):
    """Official generate_voice_clone(ref_audio=..., ref_text=..., x_vector_only_mode=...) == ours:
    create_voice_clone_prompt (no appended silence) then generate: codes equal, audio within 1e-4."""
    kw = case["kw"]
    items = cloner().create_voice_clone_prompt(clip(case["clip"]), ref_text=kw["ref_text"],
                                               x_vector_only_mode=kw["x_vector_only_mode"], append_silence=False)
    (codes,), (wav,) = _generate(items, kw)
    ref = outputs()[f"{case['name']}.codes"]
    assert codes.shape == ref.shape, f"{codes.shape[0]} frames vs official {ref.shape[0]}"
    mismatch = (codes != ref).nonzero()
    assert mismatch.numel() == 0, f"first code mismatch at (frame, codebook) {mismatch[0].tolist()}"
    ref_wav = outputs()[f"{case['name']}.wav"].numpy()
    assert wav.shape == ref_wav.shape
    assert np.abs(wav - ref_wav).max() <= WAV_TOL


# --------------------------------------------------------------------------- ICL guards
def test_append_silence_is_on_by_default_and_only_touches_icl_codes():
    name = "es16m"
    plain, = cloner().create_voice_clone_prompt(clip(name), ref_text=ref_text(name), append_silence=False)
    padded, = cloner().create_voice_clone_prompt(clip(name), ref_text=ref_text(name))
    n24 = MANIFEST["clips"][name]["num_samples_24k"]
    assert padded.ref_code.shape[0] == -(-(n24 + int(ICL_SILENCE_SECONDS * 24000)) // 1920)
    assert plain.ref_code.shape[0] == -(-n24 // 1920)
    assert torch.equal(padded.ref_spk_embedding, plain.ref_spk_embedding)  # the x-vector sees the clip as is
    # causal encoder: whole frames before the clip's end are unchanged
    whole = n24 // 1920
    assert torch.equal(padded.ref_code[:whole], plain.ref_code[:whole])


def test_icl_without_ref_text_is_an_error():
    for bad in (None, ""):
        with pytest.raises(ValueError, match="ref_text is required when x_vector_only_mode=False"):
            cloner().create_voice_clone_prompt(clip("es16m"), ref_text=bad)
    with pytest.raises(ValueError, match="Bad index=1"):
        cloner().create_voice_clone_prompt([clip("es16m"), clip("sy16s")], ref_text=["hello", None])
    item, = cloner().create_voice_clone_prompt(clip("es16m"), x_vector_only_mode=True)
    assert item.ref_code is None and item.x_vector_only_mode


def test_batch_size_mismatch():
    with pytest.raises(ValueError, match="Batch size mismatch: ref_audio=2, ref_text=1"):
        cloner().create_voice_clone_prompt([clip("es16m"), clip("sy16s")], ref_text=["only one"])


def test_bad_reference_is_named():
    with pytest.raises(ValueError, match=r"ref_audio\[1\]: the audio is silent"):
        cloner().create_voice_clone_prompt([clip("es16m"), (np.zeros(48000, np.float32), 24000)],
                                           x_vector_only_mode=True)


def test_ref_text_far_too_short_warns():
    with pytest.warns(RefTextWarning, match="far too short"):
        cloner().create_voice_clone_prompt((np.tile(_speechy(), 5), 24000), ref_text="Hi.")


def test_ref_text_far_too_long_warns():
    with pytest.warns(RefTextWarning, match="far too long"):
        cloner().create_voice_clone_prompt(clip("es16m"), ref_text=" ".join(["wonderful"] * 20))


def test_plausible_ref_text_does_not_warn():
    for name in MANIFEST["clips"]:
        assert ref_text_mismatch(ref_text(name), *_load(name)) is None, name


def test_speech_units():
    assert speech_units("Hello there, this is a short test.") == 9
    assert speech_units("你好，今天天气真不错。") == 9
    assert speech_units("Crème brûlée 42") == 4 + 2
    assert speech_units("") == 0


def _speechy() -> np.ndarray:
    t = np.arange(24000) / 24000
    return (0.3 * np.sin(2 * np.pi * 180 * t) * np.sin(np.pi * 4 * t) ** 2).astype(np.float32)


def _load(name):
    from q3tts.audio import load_audio
    return load_audio(clip(name))


# --------------------------------------------------------------------------- Voice files
@pytest.mark.parametrize("mode", ["icl", "xvec"])
def test_voice_file_round_trip_gives_identical_output(tmp_path, mode):
    name = "es22s"
    case_kw = dict(text="Hello world, a voice saved and loaded.", language="English", non_streaming_mode=False)
    voice = cloner().create_voice(clip(name), ref_text=ref_text(name), x_vector_only_mode=mode == "xvec",
                                  name="alice")
    path = tmp_path / "alice.safetensors"
    voice.save(path)
    loaded = Voice.load(path, model=fx.tts("base06").cfg)
    assert loaded.name == "alice" and loaded.model_size == "0b6" and loaded.icl == (mode == "icl")
    assert torch.equal(loaded.embedding, voice.embedding)
    assert loaded.ref_text == (ref_text(name) if mode == "icl" else None)
    if mode == "icl":
        assert torch.equal(loaded.ref_code, voice.ref_code)
    direct = cloner().create_voice_clone_prompt(clip(name), ref_text=ref_text(name), x_vector_only_mode=mode == "xvec")
    codes_a, wavs_a = _generate(direct, case_kw)
    codes_b, wavs_b = _generate([loaded.to_prompt_item()], case_kw)
    assert torch.equal(codes_a[0], codes_b[0])
    assert np.array_equal(wavs_a[0], wavs_b[0])


def test_wrong_model_size_is_rejected(tmp_path):
    voice = cloner().create_voice(clip("es16m"), x_vector_only_mode=True)
    path = tmp_path / "v06.safetensors"
    voice.save(path)
    cfg17 = parse_model_config(fx.manifest("base17")["config"])
    with pytest.raises(ValueError, match=r"made for the 0\.6B model .* this model is 1\.7B"):
        Voice.load(path, model=cfg17)
    with pytest.raises(ValueError, match="need a Base model"):
        Voice.load(path, model=parse_model_config(fx.manifest("cv06")["config"]))
    Voice.load(path, model=fx.tts("base06").cfg)  # the right size loads


def test_x_vector_voice_cannot_do_icl():
    voice = cloner().create_voice(clip("es16m"), x_vector_only_mode=True)
    with pytest.raises(ValueError, match="ICL mode needs reference codes"):
        voice.to_prompt_item(x_vector_only_mode=False)
    assert voice.to_prompt_item().x_vector_only_mode


def test_not_a_voice_file(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file({"embedding": torch.zeros(4)}, str(p), metadata={"format": "something else"})
    with pytest.raises(ValueError, match="not a q3tts voice file"):
        Voice.load(p)
    p.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a voice file"):
        Voice.load(p)


def test_newer_voice_format_is_rejected(tmp_path):
    p = tmp_path / "v.safetensors"
    save_file({"embedding": torch.zeros(64)}, str(p), metadata={"format": "q3tts.voice", "format_version": "99"})
    with pytest.raises(ValueError, match="format version 99 is newer"):
        Voice.load(p)


# --------------------------------------------------------------------------- checkpoints that cannot clone
def test_non_base_model_is_rejected():
    cfg = parse_model_config(fx.manifest("cv06")["config"])
    with pytest.raises(ValueError, match="voice cloning needs a Base model"):
        VoiceCloner(fx.checkpoint("base06"), cfg=cfg)


def test_checkpoint_without_speaker_encoder(tmp_path):
    import shutil
    src = fx.checkpoint("base06")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if not k.startswith("speaker_encoder.")}, str(dst / "model.safetensors"))
    vc = VoiceCloner(dst)
    with pytest.raises(ValueError, match=r"has no speaker_encoder\.\* weights"):
        vc.create_voice_clone_prompt(clip("es16m"), x_vector_only_mode=True)


def test_public_generate_voice_clone_from_ref_audio_matches_official():
    """The drop-in call itself: generate_voice_clone(ref_audio=..., ref_text=...) gives the official audio."""
    case = next(c for c in MANIFEST["e2e"] if c["mode"] == "icl")
    kw = dict(case["kw"])
    wavs, sr = fx.tts("base06").generate_voice_clone(ref_audio=clip(case["clip"]), append_silence=False, **kw,
                                                     **MANIFEST["greedy"])
    ref_wav = outputs()[f"{case['name']}.wav"].numpy()
    assert sr == 24000 and wavs[0].shape == ref_wav.shape
    assert np.abs(wavs[0] - ref_wav).max() <= WAV_TOL
