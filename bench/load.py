"""Load benchmark for a running `q3tts serve`: concurrent streaming clients, JSON results.

    q3tts serve --model /tmp/ckpt-0.6B --max-concurrent 64 &
    python -m bench.load --url http://127.0.0.1:8000 --concurrency 1,4,16,64 --out bench/results/load.json

For each concurrency C, C clients each send requests back to back (streaming pcm, so every byte is timed
as it arrives; one aiohttp connection pool, made for many concurrent connections: httpx's, used before and
kept as --client httpx, delayed requests by up to seconds from 64 streams on) until
`--requests` requests per client are done. Per request: time to first audio (first audio byte after the
request was sent), audio seconds, real-time factor (wall time / audio seconds),
and the playback buffer it needs: how far behind a player that started at the first byte the stream ever
fell, i.e. how long a listener must buffer after the first byte to never stall (0 = playable at once).
Per level: aggregate audio seconds per wall second, p50/p95/max of each.

Per level, the server's side from /metrics deltas: its own time to first audio (from the request's arrival
in the handler: the difference to the client's is HTTP), the engine's steps and their mean time per phase
(admit = prefill of newcomers, decode = the frame, vocode = audio chunks), and the mean wait from arrival to
admission.

Fix the audio length with --max-new-tokens (frames + 1, 12.5 frames per second); with a random-weight
bench checkpoint (bench/make_checkpoint.py, EOS disabled) every request then makes exactly that many frames.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import httpx

SR = 24000
TEXT = ("The quick brown fox jumps over the lazy dog. Speech synthesis servers must stream audio faster than "
        "people listen to it, for many listeners at once, without making anyone wait for the first word.")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def summary(xs: list[float], scale: float = 1.0, digits: int = 4) -> dict:
    return {k: (None if v is None else round(v * scale, digits))
            for k, v in (("p50", pct(xs, 50)), ("p95", pct(xs, 95)), ("max", max(xs) if xs else None))}


async def one_request(client: aiohttp.ClientSession | httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    if isinstance(client, httpx.AsyncClient):
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            return await timed_body(t0, r.status_code, r.headers, r.aiter_raw(), r.aread)
    async with client.post("/v1/audio/speech", json=body) as r:
        return await timed_body(t0, r.status, r.headers, r.content.iter_any(), r.read)


async def timed_body(t0: float, status: int, headers, chunks: AsyncIterator[bytes], read) -> dict:
    """One response's body read as it arrives -> the request's figures."""
    if status != 200:
        return {"error": f"{status}: {(await read())[:300].decode(errors='replace')}"}
    first = None
    nbytes = 0
    stall = 0.0
    async for chunk in chunks:
        if not chunk:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        else:  # a player started at the first byte has played this much by now
            stall = max(stall, (now - first) - nbytes / 2 / SR)
        nbytes += len(chunk)
    t1 = time.perf_counter()
    audio_s = nbytes / 2 / SR
    return {"ttfa_s": (first or t1) - t0, "wall_s": t1 - t0, "audio_s": audio_s,
            "rtf": (t1 - t0) / audio_s if audio_s else None, "buffer_s": max(stall, 0.0),
            "replica": headers.get("x-q3tts-replica")}


@asynccontextmanager
async def streaming_client(kind: str, url: str, concurrency: int, headers: dict):
    """The clients' one connection pool: aiohttp's, or httpx's (--client httpx)."""
    if kind == "httpx":
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits,
                                     headers=headers) as client:
            yield client
    else:
        async with aiohttp.ClientSession(url, headers=headers, timeout=aiohttp.ClientTimeout(total=600),
                                         connector=aiohttp.TCPConnector(limit=concurrency + 4)) as client:
            yield client


