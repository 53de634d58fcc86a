"""Paged KV cache (Engine(kv_block_size=...)): the same codes as the contiguous cache, blocks handed out as
positions cross block boundaries, freed on finish, rows that find no block wait, and a full pool fails the newest."""

import pytest
import torch

import q3tts.engine.engine as engine_mod
from q3tts.engine.engine import Engine
from q3tts.engine.request import RequestStatus, StreamOptions
from tests.engine.steps import run_to_completion
from tests.engine.test_engine import (
    prepared_lengths,
    prepared_mix,
    run_alone,
    stream_alone,
)
from tests.golden import fixtures as fx

BS = 16  # small blocks: the tiny models' prompts (30-100 positions) and 12 frames cross several


def paged(tts, max_slots, num_blocks=None, monkeypatch=None, max_seq_len=256):
    if num_blocks is not None:
        monkeypatch.setattr(engine_mod, "size_engine", lambda ckpt, s, n, *a, **k: (s, n, num_blocks))
    return Engine(tts.ckpt, max_slots=max_slots, max_seq_len=max_seq_len, kv_block_size=BS)


@pytest.mark.parametrize("variant", ["cv06", "base06"])
def test_paged_batched_prefill_equals_contiguous_alone(variant):
    tts, ps = prepared_lengths(variant)
    alone = [run_alone(tts, p) for p in ps]
    eng = paged(tts, 4)
    handles = [eng.add_request(p) for p in ps]
    run_to_completion(eng, handles)
    for h, a in zip(handles, alone):
        assert torch.equal(torch.stack(h.frames), a), h.request_id
    s = eng.scheduler
    assert len(s.free_blocks) == eng.runner.num_blocks - 1 and sorted(s.free_blocks) == list(range(1, eng.runner.num_blocks))


def test_paged_staggered_arrivals_a_cancel_and_a_tight_pool(monkeypatch):
    """Compaction moves block-table rows; a pool too small for every row at once makes rows wait for blocks
    (their frames come later, the same frames)."""
    tts = fx.tts("cv06")
    reqs = prepared_mix(tts)
    alone = [run_alone(tts, p) for p in reqs]
    need = max(len(p.layout) for p in reqs) // BS + 2  # blocks of the longest request, + 1 to grow
    eng = paged(tts, 3, num_blocks=2 * need + 1, monkeypatch=monkeypatch)
    handles = [eng.add_request(reqs[0]), eng.add_request(reqs[1])]
    for _ in range(3):
        eng.step()
    handles.append(eng.add_request(reqs[2]))
    victim = eng.add_request(reqs[0], request_id="victim")
    handles.append(eng.add_request(reqs[3]))
    eng.step()
    eng.step()
    eng.abort("victim")
    run_to_completion(eng, handles + [victim])
    assert victim.status == RequestStatus.FINISHED_ABORTED
    for h, a in zip(handles, alone):
        assert torch.equal(torch.stack(h.frames), a), h.request_id
    assert len(eng.scheduler.free_blocks) == eng.runner.num_blocks - 1  # all back (free slots' table rows are
    # stale until the slot is used again: a padded graph replay points them at scratch first)


def test_paged_streamed_audio_equals_alone():
    tts, ps = prepared_lengths("base06")
    opts = StreamOptions(first_chunk_frames=1, chunk_frames=4)
    alone = [stream_alone(tts, p, opts) for p in ps]
    eng = paged(tts, 3)
    handles = [eng.add_request(p, opts) for p in ps]
    chunks = run_to_completion(eng, handles)
    for h, (codes, wav) in zip(handles, alone):
        assert torch.equal(torch.stack(h.frames), codes)
        got = torch.cat([torch.from_numpy(c.audio) for c in chunks if c.request_id == h.request_id]).numpy()
        assert got.shape == wav.shape and abs(got - wav).max() <= 1e-4  # vocoder calls of 3 rows vs 1 (float sums)


def test_a_full_pool_fails_the_newest_stream_and_the_others_finish(monkeypatch):
    tts = fx.tts("cv06")
    ps = tts.prepare_custom_voice(["Hi there.", "Hello."], ["vivian", "ryan"], do_sample=False,
                                  subtalker_dosample=False, max_new_tokens=80)
    alone = run_alone(tts, ps[0])
    full = (len(ps[0].layout) + 79) // BS + 1  # the first request's blocks when it is done: the pool (+ scratch)
    prompt = [len(p.layout) // BS + 1 for p in ps]
    assert full - prompt[0] >= prompt[1] + 1  # so the second is admitted (with a spare block for the first)
    eng = paged(tts, 2, num_blocks=1 + full, monkeypatch=monkeypatch)
    first = eng.add_request(ps[0])
    eng.step()
    second = eng.add_request(ps[1])
    run_to_completion(eng, [first, second])
    assert second.status == RequestStatus.FINISHED_ERROR and "out of KV-cache memory" in second.error
    assert first.status.reason == "length" and torch.equal(torch.stack(first.frames), alone)
    assert len(eng.scheduler.free_blocks) == eng.runner.num_blocks - 1


def test_graph_warm_up_frames_stay_inside_each_span():
    """Before capturing, the engine runs one frame per (batch, span) graph key: 84 here, more than the smallest
    span's 64 positions. Each starts at position 0; otherwise a paged row writes past the blocks its span holds
    (on a GPU a device-side assert, which stopped `q3tts serve --kv-block-size 64` from starting)."""
    from q3tts import TTS
    from q3tts.engine.runner import MIN_KV_SPAN
    tts = TTS.from_pretrained(fx.checkpoint("cv06"), device="cpu")
    runner = Engine(tts.ckpt, max_slots=32, max_seq_len=4096, kv_block_size=64).runner
    keys = runner.graph_keys()
    assert len(keys) > MIN_KV_SPAN
    with torch.inference_mode():
        runner.warm_up_frames(keys)
