"""Soak test for a running `q3tts serve`: minutes at twice its capacity, with disconnects, cancels and bursts.

    q3tts serve --model /tmp/ckpt-0.6B --max-concurrent 16 &
    python -m bench.load.soak --url http://127.0.0.1:8000 --duration 600 --out soak.json

Capacity is the server's engine slots (q3tts_max_slots on /metrics, i.e. --max-concurrent); `--load 2`
runs 2 x slots streaming clients back to back. Each request (streaming pcm) is one of:
  - read to the end;
  - disconnected mid-stream (probability --disconnect) after a random number of chunks;
  - cancelled before its first audio (probability --cancel), i.e. while queued or being prefilled.
Every --burst-every seconds, --burst-size extra requests arrive at once.

Per request: status, time to first audio (request sent -> first audio byte), bytes, outcome. Every
--poll seconds /metrics gives active slots, queue depth, process RSS and GPU memory. At the end, once
the clients are gone, the slots must drain to 0 (a slot still held is leaked), and memory after warm-up
must stay flat: growth = mean of the last quarter of samples - mean of the first quarter after warm-up.

Verdict (exit code 1 if it fails): no 5xx other than 503 queue-full (each with Retry-After), no leaked
slot, no request error other than those, RSS growth <= --max-rss-growth-mb and GPU growth <=
--max-gpu-growth-mb. A table goes to stderr, everything to --out (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Speech servers must stream audio faster than people listen to it, for many listeners at once.",
         "A short one.",
         "Numbers like 42 and 1999, and a question: does it hold under load, for minutes on end?"]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text page: name -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


class Soak:
    def __init__(self, a: argparse.Namespace, slots: int):
        self.a, self.slots = a, slots
        self.rng = random.Random(a.seed)
        self.records: list[dict] = []
        self.samples: list[dict] = []
        self.t0 = time.perf_counter()
        self.stop_at = self.t0 + a.duration
        self.n = 0

    def body(self) -> dict:
        self.n += 1
        frames = self.rng.randint(self.a.min_frames, self.a.max_frames)
        body = {"model": "q3tts", "input": self.rng.choice(TEXTS), "response_format": "pcm",
                "max_new_tokens": frames + 1, "seed": self.n}
        if self.a.voice:
            body["voice"] = self.a.voice
        if self.a.instructions:
            body["instructions"] = self.a.instructions
        return body

    async def one(self, client: httpx.AsyncClient, kind: str) -> None:
        """One request; kind: 'full', 'disconnect' (after some chunks) or 'cancel' (before the first audio)."""
        rec = {"t": round(time.perf_counter() - self.t0, 3), "kind": kind, "status": None, "ttfa": None,
               "bytes": 0, "outcome": None}
        t0 = time.perf_counter()
        keep = self.rng.randint(1, 4)  # chunks read before a disconnect
        try:
            if kind == "cancel":
                # give up before the first audio: while queued or in its prefill (first chunk = 1 frame)
                wait = self.rng.uniform(0.0, self.a.cancel_within)
                task = asyncio.ensure_future(self._stream(client, rec, t0, None))
                done, _ = await asyncio.wait({task}, timeout=wait)
                if task in done:
                    task.result()
                    rec["outcome"] = rec["outcome"] or "completed_before_cancel"
                else:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    rec["outcome"] = "cancelled"
            else:
                await self._stream(client, rec, t0, keep if kind == "disconnect" else None)
        except (httpx.HTTPError, OSError) as e:
            rec["outcome"] = f"transport_error: {type(e).__name__}: {e}"[:200]
        rec["wall"] = round(time.perf_counter() - t0, 3)
        self.records.append(rec)

    async def _stream(self, client, rec, t0, keep_chunks):
        async with client.stream("POST", "/v1/audio/speech", json=self.body()) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["retry_after"] = r.headers.get("retry-after")
                rec["error"] = (await r.aread())[:300].decode(errors="replace")
                rec["outcome"] = "busy" if r.status_code == 503 else "error"
                return
            chunks = 0
            async for chunk in r.aiter_raw():
                if not chunk:
                    continue
                if rec["ttfa"] is None:
                    rec["ttfa"] = round(time.perf_counter() - t0, 4)
                rec["bytes"] += len(chunk)
                chunks += 1
                if keep_chunks is not None and chunks >= keep_chunks:
                    rec["outcome"] = "disconnected"
                    return  # leaving the block closes the connection mid-stream
            rec["outcome"] = "completed"

    def pick(self) -> str:
        x = self.rng.random()
        return "disconnect" if x < self.a.disconnect else "cancel" if x < self.a.disconnect + self.a.cancel else "full"

    async def client_loop(self, client: httpx.AsyncClient) -> None:
        while time.perf_counter() < self.stop_at:
            await self.one(client, self.pick())
            rec = self.records[-1]
            if rec["status"] == 503:  # honour Retry-After
                await asyncio.sleep(float(rec.get("retry_after") or 1))

    async def bursts(self, client: httpx.AsyncClient) -> None:
        if self.a.burst_every <= 0:
            return
        tasks = []
        while True:
            await asyncio.sleep(self.a.burst_every)
            if time.perf_counter() >= self.stop_at:
                break
            tasks += [asyncio.ensure_future(self.one(client, self.pick())) for _ in range(self.a.burst_size)]
        await asyncio.gather(*tasks)

    async def poll(self, client: httpx.AsyncClient, until: asyncio.Event) -> None:
        while not until.is_set():
            await self.sample(client)
            try:
                await asyncio.wait_for(until.wait(), self.a.poll)
            except asyncio.TimeoutError:
                pass

    async def sample(self, client: httpx.AsyncClient) -> dict:
        m = parse_metrics((await client.get("/metrics")).text)
        s = {"t": round(time.perf_counter() - self.t0, 2), "active_slots": m.get("q3tts_active_slots"),
             "queue_depth": m.get("q3tts_queue_depth"), "rss_mb": _mb(m.get("q3tts_process_resident_bytes")),
             "gpu_alloc_mb": _mb(m.get("q3tts_gpu_allocated_bytes")),
             "gpu_reserved_mb": _mb(m.get("q3tts_gpu_reserved_bytes"))}
        self.samples.append(s)
        return s

    async def drain(self, client: httpx.AsyncClient) -> dict:
        """After the clients are gone: wait until no slot is active and nothing is queued (or time out)."""
        deadline = time.perf_counter() + self.a.drain_timeout
        while True:
            s = await self.sample(client)
            if (s["active_slots"] == 0 and s["queue_depth"] == 0) or time.perf_counter() > deadline:
                return s


def _mb(x: float | None) -> float | None:
    return None if x is None or x != x else round(x / 2**20, 1)


def growth(samples: list[dict], key: str, warmup_s: float) -> float | None:
    """Mean of the last quarter minus the mean of the first quarter of the samples after warm-up."""
    xs = [s[key] for s in samples if s["t"] >= warmup_s and s[key] is not None]
    if len(xs) < 8:
        return None
    q = len(xs) // 4
    return round(sum(xs[-q:]) / q - sum(xs[:q]) / q, 1)


def report(soak: Soak, end: dict, a: argparse.Namespace) -> dict:
    recs = soak.records
    statuses: dict[str, int] = {}
    for r in recs:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    outcomes: dict[str, int] = {}
    for r in recs:
        key = r["outcome"].split(":")[0] if r["outcome"] else "none"
        outcomes[key] = outcomes.get(key, 0) + 1
    ttfa = [r["ttfa"] for r in recs if r["ttfa"] is not None]
    fivexx = [r for r in recs if r["status"] is not None and r["status"] >= 500]
    busy = [r for r in fivexx if r["status"] == 503]
    busy_without_retry = [r for r in busy if not r.get("retry_after")]
    other_errors = [r for r in recs if r["outcome"] in ("error", None) or r["outcome"].startswith("transport_error")]
    rss_growth = growth(soak.samples, "rss_mb", a.warmup)
    gpu_growth = growth(soak.samples, "gpu_reserved_mb", a.warmup)
    leaked = (end["active_slots"] or 0) + (end["queue_depth"] or 0)
    checks = {
        "no_5xx_but_busy": len(fivexx) == len(busy),
        "busy_has_retry_after": not busy_without_retry,
        "no_request_errors": not other_errors,
        "no_leaked_slots": leaked == 0,
        "rss_flat": rss_growth is None or rss_growth <= a.max_rss_growth_mb,
        "gpu_flat": gpu_growth is None or gpu_growth <= a.max_gpu_growth_mb,
    }
    if a.strict_no_5xx:
        checks["no_5xx"] = not fivexx
    out = {
        "config": {k: v for k, v in vars(a).items() if k != "api_key"}, "slots": soak.slots,
        "clients": soak.slots * a.load, "requests": len(recs), "statuses": statuses, "outcomes": outcomes,
        "num_5xx": len(fivexx), "num_503": len(busy), "ttfa_p50_s": pct(ttfa, 50), "ttfa_p95_s": pct(ttfa, 95),
        "ttfa_max_s": max(ttfa) if ttfa else None, "leaked_slots": leaked, "end": end,
        "rss_mb_start_end": _ends(soak.samples, "rss_mb", a.warmup), "rss_growth_mb": rss_growth,
        "gpu_reserved_mb_start_end": _ends(soak.samples, "gpu_reserved_mb", a.warmup), "gpu_growth_mb": gpu_growth,
        "max_active_slots": max((s["active_slots"] or 0 for s in soak.samples), default=0),
        "max_queue_depth": max((s["queue_depth"] or 0 for s in soak.samples), default=0),
        "errors": [r for r in recs if r in other_errors or r in fivexx][:20],
        "checks": checks, "ok": all(checks.values()), "samples": soak.samples,
    }
    return out


def _ends(samples, key, warmup_s):
    xs = [s[key] for s in samples if s["t"] >= warmup_s and s[key] is not None]
    return [xs[0], xs[-1]] if xs else None


def table(r: dict) -> str:
    rows = [("requests", r["requests"]), ("clients (load x slots)", f"{r['clients']} ({r['config']['load']} x "
                                                                   f"{r['slots']})"),
            ("statuses", r["statuses"]), ("outcomes", r["outcomes"]), ("5xx (of which 503 busy)",
                                                                       f"{r['num_5xx']} ({r['num_503']})"),
            ("first audio p50 / p95 / max (s)", f"{r['ttfa_p50_s']} / {r['ttfa_p95_s']} / {r['ttfa_max_s']}"),
            ("max active slots / queue", f"{r['max_active_slots']} / {r['max_queue_depth']}"),
            ("leaked slots after drain", r["leaked_slots"]),
            ("RSS MB after warm-up: first, last; growth", f"{r['rss_mb_start_end']}; {r['rss_growth_mb']}"),
            ("GPU reserved MB: first, last; growth", f"{r['gpu_reserved_mb_start_end']}; {r['gpu_growth_mb']}"),
            ("checks", ", ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in r["checks"].items())),
            ("verdict", "PASS" if r["ok"] else "FAIL")]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


async def run(a: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=a.url, timeout=a.timeout, headers=headers, limits=limits) as client:
        m = parse_metrics((await client.get("/metrics")).text)
        slots = int(m.get("q3tts_max_slots", 0))
        if slots < 1:
            raise SystemExit(f"{a.url}/metrics gives no q3tts_max_slots")
        soak = Soak(a, slots)
        until = asyncio.Event()
        poller = asyncio.ensure_future(soak.poll(client, until))
        await asyncio.gather(*(soak.client_loop(client) for _ in range(slots * a.load)), soak.bursts(client))
        until.set()
        await poller
        end = await soak.drain(client)
    return report(soak, end, a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--load", type=int, default=2, help="clients per engine slot (2 = twice capacity)")
    ap.add_argument("--disconnect", type=float, default=0.2, help="share of requests dropped mid-stream")
    ap.add_argument("--cancel", type=float, default=0.05, help="share of requests cancelled before first audio")
    ap.add_argument("--cancel-within", type=float, default=0.5, help="a cancel comes 0..this many seconds in")
    ap.add_argument("--burst-every", type=float, default=20.0, help="seconds between bursts (0: none)")
    ap.add_argument("--burst-size", type=int, default=4, help="extra requests per burst")
    ap.add_argument("--min-frames", type=int, default=10, help="audio frames per request, drawn uniformly")
    ap.add_argument("--max-frames", type=int, default=80)
    ap.add_argument("--voice", default="vivian", help="CustomVoice speaker or Base stored voice ('' for none)")
    ap.add_argument("--instructions", default=None, help="VoiceDesign models: the voice description")
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between /metrics samples")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before memory counts as warmed up")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request HTTP timeout")
    ap.add_argument("--max-rss-growth-mb", type=float, default=64.0)
    ap.add_argument("--max-gpu-growth-mb", type=float, default=64.0)
    ap.add_argument("--strict-no-5xx", action="store_true", help="count 503 (queue full) as a failure too")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON report")
    a = ap.parse_args(argv)
    r = asyncio.run(run(a))
    print(table(r), file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