def scrape(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def server_side(before: dict[str, float], after: dict[str, float]) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps, ttfa_n, admitted = d.get("q3tts_engine_steps_total", 0), d.get("q3tts_time_to_first_audio_seconds_count", 0), \
        d.get("q3tts_admitted_requests_total", 0)
    per_step = {p: round(1000 * d.get(f'q3tts_engine_step_seconds_total{{phase="{p}"}}', 0) / steps, 3) if steps else None
                for p in ("admit", "decode", "vocode")}
    return {"engine_steps": int(steps), "step_ms_mean": per_step,
            "ttfa_ms_mean": round(1000 * d["q3tts_time_to_first_audio_seconds_sum"] / ttfa_n, 1) if ttfa_n else None,
            "admission_wait_ms_mean": round(1000 * d.get("q3tts_admission_wait_seconds_total", 0) / admitted, 1)
            if admitted else None}


async def run_level(url: str, concurrency: int, requests_per_client: int, body: dict, headers: dict,
                    server_metrics: bool = True, client_kind: str = "aiohttp") -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as c:
        before = scrape((await c.get("/metrics")).text) if server_metrics else {}
    async with streaming_client(client_kind, url, concurrency, headers) as client:
        results: list[dict] = []

        async def worker(w: int) -> None:
            for i in range(requests_per_client):
                b = dict(body, seed=w * 1000 + i)
                try:
                    results.append(await one_request(client, b))
                except (httpx.HTTPError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                    results.append({"error": f"{type(e).__name__}: {e}"})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t0
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as c:
        after = scrape((await c.get("/metrics")).text) if server_metrics else {}
    ok = [r for r in results if "error" not in r]
    audio = sum(r["audio_s"] for r in ok)
    rtfs = [r["rtf"] for r in ok if r["rtf"] is not None]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "wall_s": round(wall, 3),
        "audio_s": round(audio, 3),
        "audio_s_per_s": round(audio / wall, 3) if wall else None,
        "ttfa_ms": summary([r["ttfa_s"] for r in ok], 1000, 1),
        "rtf": summary(rtfs),
        "all_faster_than_real_time": bool(rtfs) and max(rtfs) < 1.0,
        "buffer_needed_ms": summary([r["buffer_s"] for r in ok], 1000, 1),
        "mean_audio_s_per_request": round(audio / len(ok), 3) if ok else None,
        "server": server_side(before, after) if server_metrics else None,
        # Ray Serve: requests per replica (the x-q3tts-replica header); {null: n} for a single server
        "replicas": dict(Counter(r.get("replica") for r in ok)),
    }


async def main_async(a) -> dict:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    async with httpx.AsyncClient(base_url=a.url, timeout=30, headers=headers) as c:
        model = (await c.get("/v1/models")).json()["data"][0]
        voices = (await c.get("/v1/audio/voices")).json()["data"]
    body = {"model": model["id"], "input": a.text, "response_format": "pcm", "max_new_tokens": a.max_new_tokens}
    if a.voice or voices:
        body["voice"] = a.voice or voices[0]["id"]
    if model["tts_model_type"] == "voice_design":
        body["instructions"] = a.instructions
    if a.greedy:
        body.update(do_sample=False, subtalker_dosample=False)
    if a.warmup:
        await run_level(a.url, 1, 1, dict(body, max_new_tokens=16), headers, a.server_metrics, a.client)
    levels = []
    for conc in a.concurrency:
        n = a.requests if a.requests else max(2, 64 // conc)
        res = await run_level(a.url, conc, n, body, headers, a.server_metrics, a.client)
        print(json.dumps(res), file=sys.stderr, flush=True)
        levels.append(res)
    return {"url": a.url, "client": a.client, "model": model, "body": {k: v for k, v in body.items() if k != "input"},
            "text_chars": len(a.text), "levels": levels}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=0, help="requests per client (default: max(2, 64 / C))")
    ap.add_argument("--max-new-tokens", type=int, default=126, help="frames + 1 per request (126: 10 s of audio)")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--voice", default=None, help="default: the first listed voice")
    ap.add_argument("--instructions", default="A clear, neutral voice.", help="VoiceDesign models only")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--no-server-metrics", dest="server_metrics", action="store_false",
                    help="skip /metrics deltas (behind Ray Serve each scrape reaches one replica of several)")
    ap.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the streaming clients' HTTP library; httpx was the load generator's until 2026-11-24, and "
                         "from 64 streams on it, not the server, delayed requests by seconds (BENCHMARKS.md)")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    a = ap.parse_args(argv)
    result = asyncio.run(main_async(a))
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
