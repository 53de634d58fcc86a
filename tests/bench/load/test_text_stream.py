"""bench/load/text_stream.py against a stand-in WebSocket server that speaks its protocol: every session counted, the
warm-up utterances not, the counted ones timed from when every session was warm (their starts spread), and the
client's own lateness."""

import asyncio
import json

import pytest

pytest.importorskip("websockets")
from websockets.asyncio.server import serve  # noqa: E402

from bench.load.text_stream import level  # noqa: E402


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
