"""Text streamed in == the whole text (greedy, fp32, CPU, golden fixtures from the official package): for every
model type, text fed in pieces of 1-3 characters, in bursts, split mid-word and mid-CJK, and slower than frames,
gives the official codes exactly and its audio (non_streaming_mode=False), alone and batched beside ordinary
requests; and the Python, async and error paths."""

import asyncio
import random
import threading
import time

import numpy as np
import pytest
import torch

from q3tts.engine.async_engine import AsyncEngine
from q3tts.engine.engine import Engine
from q3tts.engine.request import RequestStatus, StreamOptions
from tests.engine.steps import generate_codes, run_to_completion
from tests.golden import fixtures as fx
from tests.inputs.test_text import split

# NOTE: the streamed audio comes from the exact stateful decoder, the official from one full decode (<= 300
# frames: one chunk); the two differ by float32 rounding of a different summation order, far below 1e-4
# (tests/models/test_codec.py bounds stateful vs full at 1e-5 on the same tiny decoder)
AUDIO_TOL = 1e-4


def stream_cases():
    """Every single-request case of the official fixtures that uses the streamed-text layout."""
    return [(v, c["name"]) for v in fx.VARIANTS for c in fx.manifest(v)["cases"]
            if c["kw"].get("non_streaming_mode") is False and isinstance(c["kw"].get("text"), str)]


def prepared_stream(variant, name, engine_kw=None):
    """(tts, text, the case's request prepared with text=None, official codes, official audio)."""
    case = fx.get_case(variant, name)
    tts, kw = fx.tts(variant), dict(case["kw"])
    if "prompt" in case:
        kw["voice_clone_prompt"] = fx.case_prompt_items(variant, case)
    text = kw.pop("text")
    prep = getattr(tts, case["method"].replace("generate_", "prepare_"))
    p = prep(text=None, **kw, **fx.manifest(variant)["greedy"])[0]
    t = fx.outputs(variant)
    return tts, text, p, t[f"{name}.codes.0"], t[f"{name}.wav.0"].numpy()


