"""Voices on a Base (voice clone) model: upload, list, use, delete, survive a restart; inline references;
and VoiceDesign's `instructions`."""

import base64

import numpy as np
import openai
import pytest

from .live import SPF, pcm_samples, speak


def reference_wav(seconds: float = 2.0, f0: float = 150.0, seed: int = 0) -> bytes:
    """A voiced-sounding clip: harmonics of f0 with a syllable envelope, plus a little noise."""
    from q3tts.audio import wav_bytes
    sr = 24000
    t = np.arange(int(sr * seconds)) / sr
    x = sum(np.sin(2 * np.pi * f0 * h * t) / h for h in range(1, 6)) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    x = 0.2 * x / np.abs(x).max() + 0.01 * np.random.default_rng(seed).standard_normal(t.shape)
    return wav_bytes(x.astype(np.float32), sr)


REF_TEXT = "Hello there, my good friend."


@pytest.fixture(scope="module")
def alice(base_server):
    """An ICL voice uploaded with the official client's voices.create (multipart) plus extension fields."""
    v = base_server.client().audio.voices.create(name="alice", audio_sample=("alice.wav", reference_wav(), "audio/wav"),
                                                 consent="cons_test", extra_body={"ref_text": REF_TEXT})
    assert v.id.startswith("voice_") and v.name == "alice" and v.object == "audio.voice"
    return v


def test_upload_list_and_speak_with_a_stored_voice(base_server, alice):
    client = base_server.client()
    with base_server.http() as h:
        listed = h.get("/v1/audio/voices").json()["data"]
        assert [(v["id"], v["name"], v["mode"], v["ref_text"]) for v in listed] == [
            (alice.id, "alice", "icl", REF_TEXT)]
        assert h.get(f"/v1/audio/voices/{alice.id}").json()["name"] == "alice"
    by_name = pcm_samples(speak(client, "Cloned speech.", voice="alice"))
    by_id = pcm_samples(speak(client, "Cloned speech.", voice={"id": alice.id}))
    assert len(by_name) > 0 and len(by_name) % SPF == 0 and np.array_equal(by_name, by_id)
    xvec = pcm_samples(speak(client, "Cloned speech.", voice="alice", x_vector_only_mode=True))
    assert len(xvec) > 0 and not np.array_equal(xvec, by_name)



