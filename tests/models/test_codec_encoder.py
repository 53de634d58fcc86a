"""12 Hz codec encoder vs the official `speech_tokenizer.encode`: names, shapes, codes exactly equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from q3tts.config import parse_speech_tokenizer_config, read_json
from q3tts.models.codec_encoder import CodecEncoder, parse_codec_encoder_config
from tests.golden.voice import CLIPS, clip24, cloner, outputs

ROOT = Path(__file__).resolve().parents[2]
TSV = ROOT / "q3tts" / "reference" / "Qwen3-TTS-Tokenizer-12Hz.state_dict_shapes.tsv"


def test_checkpoint_names_and_shapes_of_the_real_tokenizer():
    """Every `encoder.*` key of the published speech tokenizer, with its shape, and nothing else."""
    want = {}
    for line in TSV.read_text().splitlines():
        if line.startswith("#") or "\t" not in line:
            continue
        name, shape = line.split("\t")[:2]
        if name.startswith("encoder."):
            want[name[len("encoder."):]] = [int(s) for s in shape.split("x")]
    cfg = parse_speech_tokenizer_config(read_json(ROOT / "q3tts" / "reference" / "speech_tokenizer.config.json"))
    with torch.device("meta"):
        enc = CodecEncoder(parse_codec_encoder_config(cfg.encoder), num_codes=cfg.encoder_valid_num_quantizers)
    ours = {k: list(v.shape) for k, v in enc.state_dict().items()}
    assert sorted(set(want) - set(ours)) == [] and sorted(set(ours) - set(want)) == []
    assert ours == want


def test_real_config_rates():
    d = read_json(ROOT / "q3tts" / "reference" / "speech_tokenizer.config.json")
    cfg = parse_codec_encoder_config(d["encoder_config"])
    assert cfg.frame_rate == 12.5 and cfg.encodec_frame_rate == 25 and cfg.hop_length == 1920


@pytest.mark.parametrize("clip", CLIPS)
def test_codes_equal_official(clip):
    """One clip, as upstream encodes a single reference: ceil(N / 1920) frames of 16 codes, exactly."""
    codes = cloner().encode([clip24(clip)])[0]
    ref = outputs()[f"{clip}.ref_code"]
    assert codes.shape == ref.shape == (-(-len(clip24(clip)) // 1920), 16)
    assert codes.dtype == torch.int64
    mismatch = (codes != ref).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at (frame, codebook) {mismatch[0].tolist()}"


def test_encoder_is_causal():
    """Frame-aligned prefixes encode to prefixes of the codes (causal convs, causal attention)."""
    w = clip24("sy22m")
    full = cloner().encode([w])[0]
    part = cloner().encode([w[: 1920 * 9]])[0]
    assert torch.equal(part, full[:9])


def test_batch_rows_keep_their_own_length():
    """A zero-padded batch returns ceil(len / 1920) frames per row; the longest row equals its solo codes."""
    a, b = clip24("es16m"), clip24("es22s")[: 24000 + 700]
    ca, cb = cloner().encode([a, b])
    assert ca.shape[0] == -(-len(a) // 1920) and cb.shape[0] == -(-len(b) // 1920)
    assert torch.equal(ca, cloner().encode([a])[0])
    # all but the last (partial) frame of the shorter row are independent of the padding
    assert torch.equal(cb[:-1], cloner().encode([b])[0][:-1])
