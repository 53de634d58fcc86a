"""`q3tts serve --batch-invariant` on a GPU: a seeded request's PCM is byte-identical alone and beside 63 other streams
(the real app, its settings parsed from the command line, on uvicorn; random 0.6B-CustomVoice weights at the real
dimensions, bf16). tests/engine/test_invariant_gpu.py checks the engine underneath."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from .live import SPF, serve

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEEDED = {"seed": 1234, "temperature": 0.9, "top_k": 40, "subtalker_temperature": 1.1, "max_new_tokens": 25}
OTHERS = 63


@pytest.fixture(scope="module")
def live(real_checkpoint, tmp_path_factory):
    from q3tts import invariant
    from q3tts.server.app import create_app, load_model
    from q3tts.server.settings import parse_args
    settings = parse_args(["--model", str(real_checkpoint("0.6B-CustomVoice")), "--device", "cuda",
                           "--batch-invariant", "--max-concurrent", "64", "--max-seq-len", "128", "--no-warmup",
                           "--voice-dir", str(tmp_path_factory.mktemp("voices-inv"))], environ={})
    s = serve(create_app(load_model(settings), settings), "uvicorn-invariant")
    yield s
    s.stop()
    invariant.set_enabled(False)  # process-wide: the other modules' engines run the default mode


def pcm(client, text: str, voice: str, **extra) -> bytes:
    return client.audio.speech.create(model="q3tts", input=text, voice=voice, response_format="pcm",
                                      extra_body=extra).content


def other(i: int) -> dict:
    """Stream i of the 63: its own text, speaker and sampling, 60-72 frames (longer than the seeded request's 24)."""
    voices = ("vivian", "ryan", "serena", "aiden", "eric", "dylan", "uncle_fu", "ono_anna", "sohee")
    samplers = ({"do_sample": False, "subtalker_dosample": False}, {"seed": i, "top_k": 0, "top_p": 0.8},
                {"seed": i, "repetition_penalty": 1.3, "subtalker_top_k": 5}, {"seed": i, "temperature": 0.7})
    return dict(text=f"Stream number {i} speaks beside the others.", voice=voices[i % len(voices)],
                max_new_tokens=61 + 3 * (i % 5), **samplers[i % 4])


def test_seeded_request_alone_equals_beside_63_streams(live):
    """The seeded request alone; then 63 streams of other texts, speakers, samplers and lengths, and once all of them
    run (63 active slots) the seeded request again: it ends before any of them, and its PCM is the same bytes."""
    client = live.client()
    text, voice = "The same request, the same audio, on a busy server.", "ryan"
    alone = pcm(client, text, voice, **SEEDED)
    assert len(alone) == 24 * SPF * 2  # 16-bit samples; the random weights never pick EOS: every frame is made
    done: dict[int, float] = {}
    lock = threading.Lock()

    def run(i: int) -> bytes:
        kw = other(i)
        out = pcm(client, kw.pop("text"), kw.pop("voice"), **kw)
        with lock:
            done[i] = time.perf_counter()
        return out

    with ThreadPoolExecutor(OTHERS) as pool:
        futures = [pool.submit(run, i) for i in range(OTHERS)]
        deadline = time.time() + 120
        while live.stats.active_slots < OTHERS:
            assert time.time() < deadline and not done, f"the 63 streams never ran together: {live.stats}"
            time.sleep(0.005)
        beside = pcm(client, text, voice, **SEEDED)
        end = time.perf_counter()
        lengths = [len(f.result()) for f in futures]
    assert min(done.values()) > end  # every other stream was still running when it ended
    assert lengths == [(other(i)["max_new_tokens"] - 1) * SPF * 2 for i in range(OTHERS)]
    assert beside == alone
    live.wait_idle()
