"""Load benchmark for a running `q3tts serve` (or Ray Serve's proxy): streaming clients, JSON results.

    q3tts serve --model /tmp/ckpt-0.6B --max-concurrent 64 &
    python -m bench.load.load --url http://127.0.0.1:8000 --concurrency 1,4,16,64 --out bench/results/load.json
    python -m bench.load.load --url ... --rate 10,20 --duration 30 --seed 0           # open loop (Poisson arrivals)
    python -m bench.load.load --url ... --concurrency 256 --processes 4 --client-cpus 12-15

Two kinds of level:
- closed loop (`--concurrency C`): C clients each send `--requests` requests back to back, all starting together
  (a burst of C), or with `--spread S` client w's first request S * w / C seconds after the level's start (the issue
  texts' "starts spread over 1 s": --spread 1);
- open loop (`--rate R --duration S`): requests arrive as a Poisson process of R per second for S seconds (the
  arrival times drawn from `--seed`, so a run's request count and schedule are fixed), each sent at its time
  whether or not earlier ones are done; the level ends when the last one does. With `--rate-steps`, one level
  whose rate steps through the --rate list, S seconds each or `--duration S1,S2,...` one per step (an autoscaler's
  step test; add --per-request for each request's send time, first audio and stalls).

Every request streams pcm (or --format's), so every byte is timed as it arrives (aiohttp clients, made for many
concurrent connections; httpx's, kept as --client httpx, delayed requests by up to seconds from 64 streams on). Per
request:
time to first audio (first audio byte after the request was sent; with aiohttp also the client's own wait until the
request's headers were written, `client_send`, and first audio from then, `ttfa_from_send`: a burst of requests from one
client process goes out one after another), audio seconds, real-time factor (wall time /
audio seconds) and its stalls: a player that starts at the first byte and pauses whenever it has played all it
received; a stall is such a pause. Its total is also the buffer a listener needs after the first byte never to
pause (both are the largest lateness of a chunk against the audio before it). Per level: aggregate audio seconds
per wall second, first audio p50/p95/p99/max, the share of streams that stall (a total above --stall-tolerance-ms),
stall totals p50/p95/max and the longest single pause, and the client's own lag in sending open-loop requests
(its scheduled time to its send: large values mean the client, not the server, is the limit).

`--processes P` spreads the clients over P processes (closed loop: client w in process w mod P; open loop:
arrival i in process i mod P, the schedule drawn once), each pinned with os.sched_setaffinity to its own share of
`--client-cpus` where given; they start together (a barrier) and their requests are merged into one level.

Per level, the server's side from /metrics deltas (one server; behind Ray each scrape reaches one replica, so
use --no-server-metrics): its own time to first audio (from the request's arrival in the handler: the difference
to the client's is HTTP), the engine's steps and their mean time per phase (admit = prefill of newcomers, decode =
the frame, vocode = audio chunks), and the mean wait from arrival to admission.

Fix the audio length with --max-new-tokens (frames + 1, 12.5 frames per second); with a random-weight bench
checkpoint (bench/make_checkpoint.py, EOS disabled) every request then makes exactly that many frames.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import httpx

SR = 24000
FRAME_S = 1920 / SR  # seconds of audio per frame
TEXT = ("The quick brown fox jumps over the lazy dog. Speech synthesis servers must stream audio faster than "
        "people listen to it, for many listeners at once, without making anyone wait for the first word.")


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def summary(xs: list[float], scale: float = 1.0, digits: int = 4, qs: tuple[int, ...] = (50, 95)) -> dict:
    return {k: (None if v is None else round(v * scale, digits))
            for k, v in [*((f"p{q}", pct(xs, q)) for q in qs), ("max", max(xs) if xs else None)]}


class Player:
    """A listener that starts playing at the first byte and pauses whenever it has played all it received.

    feed(now, nbytes) for each read of s16 pcm; `stall_s` is the sum of its pauses, `gap_s` the longest one,
    `first_stall_at_s` the audio played when the first pause began (None: none).
    `stall_s` equals max over reads of (now - first) - (audio received before it): the buffer a player that never
    pauses would need, since each pause shifts the rest of the playback by its length.
    """

    def __init__(self, bytes_per_s: float = 2 * SR):
        self.bytes_per_s = bytes_per_s  # s16 pcm's; a compressed stream's average (timed_body)
        self.first: float | None = None
        self.dry_at = 0.0  # when the audio received so far runs out
        self.nbytes = 0
        self.stall_s = 0.0
        self.gap_s = 0.0
        self.first_stall_at_s: float | None = None

    def feed(self, now: float, nbytes: int) -> None:
        if self.first is None:
            self.first = self.dry_at = now
        elif now > self.dry_at:
            gap = now - self.dry_at
            if self.first_stall_at_s is None:
                self.first_stall_at_s = self.nbytes / self.bytes_per_s
            self.stall_s += gap
            self.gap_s = max(self.gap_s, gap)
            self.dry_at = now
        self.dry_at += nbytes / self.bytes_per_s
        self.nbytes += nbytes


async def one_request(client: aiohttp.ClientSession | httpx.AsyncClient, body: dict) -> dict:
    sent = time.time()  # wall clock, comparable across processes (--per-request)
    t0 = time.perf_counter()
    # a compressed format's audio length: the frames asked for (a random-weight checkpoint makes all of them)
    coded_s = None if body.get("response_format", "pcm") == "pcm" else (body["max_new_tokens"] - 1) * FRAME_S
    if isinstance(client, httpx.AsyncClient):
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            return {"sent": sent, **await timed_body(t0, r.status_code, r.headers, r.aiter_raw(), r.aread,
                                                     coded_s=coded_s)}
    on_wire: dict[str, float] = {}  # HEADERS_SENT: when aiohttp wrote the request's headers (client_trace)
    async with client.post("/v1/audio/speech", json=body, trace_request_ctx=on_wire) as r:
        return {"sent": sent, **await timed_body(t0, r.status, r.headers, r.content.iter_any(), r.read,
                                                 on_wire.get(HEADERS_SENT), coded_s)}


HEADERS_SENT = "headers_sent"


def client_trace() -> aiohttp.TraceConfig:
    """aiohttp's hook at the moment a request's headers are written: the client's own delay before it (its event
    loop busy with other streams, a new connection) is not the server's, and a burst of requests from one process
    goes out one after another."""
    async def headers_sent(session, ctx, params) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx[HEADERS_SENT] = time.perf_counter()

    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(headers_sent)
    return trace


async def timed_body(t0: float, status: int, headers, chunks: AsyncIterator[bytes], read,
                     on_wire: float | None = None, coded_s: float | None = None) -> dict:
    """One response's body read as it arrives -> the request's figures (on_wire: when its headers were written, the
    aiohttp client's; client_send_s is the wait before it). coded_s: a compressed format's audio length, its bytes
    taken as spread evenly over it (constant bit rate: its stalls approximate, its first byte exact)."""
    if status != 200:
        return {"error": f"{status}: {(await read())[:300].decode(errors='replace')}"}
    reads = []  # (time, bytes) of each read
    async for chunk in chunks:
        if chunk:
            reads.append((time.perf_counter(), len(chunk)))
    t1 = time.perf_counter()
    total = sum(n for _, n in reads)
    player = Player(total / coded_s) if coded_s and total else Player()
    for now, n in reads:
        player.feed(now, n)
    audio_s = player.nbytes / player.bytes_per_s
    return {"ttfa_s": (player.first or t1) - t0, "wall_s": t1 - t0, "audio_s": audio_s,
            "rtf": (t1 - t0) / audio_s if audio_s else None, "stall_s": player.stall_s, "gap_s": player.gap_s,
            "first_stall_at_s": player.first_stall_at_s,
            "replica": headers.get("x-q3tts-replica"), "client_send_s": None if on_wire is None else on_wire - t0,
            "request_id": headers.get("x-request-id")}  # the server's id (bench.load.phase_trace --join)


@asynccontextmanager
async def streaming_client(kind: str, url: str, connections: int, headers: dict):
    """The clients' one connection pool: aiohttp's, or httpx's (--client httpx); connections 0: no limit."""
    if kind == "httpx":
        n = connections + 4 if connections else None
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits,
                                     headers=headers) as client:
            yield client
    else:
        async with aiohttp.ClientSession(url, headers=headers, timeout=aiohttp.ClientTimeout(total=600),
                                         connector=aiohttp.TCPConnector(limit=connections + 4 if connections else 0),
                                         trace_configs=[client_trace()]) as client:
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
            if admitted else None,
            # graphs Dynamo traced or Inductor compiled or loaded during the level (0: nothing compiled while serving)
            "compiled_graphs": int(sum(d.get(f'q3tts_compiled_graphs_total{{kind="{k}"}}', 0)
                                       for k in ("traced", "cached", "compiled")))}


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of a Poisson process of `rate` per second, those before `duration`."""
    if not rate > 0 or not duration > 0:
        raise ValueError(f"rate and duration must be > 0, got rate={rate}, duration={duration}")
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def step_arrivals(rates: list[float], step_s: float | list[float], seed: int) -> list[float]:
    """Arrivals of a Poisson process whose rate steps through `rates`, `step_s` seconds each (or step k for step_s[k]
    seconds): one schedule, no gap between steps: step k is poisson_arrivals(rates[k], its length, seed + k)
    shifted by the steps before it."""
    lengths = step_s if isinstance(step_s, list) else [step_s] * len(rates)
    if len(lengths) != len(rates):
        raise ValueError(f"{len(rates)} rates need as many step lengths, got {len(lengths)}")
    starts = [sum(lengths[:k]) for k in range(len(rates))]
    return [starts[k] + t for k, r in enumerate(rates) for t in poisson_arrivals(r, lengths[k], seed + k)]


def parse_cpus(spec: str) -> list[int]:
    """'12-15' or '0,2,4-5' -> [12, 13, 14, 15] / [0, 2, 4, 5]."""
    cpus: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ValueError(f"--client-cpus: expected a list like 12-15 or 0,2,4-5, got {spec!r}") from None
    if not cpus:
        raise ValueError(f"--client-cpus: no CPU in {spec!r}")
    return cpus


def cpu_share(cpus: list[int], p: int, processes: int) -> list[int]:
    """Process p's own contiguous share of `cpus` (round robin over them when there are more processes)."""
    if processes >= len(cpus):
        return [cpus[p % len(cpus)]]
    lo, n = divmod(len(cpus), processes)
    start = p * lo + min(p, n)
    return cpus[start:start + lo + (p < n)]


