"""Tokenizer ids equal the official processor's; bad prompts give clear errors."""

import pytest

from q3tts.inputs.prompt import TextTokenizer
from tests.golden import fixtures as fx


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer(fx.REFERENCE / "tokenizer")


def test_token_ids_equal_official(tok):
    n = 0
    for variant in fx.VARIANTS:
        for case in fx.manifest(variant)["cases"]:
            for text, ids in case["token_ids"]:
                assert tok.encode(text) == ids, text
                n += 1
    assert n > 20


def test_special_tokens(tok):
    assert tok.token_id("<tts_pad>") == 151671 and tok.token_id("<|im_start|>") == 151644
    assert tok.encode("<|im_start|>assistant\n") == [151644, 77091, 198]


def test_errors_name_accepted_values():
    tts = fx.tts("cv06")
    with pytest.raises(ValueError, match="Unsupported speaker 'nobody'.*vivian"):
        tts.generate_custom_voice("hi", speaker="nobody")
    with pytest.raises(ValueError, match="Unsupported language 'klingon'.*english"):
        tts.generate_custom_voice("hi", speaker="vivian", language="klingon")
    with pytest.raises(ValueError, match="text is empty"):
        tts.generate_custom_voice("   ", speaker="vivian")
    with pytest.raises(ValueError, match="needs a VoiceDesign model.*custom_voice"):
        tts.generate_voice_design("hi", instruct="x")
    with pytest.raises(ValueError, match="needs a Base model"):
        tts.generate_voice_clone("hi", voice_clone_prompt=[])
    with pytest.raises(ValueError, match="Batch size mismatch"):
        tts.generate_custom_voice(["a", "b", "c"], speaker=["vivian", "ryan"])
    with pytest.raises(ValueError, match="dialect|Unsupported language"):
        tts.generate_custom_voice("hi", speaker="vivian", language="sichuan_dialect")  # dialects are speaker-driven


def test_voice_prompt_size_and_codes_checked():
    import torch

    from q3tts import VoiceClonePromptItem
    tts = fx.tts("base06")
    D = tts.cfg.talker.hidden_size
    bad = VoiceClonePromptItem(ref_code=None, ref_spk_embedding=torch.zeros(D + 1), x_vector_only_mode=True, icl_mode=False)
    with pytest.raises(ValueError, match=f"needs {D}.*another model size"):
        tts.generate_voice_clone("hi", voice_clone_prompt=[bad])
    icl = VoiceClonePromptItem(ref_code=torch.zeros(5, 16, dtype=torch.long), ref_spk_embedding=torch.zeros(D),
                               x_vector_only_mode=False, icl_mode=True, ref_text=None)
    with pytest.raises(ValueError, match="ref_text"):
        tts.generate_voice_clone("hi", voice_clone_prompt=[icl])
    icl.ref_text, icl.ref_code = "ok", torch.full((5, 16), 5000)
    with pytest.raises(ValueError, match="ref_code values"):
        tts.generate_voice_clone("hi", voice_clone_prompt=[icl])
    with pytest.raises(ValueError, match="voice_clone_prompt.*ref_audio"):
        tts.generate_voice_clone("hi")


def test_sampling_kwargs_validated():
    tts = fx.tts("cv06")
    with pytest.raises(ValueError, match="top_p"):
        tts.generate_custom_voice("hi", speaker="vivian", top_p=0)
