"""Streaming-text benchmark: simulated LLMs feed a running `q3tts serve` token by token over the WebSocket.

    q3tts serve --model /tmp/ckpt-0.6B --max-concurrent 32 &
    python -m bench.load.text_stream --url ws://127.0.0.1:8000 --rates 15,50,200 --sessions 1,32 --out text.json

For each (tokens per second R, sessions S): S sessions at once, each speaking `--utterances` utterances in a
row (after --warmup-utterances uncounted ones, every session open; then all start at once, or their first counted
ones spread evenly over --spread s); an utterance's text (~4 characters a token, as an LLM's) is sent one token every
1/R s, then input.done.
Per utterance: time from its first text token to its first audio byte, and from the send of the token that completes
its frame 0's text (frame0_piece; before it, first audio waits for the text itself); its playback buffer: how far
behind a player that started at the first byte the audio ever fell (0 = it never stalls), split into the part while
text was still arriving and the part after every token had been sent; and how late the client itself sent its
tokens (`send_lag_ms`: a saturated client shows here, not in the server). Fix the audio length with --max-new-tokens (a random-weight checkpoint never samples EOS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from websockets.asyncio.client import connect

from bench.load.load import summary
from q3tts.inputs.prompt import TextTokenizer
from q3tts.inputs.text import IncrementalTokenizer
from q3tts.randomckpt import REFERENCE

SR = 24000
TEXT = ("Voice agents speak an answer while the language model is still writing it, so the speech starts after "
        "the first few words instead of the whole paragraph, and it never has to wait for text once the text is "
        "ahead of it.")


def llm_tokens(text: str, size: int = 4) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def frame0_piece(pieces: list[str], needed: int = 3) -> int:
    """The index of the piece after which the server can run an utterance's frame 0: its incremental tokenizer
    (q3tts.inputs.text, the Qwen tokenizer) has committed the prompt's `needed` ids (PromptBuilder.needed: the role
    and the first word for a voice without an ICL reference) and one more, the first trailing text token. A word's
    ids commit only once the next piece begins, so this is a few pieces in; len(pieces): only input.done commits
    them."""
    tok, n = IncrementalTokenizer(TextTokenizer(REFERENCE / "tokenizer")), 0
    for i, piece in enumerate(pieces):
        n += len(tok.push(piece))
        if n > needed:
            return i
    return len(pieces)


async def utterance(ws, rate: float, tokens: list[str], ahead_at: int = 0) -> dict:
    """Send the tokens at `rate` per second while receiving; -> this utterance's timings. ahead_at: the index of the
    token that completes frame 0's text (frame0_piece)."""
    t0 = time.perf_counter()
    sent_all, send_lag, ahead = None, 0.0, t0

    async def feed():
        nonlocal sent_all, send_lag, ahead
        for i, tok in enumerate(tokens):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            send_lag = max(send_lag, time.perf_counter() - (t0 + i / rate))  # this client late for its schedule
            if i == ahead_at:
                ahead = time.perf_counter()
            await ws.send(json.dumps({"type": "input.text", "text": tok}))
        await ws.send(json.dumps({"type": "input.done"}))
        sent_all = time.perf_counter()
        if ahead_at >= len(tokens):
            ahead = sent_all

    feeder = asyncio.ensure_future(feed())
    first, samples, lag_while, lag_after, reason = None, 0, 0.0, 0.0, None
    while True:
        msg = await ws.recv()
        now = time.perf_counter()
        if isinstance(msg, bytes):
            if first is None:
                first = now
            # a player started at the first byte has played (now - first) s; the audio that arrived before this
            # message covers samples / SR s: the gap is how long it would have stalled
            lag = max(0.0, (now - first) - samples / SR)
            if sent_all is None or now < sent_all:
                lag_while = max(lag_while, lag)
            else:
                lag_after = max(lag_after, lag)
            samples += len(msg) // 2
            continue
        m = json.loads(msg)
        if m["type"] == "audio.done":
            reason = m["finish_reason"]
            break
        if m["type"] == "error":
            raise RuntimeError(m)
    await feeder
    return {"ttfa": None if first is None else first - t0, "ttfa_ahead": None if first is None else first - ahead,
            "audio_s": samples / SR, "wall_s": time.perf_counter() - t0,
            "stall_while_text_s": lag_while, "stall_after_text_s": lag_after, "finish_reason": reason,
            "send_lag_s": send_lag}