def test_requests_in_a_stored_voice_take_no_clone_place(base_server, alice):
    """A stored voice is a lookup, not a clone: with the clone pool full (its limit 0 here) requests naming it are
    served, alone and 8 at once, while one with an inline reference is refused as a clone (503 clone_queue_full)."""
    from concurrent.futures import ThreadPoolExecutor
    clones = base_server.app.state.voices.clones
    client = base_server.client()
    limit, clones.limit = clones.limit, 0
    try:
        alone = pcm_samples(speak(client, "Cloned speech.", voice="alice"))
        with ThreadPoolExecutor(8) as ex:
            burst = list(ex.map(lambda _: pcm_samples(speak(client, "Cloned speech.", voice="alice")), range(8)))
        # the same audio: on a CPU the vocoder's rows decoded together sum in another fp32 order (<= 1 PCM step)
        assert len(alone) > 0 and all(b.shape == alone.shape for b in burst)
        assert max(np.abs(b.astype(np.int32) - alone).max() for b in burst) <= 1
        data_url = "data:audio/wav;base64," + base64.b64encode(reference_wav(seed=5)).decode()
        with base_server.http() as h:
            r = h.post("/v1/audio/speech", json={"input": "Hi.", "ref_audio": data_url, "ref_text": REF_TEXT,
                                                 "response_format": "pcm"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "clone_queue_full", r.text
    finally:
        clones.limit = limit

def test_json_upload_x_vector_voice_and_inline_reference(base_server):
    client = base_server.client()
    clip = reference_wav(2.5, 210.0, seed=1)
    b64 = "data:audio/wav;base64," + base64.b64encode(clip).decode()
    with base_server.http() as h:
        r = h.post("/v1/audio/voices", json={"name": "bob", "audio_sample": b64, "x_vector_only_mode": True})
        assert r.status_code == 200, r.text
        bob = r.json()
        assert bob["mode"] == "x_vector" and bob["ref_text"] is None
        stored = pcm_samples(speak(client, "From the store.", voice="bob"))
        inline = pcm_samples(speak(client, "From the store.", voice="ignored", ref_audio=b64, x_vector_only_mode=True))
        assert len(stored) > 0 and np.array_equal(stored, inline)  # same clip -> same voice -> same greedy audio
        icl = pcm_samples(speak(client, "Inline ICL.", voice="x", ref_audio=b64, ref_text="One two three four."))
        assert len(icl) > 0
        assert h.delete(f"/v1/audio/voices/{bob['id']}").json() == {"id": bob["id"], "object": "audio.voice.deleted",
                                                                     "deleted": True}


def test_voice_errors(base_server, alice):
    client = base_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        speak(client, "Who?", voice="carol")
    assert "carol" in e.value.body["message"] and "alice" in e.value.body["message"] and e.value.body["param"] == "voice"
    with pytest.raises(openai.ConflictError):
        client.audio.voices.create(name="alice", audio_sample=("a.wav", reference_wav(), "audio/wav"), consent="c",
                                   extra_body={"ref_text": REF_TEXT})
    # without its transcript (OpenAI's API has no such field) the clip gives an x-vector voice, not an error
    dave = client.audio.voices.create(name="dave", audio_sample=("d.wav", reference_wav(), "audio/wav"), consent="c")
    assert dave.type == "audio_sample" and dave.model_extra["mode"] == "x_vector"
    client.audio.voices.delete(dave.id)
    with pytest.raises(openai.BadRequestError) as e:  # not audio
        client.audio.voices.create(name="eve", audio_sample=("e.wav", b"not audio at all" * 10, "audio/wav"),
                                   consent="c", extra_body={"x_vector_only_mode": True})
    assert "decode" in e.value.body["message"]
    with pytest.raises(openai.APIStatusError) as e:  # 12 s clip > max_upload_bytes (400 kB in this fixture)
        client.audio.voices.create(name="big", audio_sample=("b.wav", reference_wav(12.0), "audio/wav"), consent="c",
                                   extra_body={"x_vector_only_mode": True})
    assert e.value.status_code == 413 and "400000" in e.value.body["message"]
    big = base64.b64encode(reference_wav(12.0)).decode()
    with pytest.raises(openai.APIStatusError) as e:
        speak(client, "Too big.", voice="x", ref_audio=big, x_vector_only_mode=True)
    assert e.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.audio.voices.delete("voice_0000000000000000")
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.voices.create(name="bad/name", audio_sample=("n.wav", reference_wav(), "audio/wav"), consent="c")
    assert e.value.body["param"] == "name"


def test_voices_survive_a_restart(base_server, alice):
    from q3tts.server.voices import VoiceStore
    tts, store = base_server.app.state.tts, base_server.app.state.voices.store
    again = VoiceStore(store.root, tts.cfg)  # a new process would open the same directory
    rec = again.find("alice")
    assert rec is not None and rec.id == alice.id and (store.root / rec.file).exists()
    a, b = again.voice(rec), store.voice(store.find(alice.id))
    assert np.array_equal(a.embedding.numpy(), b.embedding.numpy()) and np.array_equal(a.ref_code, b.ref_code)


def test_delete(base_server):
    client = base_server.client()
    v = client.audio.voices.create(name="temp", audio_sample=("t.wav", reference_wav(seed=5), "audio/wav"),
                                   consent="c", extra_body={"x_vector_only_mode": "true"})
    assert client.audio.voices.delete(v.id).deleted
    with pytest.raises(openai.BadRequestError):
        speak(client, "Gone.", voice="temp")
    assert not (base_server.app.state.voices.store.root / f"{v.id}.safetensors").exists()


def test_voice_design_needs_instructions(vd_server):
    client = vd_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        speak(client, "No description.", voice="anything")
    assert e.value.body["param"] == "instructions"
    out = pcm_samples(speak(client, "Described.", voice="anything", instructions="A cheerful robot.", max_new_tokens=6))
    assert len(out) > 0 and len(out) % SPF == 0