def pieces(text, how, rng):
    if how == "burst":  # most of it at once, then the rest
        return [text[: len(text) * 3 // 4], text[len(text) * 3 // 4:]]
    return split(text, rng, {"chars": (1,), "1-3": (1, 2, 3)}[how])


def drive(eng, feeds, max_steps=10_000):
    """Feed each (prepared, pieces, steps) into a running engine: a piece, then `steps` engine steps (0: the text
    comes faster than frames; 3: slower, so rows sit frames out), the close after the last piece. -> every chunk."""
    chunks, cursors = [], [0] * len(feeds)
    for _ in range(max_steps):
        for i, (p, ps, _) in enumerate(feeds):
            if cursors[i] < len(ps):
                p.text.append(ps[cursors[i]])
                cursors[i] += 1
                if cursors[i] == len(ps):
                    p.text.close()
        feeding = any(c < len(f[1]) for c, f in zip(cursors, feeds))
        for _ in range(max(f[2] for f in feeds) if feeding else 1):
            chunks += eng.step()
        if not feeding and not eng.scheduler.has_work():
            return chunks
    raise AssertionError("the engine did not finish")


def check(req, chunks, ref_codes, ref_wav, p):
    codes = torch.stack(req.frames).cpu()
    full = codes if p.ref_codes is None else torch.cat([p.ref_codes, codes])
    assert full.shape == ref_codes.shape and torch.equal(full, ref_codes), req.request_id
    audio = np.concatenate([c.audio for c in chunks if c.request_id == req.request_id])
    assert audio.shape == ref_wav.shape and np.abs(audio - ref_wav).max() <= AUDIO_TOL


@pytest.mark.parametrize("variant,name", stream_cases())
def test_streamed_text_equals_official(variant, name):
    """Per case one way of feeding (so every model type sees each): pieces of 1-3 characters slower than frames,
    single characters as fast as frames, or a burst."""
    i = stream_cases().index((variant, name))
    how, slow = [("1-3", 3), ("chars", 1), ("burst", 1), ("1-3", 0)][i % 4]
    tts, text, p, ref_codes, ref_wav = prepared_stream(variant, name)
    eng = Engine(tts.ckpt, max_slots=1, max_seq_len=256)
    req = eng.add_request(p, StreamOptions(1, 4))
    chunks = drive(eng, [(p, pieces(text, how, random.Random(i)), slow)])
    assert req.status.reason in ("stop", "length")
    check(req, chunks, ref_codes, ref_wav, p)


def test_streamed_texts_batched_beside_ordinary_requests():
    """Two streamed texts (one slower than frames, CJK split mid-character run) and two whole-text requests of
    other lengths, staggered in one batch: each equals the official output or its own run alone."""
    tts, text_a, pa, codes_a, wav_a = prepared_stream("cv06", "english_stream")
    _, text_b, pb, codes_b, wav_b = prepared_stream("cv06", "dialect_dylan_auto_stream")
    greedy = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=14)
    whole = tts.prepare_custom_voice(["A whole text beside them.", "你好。"], ["vivian", "serena"], **greedy)
    alone = [generate_codes(Engine(tts.ckpt, max_slots=1, max_seq_len=256), [w])[0] for w in whole]
    eng = Engine(tts.ckpt, max_slots=4, max_seq_len=256)
    w0 = eng.add_request(whole[0], StreamOptions(2, 8))
    for _ in range(3):
        eng.step()
    ra, rb = eng.add_request(pa, StreamOptions(1, 4)), eng.add_request(pb, StreamOptions(1, 16))
    w1 = eng.add_request(whole[1], StreamOptions(1, 2))
    chunks = drive(eng, [(pa, pieces(text_a, "1-3", random.Random(3)), 3), (pb, pieces(text_b, "chars", random.Random(0)), 2)])
    check(ra, chunks, codes_a, wav_a, pa)
    check(rb, chunks, codes_b, wav_b, pb)
    for r, a in zip((w0, w1), alone):
        assert torch.equal(torch.stack(r.frames).cpu(), a)
    assert eng.scheduler.num_running == 0 and len(eng.scheduler.free_slots) == 4


def test_python_api_text_stream_from_a_slow_generator():
    tts, text, _, _, ref_wav = prepared_stream("cv17", "korean_stream")
    case = fx.get_case("cv17", "korean_stream")
    kw = {k: v for k, v in case["kw"].items() if k not in ("text", "non_streaming_mode")}
    seen = []

    def llm():  # an LLM's tokens, slower than the talker's frames
        for piece in pieces(text, "1-3", random.Random(5)):
            time.sleep(0.02)
            seen.append(piece)
            yield piece

    chunks, first_audio_with_text_left = [], None
    for c in tts.generate_custom_voice_stream(text_stream=llm(), **kw, **fx.manifest("cv17")["greedy"]):
        if c.num_frames and first_audio_with_text_left is None:
            first_audio_with_text_left = len("".join(seen)) < len(text)
        chunks.append(c)
    assert first_audio_with_text_left  # speech started before the text was finished
    audio = np.concatenate([c.audio for c in chunks])
    assert audio.shape == ref_wav.shape and np.abs(audio - ref_wav).max() <= AUDIO_TOL


def test_async_engine_takes_an_async_text_stream():
    tts, text, p, ref_codes, ref_wav = prepared_stream("vd17", "french_stream")
    aeng = AsyncEngine(Engine(tts.ckpt, max_slots=2, max_seq_len=256))

    async def llm():
        for piece in pieces(text, "1-3", random.Random(9)):
            await asyncio.sleep(0.005)
            yield piece

    async def main():
        return [c async for c in aeng.generate(p, StreamOptions(1, 4), text_stream=llm())]

    try:
        chunks = asyncio.run(main())
    finally:
        aeng.shutdown()
    audio = np.concatenate([c.audio for c in chunks])
    assert chunks[-1].is_last and audio.shape == ref_wav.shape and np.abs(audio - ref_wav).max() <= AUDIO_TOL


def test_bad_text_streams_fail_alone_and_free_their_slots():
    tts = fx.tts("cv06")
    greedy = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=8)
    with pytest.raises(ValueError, match="text is empty"):
        list(tts.generate_custom_voice_stream(text_stream=iter([" ", "\n "]), speaker="ryan", **greedy))
    with pytest.raises(ValueError, match="not both"):
        tts.generate_custom_voice_stream("Hi.", "ryan", text_stream=["Hi."])

    def broken():
        yield "Hello there, "
        raise RuntimeError("the LLM went away")

    with pytest.raises(RuntimeError, match="the LLM went away"):
        list(tts.generate_custom_voice_stream(text_stream=broken(), speaker="ryan", **greedy))
    eng = tts.engine
    assert eng.scheduler.num_running == 0 and eng.scheduler.queue_depth == 0
    # a text longer than the cache can feed fails that request alone; a whole-text request beside it completes
    small = Engine(tts.ckpt, max_slots=2, max_seq_len=64)
    p = tts.prepare_custom_voice(text=None, speaker="ryan", non_streaming_mode=False, **greedy)[0]
    ok = small.add_request(tts.prepare_custom_voice("Fine.", "vivian", **greedy)[0], StreamOptions(1, 4))
    bad = small.add_request(p, StreamOptions(1, 4))
    p.text.append("word " * 100)
    chunks = run_to_completion(small, [ok, bad])
    assert bad.status == RequestStatus.FINISHED_ERROR and "too long" in bad.error
    assert ok.status.reason == "length" and [c.error for c in chunks if c.request_id == bad.request_id][-1]
    assert small.scheduler.num_running == 0


def test_a_row_waiting_for_text_does_not_hold_up_the_others():
    """While a streamed text has no next token, its row sits out and the whole-text request beside it runs every
    step; the engine reports no work once only text can move it on (the server loop then sleeps)."""
    tts = fx.tts("cv06")
    greedy = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=10)
    eng = Engine(tts.ckpt, max_slots=2, max_seq_len=256)
    p = tts.prepare_custom_voice(text=None, speaker="ryan", non_streaming_mode=False, **greedy)[0]
    waiting = eng.add_request(p)
    other = eng.add_request(tts.prepare_custom_voice("Go on.", "vivian", **greedy)[0])
    p.text.append("Hello world and then")  # the prompt can be laid out; trailing text runs out quickly
    for _ in range(12):
        eng.step()
    assert other.status.finished and other.num_frames == 9
    assert waiting.status == RequestStatus.RUNNING and 0 < waiting.num_frames < 9
    stuck = waiting.num_frames
    eng.step()
    assert waiting.num_frames == stuck and not eng.has_work()
    eng.wake.clear()
    woke = threading.Event()
    threading.Timer(0.05, lambda: (woke.set(), p.text.append(" more"))).start()
    assert eng.wake.wait(5) and woke.is_set() and eng.has_work()
    p.text.close()
    run_to_completion(eng, [waiting])
    assert waiting.status.finished and waiting.num_frames == 9