async def session(url: str, rate: float, n: int, config: dict, warmup: int = 0,
                  ready: asyncio.Barrier | None = None, delay: float = 0.0,
                  ahead_at: int = 0) -> tuple[float, list[dict]]:
    """One WebSocket session: `warmup` utterances not counted, then (every session together, after `ready`, and
    `delay` s) n; -> when its counted utterances could begin (before the delay), their timings."""
    async with connect(url + "/v1/audio/speech/stream", max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.config", **config}))
        for _ in range(warmup):
            await utterance(ws, rate, llm_tokens(TEXT), ahead_at)
        if ready is not None:
            await ready.wait()
        start = time.perf_counter()
        await asyncio.sleep(delay)
        return start, [await utterance(ws, rate, llm_tokens(TEXT), ahead_at) for _ in range(n)]


async def level(url: str, rate: float, sessions: int, n: int, config: dict, warmup: int = 0,
                spread: float = 0.0) -> dict:
    """spread: the sessions' first counted utterances start evenly over this many seconds (0: all at once). The
    text ahead from TEXT's frame0_piece: a voice without an ICL reference (config's voice a speaker or an x-vector)."""
    ready = asyncio.Barrier(sessions) if warmup else None
    ahead_at = frame0_piece(llm_tokens(TEXT))
    t0 = time.perf_counter()
    done = await asyncio.gather(*(session(url, rate, n, config, warmup, ready, spread * i / sessions, ahead_at)
                                  for i in range(sessions)))
    t0 = min(start for start, _ in done) if warmup else t0  # with warm-up: when every session was open and warm
    runs = [u for _, s in done for u in s]
    wall = time.perf_counter() - t0
    return {"tokens_per_s": rate, "sessions": sessions, "utterances": len(runs),
            "audio_s_per_s": round(sum(u["audio_s"] for u in runs) / wall, 2),
            "ttfa_ms": summary([u["ttfa"] for u in runs if u["ttfa"] is not None], 1000, 1),
            "ttfa_text_ahead_ms": summary([u["ttfa_ahead"] for u in runs if u["ttfa_ahead"] is not None], 1000, 1),
            "text_ahead_token": ahead_at,
            "stall_while_text_ms": summary([u["stall_while_text_s"] for u in runs], 1000, 1),
            "stall_after_text_ms": summary([u["stall_after_text_s"] for u in runs], 1000, 1),
            "send_lag_ms": summary([u["send_lag_s"] for u in runs], 1000, 1), "warmup_utterances": warmup,
            "spread_s": spread,
            "finish_reasons": sorted({u["finish_reason"] for u in runs})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="ws://127.0.0.1:8000")
    ap.add_argument("--rates", default="15,50,200", help="simulated LLM tokens per second")
    ap.add_argument("--sessions", default="1,32")
    ap.add_argument("--utterances", type=int, default=3, help="per session, one after the other")
    ap.add_argument("--warmup-utterances", type=int, default=0,
                    help="per session before the counted ones (not counted): the sessions open and warm, as a voice "
                         "agent's are, then every session starts its counted utterances at once")
    ap.add_argument("--spread", type=float, default=0.0,
                    help="s over which the sessions' first counted utterances start (0: all at once, a burst)")
    ap.add_argument("--voice", default="vivian")
    ap.add_argument("--max-new-tokens", type=int, default=100, help="frames + 1 per utterance")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    config = {"voice": a.voice, "max_new_tokens": a.max_new_tokens}
    out = []
    for s in [int(x) for x in a.sessions.split(",")]:
        for r in [float(x) for x in a.rates.split(",")]:
            res = asyncio.run(level(a.url, r, s, a.utterances, config, a.warmup_utterances, a.spread))
            out.append(res)
            ahead = res["ttfa_text_ahead_ms"]
            print(f"{int(r):>4} tok/s {s:>3} sessions: first audio p50 {res['ttfa_ms']['p50']} p95 "
                  f"{res['ttfa_ms']['p95']} ms (once the text is ahead, token {res['text_ahead_token']}: p50 "
                  f"{ahead['p50']} p95 {ahead['p95']} ms); stall after text p95 {res['stall_after_text_ms']['p95']} "
                  f"ms, while text arrives p95 {res['stall_while_text_ms']['p95']} ms; {res['audio_s_per_s']} audio "
                  f"s/s; the client's send lag p95 {res['send_lag_ms']['p95']} ms",
                  file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"text_tokens": len(llm_tokens(TEXT)), "levels": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