def pin(cpus: list[int] | None) -> list[int] | None:
    """This process onto `cpus` where the OS allows it; -> the CPUs it runs on (None: not pinned)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # CPUs not in this machine or container
        print(f"bench.load.load: cannot pin to CPUs {cpus}: {e}", file=sys.stderr)
        return None
    return sorted(os.sched_getaffinity(0))


async def run_share(job: dict, start: float | None = None) -> dict:
    """One process's part of a level: job["workers"] closed-loop clients or job["arrivals"] [(i, t)] open-loop
    requests, from `start` (time.time(); default now). -> its requests and the wall-clock window it ran in."""
    body, results = job["body"], []
    open_loop = job["arrivals"] is not None
    connections = 0 if open_loop else len(job["workers"])

    async def send(b: dict, extra: dict) -> None:
        try:
            r = await one_request(client, b)
        except (httpx.HTTPError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            r = {"error": f"{type(e).__name__}: {e}"}
        results.append({**r, **extra})

    async with streaming_client(job["client"], job["url"], connections, job["headers"]) as client:
        t0 = time.time() if start is None else start

        async def worker(w: int) -> None:
            await asyncio.sleep(max(0.0, t0 + job["spread"] * w / job["concurrency"] - time.time()))
            for i in range(job["requests"]):
                await send(dict(body, seed=w * 1000 + i), {})

        async def arrive(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.time()))
            await send(dict(body, seed=i), {"send_lag_s": time.time() - (t0 + at)})

        await asyncio.sleep(max(0.0, t0 - time.time()))
        if open_loop:
            await asyncio.gather(*(arrive(i, at) for i, at in job["arrivals"]))
        else:
            await asyncio.gather(*(worker(w) for w in job["workers"]))
    return {"results": results, "t0": t0, "t1": time.time()}


def _child(job: dict, cpus: list[int] | None, barrier, out) -> None:
    """A client process: pin, wait for the others, run its share, send the result back."""
    pinned = pin(cpus)
    try:
        barrier.wait(timeout=120)
        res = asyncio.run(run_share(job))
        res["cpus"] = pinned
        out.put((job["index"], res))
    except BaseException as e:  # noqa: BLE001 (reported to the parent, which fails the level)
        out.put((job["index"], {"fatal": f"{type(e).__name__}: {e}"}))


def run_processes(jobs: list[dict], cpus: list[int] | None) -> list[dict]:
    """Run each job in its own process (spawned: no state of the parent's event loop), started together."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(len(jobs)), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(job, cpu_share(cpus, p, len(jobs)) if cpus else None, barrier, out),
                         daemon=True) for p, job in enumerate(jobs)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    try:
        while len(got) < len(jobs):
            try:
                i, res = out.get(timeout=5)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"bench.load.load: a client process died (exit {dead[0]})") from None
                continue
            if "fatal" in res:
                raise RuntimeError(f"bench.load.load: client process {i} failed: {res['fatal']}")
            got[i] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [got[i] for i in range(len(jobs))]


