"""Replicas share one voice directory (Ray Serve: every replica's `voice_dir` is the same path or mount): a
voice stored through one server is listed and usable on another, and deleted for both. Two servers here are
two VoiceServices in one process, each with its own SQLite connections and loaded-voice cache: the files and
the SQLite index are all they share, as two replica processes would."""

import numpy as np
import openai
import pytest

from .live import pcm_samples, speak, start_server
from .test_voices import REF_TEXT, reference_wav


@pytest.fixture(scope="module")
def second(base_server):
    s = start_server("base06", base_server.app.state.settings.voice_dir, max_upload_bytes=400_000)
    yield s
    s.stop()


def test_voice_made_on_one_replica_is_used_and_deleted_from_another(base_server, second):
    a, b = base_server.client(), second.client()
    v = a.audio.voices.create(name="shared carol", audio_sample=("carol.wav", reference_wav(2.0, 180.0, seed=5),
                                                                "audio/wav"),
                              consent="cons_test", extra_body={"ref_text": REF_TEXT})
    assert v.id in [x["id"] for x in second.http().get("/v1/audio/voices").json()["data"]]
    on_a = pcm_samples(speak(a, "Said on either replica.", voice="shared carol"))
    on_b = pcm_samples(speak(b, "Said on either replica.", voice={"id": v.id}))
    assert len(on_a) > 0 and np.array_equal(on_a, on_b)  # one voice file, one greedy computation
    # a name is unique across replicas
    with pytest.raises(openai.ConflictError):
        b.audio.voices.create(name="shared carol", audio_sample=("c.wav", reference_wav(seed=6), "audio/wav"),
                              consent="cons_test", extra_body={"x_vector_only_mode": True})
    # deleted through b (a has the voice loaded in memory): gone for a too
    assert second.http().delete(f"/v1/audio/voices/{v.id}").status_code == 200
    assert v.id not in [x["id"] for x in base_server.http().get("/v1/audio/voices").json()["data"]]
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        speak(a, "Gone.", voice="shared carol")
