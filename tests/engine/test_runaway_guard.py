"""The runaway guard: a request that never samples EOS ends at max(MIN_FRAME_CAP, frames per token x its text
tokens) frames with finish reason "length", for a whole text and a streamed one; a caller's max_new_tokens is the
cap instead; 0 turns it off."""

import math

import pytest

from q3tts.inputs.request import MIN_FRAME_CAP
from tests.golden import fixtures as fx

GREEDY = {"do_sample": False, "subtalker_dosample": False}
LONG = "A longer text of about twenty tokens, to pass the floor of the cap, surely."


@pytest.mark.parametrize("text,fpt", [("Hi.", None), (LONG, 5.0)])
@pytest.mark.parametrize("streamed", [False, True])
def test_a_request_that_never_stops_ends_with_length_at_the_bound(text, fpt, streamed):
    tts = fx.tts("cv06")  # its random weights never sample EOS (the fixtures run to max_new_tokens)
    kw = dict(GREEDY) if fpt is None else dict(GREEDY, max_frames_per_token=fpt)
    n = len(tts.processor.builder.text_ids(text))  # (the role prefix's few tokens included)
    cap = max(MIN_FRAME_CAP, math.ceil((fpt or tts.processor.max_frames_per_token) * n))
    assert cap < tts.engine.runner.max_len - 64  # the KV cache is not what ends it
    if fpt is not None:
        assert cap > MIN_FRAME_CAP  # the per-token part, not the floor
    if streamed:  # counted once the text closes
        chunks = list(tts.generate_custom_voice_stream(text_stream=[text[:5], text[5:]], speaker="vivian", **kw))
    else:
        chunks = list(tts.generate_custom_voice_stream(text, "vivian", **kw))
    assert chunks[-1].is_last and chunks[-1].finish_reason == "length"
    assert sum(c.num_frames for c in chunks) == cap


def test_max_new_tokens_given_is_the_cap_and_zero_is_no_guard():
    tts = fx.tts("cv06")
    wavs, _ = tts.generate_custom_voice("Hi.", "vivian", max_new_tokens=MIN_FRAME_CAP + 11, **GREEDY)
    assert wavs[0].shape[0] == (MIN_FRAME_CAP + 10) * 1920
    assert tts.prepare_custom_voice("Hi.", "vivian")[0].frame_cap() == MIN_FRAME_CAP
    assert tts.prepare_custom_voice("Hi.", "vivian", max_frames_per_token=0)[0].frame_cap() is None
    assert tts.prepare_custom_voice("Hi.", "vivian", max_new_tokens=9)[0].frame_cap() is None
    with pytest.raises(ValueError, match="max_frames_per_token must be a number"):
        tts.prepare_custom_voice("Hi.", "vivian", max_frames_per_token=-1)
