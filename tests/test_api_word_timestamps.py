"""TTS + forced aligner: generate_*(..., word_timestamps=True) returns each waveform's word times, equal to aligning
that waveform alone; the streaming variants put them on each utterance's last chunk."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch

from q3tts import TTS
from tests.golden.fixtures import checkpoint
from tests.test_align import aligner

GREEDY = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=12)


@lru_cache(maxsize=1)
def tts() -> TTS:
    return TTS.from_pretrained(checkpoint("cv06"), device="cpu", dtype=torch.float32, aligner=aligner())


def test_offline_returns_words_beside_the_audio():
    texts = ["Hello world, this is a test.", "你好世界"]
    wavs, sr, words = tts().generate_custom_voice(texts, speaker=["vivian", "dylan"], language=["English", "Chinese"],
                                                  word_timestamps=True, **GREEDY)
    assert len(words) == len(wavs) == 2
    assert [w.word for w in words[0]] == ["Hello", "world", "this", "is", "a", "test"]
    assert [w.word for w in words[1]] == ["你", "好", "世", "界"]
    for wav, ws, text, lang in zip(wavs, words, texts, ["English", "Chinese"]):
        assert ws == aligner().align(wav, sr, text, lang)  # as that waveform aligned alone
        assert all(w.start_s <= w.end_s for w in ws)
        assert [w.start_s for w in ws] == sorted(w.start_s for w in ws)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_aligner_reads_the_audio_where_the_vocoder_left_it(device, monkeypatch):
    """generate_*(word_timestamps=True) hands the aligner the waveforms as they lie on the model's device (on CUDA no
    round trip through the host), the samples it returns; the words are those of the returned audio aligned alone."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    t = tts() if device == "cpu" else TTS.from_pretrained(checkpoint("cv06"), device="cuda", dtype=torch.float32,
                                                          aligner=aligner_on("cuda"))
    given = []
    orig = type(t.aligner).align

    def spy(self, audio, *args, **kwargs):
        given.append(audio)
        return orig(self, audio, *args, **kwargs)
    monkeypatch.setattr(type(t.aligner), "align", spy)
    texts = ["Hello world, this is a test.", "One two."]
    wavs, sr, words = t.generate_custom_voice(texts, speaker=["vivian", "dylan"], language="English",
                                              word_timestamps=True, **GREEDY)
    got = given[0]
    assert all(isinstance(g, torch.Tensor) and g.device.type == device for g in got)
    assert all(np.array_equal(g.cpu().numpy(), w) for g, w in zip(got, wavs))
    assert words == [orig(t.aligner, w, sr, text, "English") for w, text in zip(wavs, texts)]


def aligner_on(device: str):
    from q3tts.align import ForcedAligner
    from tests.test_align import checkpoint as aligner_checkpoint
    return ForcedAligner.from_pretrained(aligner_checkpoint(), device=device, dtype=torch.float32, graphs=True)


def test_without_the_flag_the_return_is_unchanged():
    out = tts().generate_custom_voice("Hello.", speaker="vivian", language="English", **GREEDY)
    assert len(out) == 2


def test_stream_puts_the_words_on_each_utterances_last_chunk():
    t = tts()
    text = "One two three four."
    chunks = list(t.generate_custom_voice_stream(text, speaker="vivian", language="English", word_timestamps=True,
                                                 chunk_frames=4, **GREEDY))
    assert [c.word_timestamps is not None for c in chunks] == [c.is_last for c in chunks]
    wav = np.concatenate([c.audio for c in chunks])
    assert chunks[-1].word_timestamps == aligner().align(wav, t.sample_rate, text, "English")
    assert [w.word for w in chunks[-1].word_timestamps] == ["One", "two", "three", "four"]


def test_streamed_text_is_aligned_once_complete():
    t = tts()
    pieces = ["Good ", "morning ", "to ", "you."]
    chunks = list(t.generate_custom_voice_stream(text_stream=iter(pieces), speaker="vivian", language="English",
                                                 word_timestamps=True, **GREEDY))
    assert [w.word for w in chunks[-1].word_timestamps] == ["Good", "morning", "to", "you"]


def test_asking_without_an_aligner_names_the_option():
    plain = TTS(tts().ckpt)
    with pytest.raises(ValueError, match="aligner="):
        plain.generate_custom_voice("Hello.", speaker="vivian", language="English", word_timestamps=True, **GREEDY)
    with pytest.raises(ValueError, match="aligner="):
        next(plain.generate_custom_voice_stream("Hello.", speaker="vivian", word_timestamps=True, **GREEDY))


def test_an_unalignable_language_fails_before_synthesis():
    with pytest.raises(ValueError, match="Korean"):
        tts().generate_custom_voice("안녕하세요", speaker="sohee", language="Korean", word_timestamps=True, **GREEDY)