PER_REQUEST = ("sent", "ttfa_s", "client_send_s", "audio_s", "stall_s", "gap_s", "replica", "request_id", "error")


def level_summary(results: list[dict], wall: float, stall_tolerance_s: float) -> dict:
    ok = [r for r in results if "error" not in r]
    audio = sum(r["audio_s"] for r in ok)
    rtfs = [r["rtf"] for r in ok if r["rtf"] is not None]
    stalls = [r["stall_s"] for r in ok]
    lags = [r["send_lag_s"] for r in results if "send_lag_s" in r]
    sends = [r["client_send_s"] for r in ok if r.get("client_send_s") is not None]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "wall_s": round(wall, 3),
        "audio_s": round(audio, 3),
        "audio_s_per_s": round(audio / wall, 3) if wall else None,
        "ttfa_ms": summary([r["ttfa_s"] for r in ok], 1000, 1, (50, 95, 99)),
        # aiohttp: the client's own wait from a request's start to its headers written, and first audio from then
        "client_send_ms": summary(sends, 1000, 1, (50, 95)) if sends else None,
        "ttfa_from_send_ms": summary([r["ttfa_s"] - r["client_send_s"] for r in ok if r.get("client_send_s") is not None],
                                     1000, 1, (50, 95, 99)) if sends else None,
        "rtf": summary(rtfs),
        "all_faster_than_real_time": bool(rtfs) and max(rtfs) < 1.0,
        # the streams whose player paused for more than the tolerance in all; the pauses' total and longest
        "stalled_share": round(sum(s > stall_tolerance_s for s in stalls) / len(ok), 4) if ok else None,
        "stall_ms": summary(stalls, 1000, 1),
        "stall_gap_ms": summary([r["gap_s"] for r in ok], 1000, 1),
        # where the stalled streams' first pause began, in audio played (a start-up gap or one under way)
        "first_stall_at_ms": summary([r["first_stall_at_s"] for r in ok if r.get("first_stall_at_s") is not None
                                      and r["stall_s"] > stall_tolerance_s], 1000, 1),
        "send_lag_ms": summary(lags, 1000, 1, (50, 99)) if lags else None,
        "mean_audio_s_per_request": round(audio / len(ok), 3) if ok else None,
        # Ray Serve: requests per replica (the x-q3tts-replica header); {null: n} for a single server
        "replicas": dict(Counter(r.get("replica") for r in ok)),
    }


