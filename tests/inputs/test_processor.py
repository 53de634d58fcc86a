"""InputProcessor refuses what it cannot serve, for every caller (Python, HTTP, WebSocket): text that is not
Unicode, and options the model type cannot use (never ignored unseen)."""

import pytest

from q3tts.inputs.request import InputError
from tests.golden import fixtures as fx


@pytest.mark.parametrize("text", ["Hi \ud800 there", "\udfff", "ok \U0001F600 then \udc00"])
def test_lone_surrogates_are_refused_naming_the_argument(text):
    cv = fx.tts("cv06")
    surrogate = r"text is not valid Unicode text: a lone surrogate U\+D[89A-F][0-9A-F]{2} "
    with pytest.raises(InputError, match=surrogate) as e:
        cv.prepare_custom_voice(text, "vivian")
    assert e.value.param == "text" and e.value.code == "invalid_text"
    with pytest.raises(InputError, match="instruct is not valid Unicode") as e:
        fx.tts("vd17").prepare_voice_design("Hi.", text)
    assert e.value.param == "instruct"
    cv.prepare_custom_voice("A pair is fine: \U0001F600.", "vivian")


def test_options_the_model_cannot_use_are_refused():
    cv, base = fx.tts("cv06"), fx.tts("base06")
    with pytest.raises(InputError, match=r"instruct is not supported: this is a CustomVoice model \(size 0b6\)") as e:
        cv.processor.check_options(instruct="Cheerfully.")  # the server's and the CLI's check
    assert e.value.param == "instruct" and e.value.code == "unsupported_for_model"
    with pytest.warns(UserWarning, match="instruct is ignored"):  # the Python API: upstream's behaviour, said
        assert cv.prepare_custom_voice("Hi.", "vivian", instruct="Cheerfully.")[0].layout == \
            cv.prepare_custom_voice("Hi.", "vivian")[0].layout
    cv.prepare_custom_voice("Hi.", "vivian", instruct=" ")  # blank: no instruction
    fx.tts("cv17").prepare_custom_voice("Hi.", "vivian", instruct="Cheerfully.")  # 1.7B takes one
    item = base.create_voice_clone_prompt((fx_wave(), 24000), x_vector_only_mode=True)
    with pytest.raises(InputError, match=r"instruct is not supported: this is a Base model"):
        base.prepare_voice_clone("Hi.", voice_clone_prompt=item, instruct="Slowly.")
    for kw in ({"ref_audio": b"RIFF"}, {"ref_text": "words"}, {"x_vector_only_mode": True}):
        with pytest.raises(InputError, match=f"{next(iter(kw))} is not supported: .*needs a Base model"):
            cv.processor.check_options(**kw)
    base.processor.check_options(ref_audio=b"RIFF", ref_text="words", x_vector_only_mode=True)


def fx_wave():
    import numpy as np
    t = np.arange(48000) / 24000
    return (0.2 * np.sin(2 * np.pi * 180 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))).astype(np.float32)
