"""bench/load/text_stream.py against a stand-in WebSocket server that speaks its protocol: every session counted, the
warm-up utterances not, the counted ones timed from when every session was warm (their starts spread), and the
client's own lateness; first audio also from the token that completes frame 0's text, found by the server's own
incremental tokenizer."""

import asyncio
import json

import pytest

pytest.importorskip("websockets")
from websockets.asyncio.server import serve  # noqa: E402

from bench.load.text_stream import TEXT, frame0_piece, level, llm_tokens  # noqa: E402


async def speaker(ws):
    """An utterance's audio once its text is done: two chunks of 10 ms of int16 silence, then audio.done."""
    served = 0
    async for msg in ws:
        if json.loads(msg)["type"] == "input.done":
            served += 1
            for _ in range(2):
                await ws.send(bytes(480))
            await ws.send(json.dumps({"type": "audio.done", "finish_reason": "length", "utterance": served}))


def test_warm_sessions_count_only_their_later_utterances():
    async def run():
        async with serve(speaker, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            return await level(f"ws://127.0.0.1:{port}", 10000.0, 3, 2, {}, warmup=1, spread=0.3)

    res = asyncio.run(run())
    assert res["sessions"] == 3 and res["utterances"] == 6 and res["warmup_utterances"] == 1
    # the third session starts 200 ms after the first (spread over 300 ms): the wall counts it, its first audio not
    assert res["spread_s"] == 0.3 and res["ttfa_ms"]["max"] < 150
    assert res["finish_reasons"] == ["length"]
    assert res["audio_s_per_s"] > 0 and res["ttfa_ms"]["p50"] >= 0
    # the client's lateness for its own schedule (10000 tokens/s): measured per utterance, never negative
    assert 0 <= res["send_lag_ms"]["p50"] <= res["send_lag_ms"]["max"]
    # the stand-in speaks at input.done, after every token: first audio from the text ahead is shorter by the tokens
    # between the frame-0 token and the last (at 10000 tokens/s: 0.1 ms each)
    assert res["text_ahead_token"] == frame0_piece(llm_tokens(TEXT)) > 0
    assert 0 <= res["ttfa_text_ahead_ms"]["p50"] <= res["ttfa_ms"]["p50"]


def test_frame0_piece_is_where_the_committed_ids_pass_the_prompt():
    """The role ("assistant\\n": 2 ids) and the first word make the prompt (3 ids); a word commits only once the next
    piece begins, and frame 0 needs one id more: "Voic", "e ag" (Voice), "ents", " spe" (agents) -> index 3."""
    assert llm_tokens(TEXT)[:4] == ["Voic", "e ag", "ents", " spe"] and frame0_piece(llm_tokens(TEXT)) == 3
    assert frame0_piece(["Hi"]) == 1  # one word and no more text: only input.done commits it
    assert frame0_piece(llm_tokens(TEXT), needed=4) == 4