async def _metrics(url: str, headers: dict, enabled: bool) -> dict:
    if not enabled:
        return {}
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as c:
        return scrape((await c.get("/metrics")).text)


async def run_level(url: str, body: dict, headers: dict, *, concurrency: int = 0, requests_per_client: int = 1,
                    rate: float | list[float] = 0.0, duration: float | list[float] = 0.0, seed: int = 0, processes: int = 1,
                    cpus: list[int] | None = None, server_metrics: bool = True, client_kind: str = "aiohttp",
                    stall_tolerance_s: float = 0.001, per_request: bool = False, spread: float = 0.0) -> dict:
    """One level: `concurrency` closed-loop clients (client w's first request `spread` * w / concurrency s after
    the start), or (rate > 0) Poisson arrivals for `duration` s; a list of rates: one schedule stepping through them,
    `duration` s each or a list of one per step (step_arrivals)."""
    if rate:
        steps = isinstance(rate, list)
        arrivals = list(enumerate(step_arrivals(rate, duration, seed) if steps else
                                  poisson_arrivals(rate, duration, seed)))
        shares = [{"workers": None, "arrivals": arrivals[p::processes]} for p in range(processes)]
        head = {"mode": "poisson-steps" if steps else "poisson", "rate": rate, "duration_s": duration, "seed": seed}
    else:
        shares = [{"workers": list(range(concurrency))[p::processes], "arrivals": None} for p in range(processes)]
        head = {"mode": "closed", "concurrency": concurrency, "requests_per_client": requests_per_client,
                "spread_s": spread}
    jobs = [{**s, "index": p, "url": url, "body": body, "headers": headers, "client": client_kind,
             "requests": requests_per_client, "concurrency": concurrency, "spread": spread}
            for p, s in enumerate(shares)]
    before = await _metrics(url, headers, server_metrics)
    if processes == 1:
        parts = [await run_share(jobs[0])]
    else:
        parts = await asyncio.get_running_loop().run_in_executor(None, run_processes, jobs, cpus)
    after = await _metrics(url, headers, server_metrics)
    results = [r for part in parts for r in part["results"]]
    wall = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
    return {**head, "processes": processes, **level_summary(results, wall, stall_tolerance_s),
            "client_cpus": [p.get("cpus") for p in parts] if processes > 1 else None,
            "server": server_side(before, after) if server_metrics else None,
            **({"per_request": sorted(({k: r.get(k) for k in PER_REQUEST} for r in results),
                                      key=lambda r: r["sent"] or 0),
                "t0": min(p["t0"] for p in parts)} if per_request else {})}  # t0: the schedule's start (time.time())


async def request_body(a, headers: dict) -> tuple[dict, dict]:
    async with httpx.AsyncClient(base_url=a.url, timeout=30, headers=headers) as c:
        model = (await c.get("/v1/models")).json()["data"][0]
        voices = (await c.get("/v1/audio/voices")).json()["data"]
    body = {"model": model["id"], "input": a.text, "response_format": a.format, "max_new_tokens": a.max_new_tokens}
    if a.voice or voices:
        body["voice"] = a.voice or voices[0]["id"]
    if model["tts_model_type"] == "voice_design":
        body["instructions"] = a.instructions
    if a.greedy:
        body.update(do_sample=False, subtalker_dosample=False)
    return model, body


async def main_async(a) -> dict:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    model, body = await request_body(a, headers)
    common = {"processes": a.processes, "cpus": a.client_cpus, "server_metrics": a.server_metrics,
              "client_kind": a.client, "stall_tolerance_s": a.stall_tolerance_ms / 1000,
              "per_request": a.per_request}
    if a.warmup:
        await run_level(a.url, dict(body, max_new_tokens=16), headers, concurrency=1,
                        **dict(common, processes=1, per_request=False))
    levels = []
    for conc in a.concurrency or []:
        n = a.requests if a.requests else max(2, 64 // conc)
        levels.append(await run_level(a.url, body, headers, concurrency=conc, requests_per_client=n,
                                      spread=a.spread, **common))
        print(json.dumps({k: v for k, v in levels[-1].items() if k != "per_request"}), file=sys.stderr, flush=True)
    for rate in ([a.rate] if a.rate_steps else a.rate or []):
        levels.append(await run_level(a.url, body, headers, rate=rate, duration=a.duration, seed=a.seed, **common))
        print(json.dumps({k: v for k, v in levels[-1].items() if k != "per_request"}), file=sys.stderr, flush=True)
    return {"url": a.url, "client": a.client, "processes": a.processes, "client_cpus": a.client_cpus,
            "stall_tolerance_ms": a.stall_tolerance_ms, "model": model,
            "body": {k: v for k, v in body.items() if k != "input"}, "text_chars": len(a.text), "levels": levels}


def _numbers(kind):
    return lambda s: [kind(x) for x in s.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=_numbers(int), default=None,
                    help="closed-loop levels: clients at once, e.g. 1,4,16,64 (the default unless --rate)")
    ap.add_argument("--requests", type=int, default=0, help="requests per client (default: max(2, 64 / C))")
    ap.add_argument("--spread", type=float, default=0.0, help="closed loop: client w of C starts S * w / C s after "
                    "the level (default 0: all at once, a burst)")
    ap.add_argument("--rate", type=_numbers(float), default=None, help="open-loop levels: Poisson arrivals per s")
    ap.add_argument("--duration", type=_numbers(float), default=[30.0],
                    help="open loop: seconds of arrivals per level (with --rate-steps: one for all steps, or one each)")
    ap.add_argument("--seed", type=int, default=0, help="open loop: the arrival schedule's seed")
    ap.add_argument("--rate-steps", action="store_true",
                    help="open loop: one level whose rate steps through --rate, --duration s each")
    ap.add_argument("--processes", type=int, default=1, help="client processes (results merged)")
    ap.add_argument("--client-cpus", type=parse_cpus, default=None,
                    help="CPUs for the client processes, shared out between them, e.g. 12-15")
    ap.add_argument("--stall-tolerance-ms", type=float, default=1.0,
                    help="a stream stalls if its player paused longer than this in all (read granularity)")
    ap.add_argument("--max-new-tokens", type=int, default=126, help="frames + 1 per request (126: 10 s of audio)")
    ap.add_argument("--format", default="pcm", choices=["pcm", "mp3", "opus", "aac", "flac", "wav"],
                    help="response_format; past pcm the bytes are taken as spread evenly over the frames asked for "
                         "(its stalls approximate: a random-weight checkpoint makes every frame)")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--voice", default=None, help="default: the first listed voice")
    ap.add_argument("--instructions", default="A clear, neutral voice.", help="VoiceDesign models only")
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--no-server-metrics", dest="server_metrics", action="store_false",
                    help="skip /metrics deltas (behind Ray Serve each scrape reaches one replica of several)")
    ap.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp",
                    help="the streaming clients' HTTP library (httpx, not the server, delays requests from 64 streams "
                         "on: BENCHMARKS.md)")
    ap.add_argument("--per-request", action="store_true",
                    help="each level also lists its requests: send time (time.time()), first audio, stalls, replica")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    a = ap.parse_args(argv)
    if a.processes < 1:
        ap.error(f"--processes must be >= 1, got {a.processes}")
    if a.rate is not None and (min(a.rate) <= 0 or min(a.duration) <= 0):
        ap.error("--rate values and --duration must be > 0")
    if len(a.duration) > 1 and not (a.rate_steps and a.rate is not None and len(a.duration) == len(a.rate)):
        ap.error(f"several --duration values need --rate-steps and one per --rate value, got {a.duration}")
    a.duration = a.duration if len(a.duration) > 1 else a.duration[0]
    if a.rate_steps and a.rate is None:
        ap.error("--rate-steps needs --rate r1,r2,...")
    if a.concurrency is None and a.rate is None:
        a.concurrency = [1, 4, 16, 64]
    if a.concurrency is not None and min(a.concurrency) < 1:
        ap.error("--concurrency values must be >= 1")
    if not 0 <= a.spread < float("inf"):
        ap.error(f"--spread must be a number of seconds >= 0, got {a.spread}")
    if a.client_cpus and a.processes == 1:
        pin(a.client_cpus)
    result = asyncio.run(main_async(a))
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
