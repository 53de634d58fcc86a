"""Ray Serve scale-out on one host: the same per-replica load on R = G, ..., 2, 1 replicas, then an autoscaling
step test; one JSON and a table. Run by bench/load/scale_out.sh (one device call); on a CPU with --device cpu.

    python -m bench.load.scale_out --ckpt /tmp/ck06 --device cuda --replicas 4,2,1 --client-cpus 60-63 --out /tmp/out

One Ray and one Serve application for the whole run, so that the replicas start (load, compile, warm up) once, in
parallel: it is deployed from a Serve config (q3tts.server.ray_serve:build_app, as `serve deploy` and KubeRay do)
with the most replicas first, then the config's replica count is lowered (a change Serve applies in place: it stops
the surplus replicas, the rest keep serving untouched; a redeploy from Python code would restart them all), so
every R is measured on replicas that are already warm; each level lists the replica ids it saw. Per R, bench/load/load.py
(its own process, pinned to --client-cpus, --processes client processes) runs
  - closed loop: --streams-per-replica x R streams, one utterance each;
  - open loop: Poisson arrivals at --rate-per-replica x R per second for --duration s;
while the CPU time of Ray's HTTP proxy and of the load client is sampled from /proc (one process near 100% of a
core is a limit). Efficiency = audio s/s at R / (R x audio s/s at 1).

Autoscaling: redeployed with min 1 / max G replicas and target --target-ongoing, then one open-loop level whose
rate steps through --autoscale-rates (per second, --step-s each, or one length per step); Serve's replica states
are polled meanwhile. Per step: arrivals, replicas running, first audio p50/p95/p99, stalls, requests per replica;
per added replica: when Serve asked for it, when it ran, and its first request; and when streams first stalled.

--artifact FILE (from `q3tts warmup --save FILE`, run by scale_out.sh before this): every replica, the first ones
and those the autoscaler adds, loads it before it compiles (`q3tts serve --load-artifact`). Per-level load JSONs go
to --work; --out gets scale_out.json (everything merged: the device call brings back few files) and scale_out.md.

Ray and every replica run on the CPUs not given to the client (this process pins itself before it starts Ray,
and Ray's processes inherit that); each replica gets its own GPU from Ray (CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.load.load import parse_cpus, pct


def _pids_under(root: int) -> list[int]:
    """root and its descendants, from /proc/*/stat's parent ids."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parent[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out += frontier
    return out


def _pids_named(word: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if word in Path(f"/proc/{d}/cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def _cpu_s(pids: list[int]) -> float:
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


class CpuSampler(threading.Thread):
    """CPU use (cores) of named process groups, sampled every `period` s: {name: {mean, max}}."""

    def __init__(self, groups: dict, period: float = 1.0):
        super().__init__(daemon=True)
        self.groups, self.period, self.samples = groups, period, {k: [] for k in groups}
        self.stop_event = threading.Event()

    def run(self):
        last = {k: (_cpu_s(f()), time.perf_counter()) for k, f in self.groups.items()}
        while not self.stop_event.wait(self.period):
            for k, f in self.groups.items():
                now = (_cpu_s(f()), time.perf_counter())
                self.samples[k].append((now[0] - last[k][0]) / (now[1] - last[k][1]))
                last[k] = now

    def result(self) -> dict:
        self.stop_event.set()
        self.join()
        return {k: {"mean": round(sum(v) / len(v), 2) if v else None, "max": round(max(v), 2) if v else None}
                for k, v in self.samples.items()}


class ReplicaLog(threading.Thread):
    """Serve's view of the deployment every `period` s: (t, its status/trigger, replicas per state)."""

    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.period, self.rows, self.stop_event = period, [], threading.Event()

    def run(self):
        from ray import serve

        from q3tts.server.ray_serve import APP_NAME, DEPLOYMENT_NAME
        while not self.stop_event.wait(self.period):
            try:
                d = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
            except Exception as e:  # noqa: BLE001 (a missed poll is logged, not fatal)
                self.rows.append({"t": time.time(), "error": repr(e)})
                continue
            self.rows.append({"t": time.time(), "status": f"{d.status.value}/{d.status_trigger.value}",
                              "states": {getattr(k, "value", str(k)): v for k, v in d.replica_states.items()}})

    def stop(self) -> list[dict]:
        self.stop_event.set()
        self.join()
        return self.rows


def fit_steps(lengths: list[float], available: float | None, least: float = 0.4) -> list[float]:
    """The step lengths, scaled down alike to fit `available` seconds (None: no bound); [] if that would cut them
    below `least` of their length."""
    if available is None or sum(lengths) <= available:
        return lengths
    f = available / sum(lengths)
    return [round(x * f, 1) for x in lengths] if f >= least else []


def host_info() -> list[str]:
    """The GPUs (nvidia-smi's index, name, memory) and the CPU count."""
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        gpus = []
    return gpus + [f"{os.cpu_count()} CPUs"]


def read_warmup(path: str) -> dict:
    """The last JSON line of `q3tts warmup`'s output, or what went wrong."""
    try:
        lines = [ln for ln in Path(path).read_text().splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {"error": "no JSON line", "tail": Path(path).read_text()[-2000:]}
    except (OSError, ValueError) as e:
        return {"error": repr(e)}


def replica_log_lines(limit: int = 300) -> list[str]:
    """The q3tts lines (model load, compiled artifact, engine build, warm-up, errors) the replicas wrote to their
    stderr in this Ray session's logs, oldest first, at most `limit`."""
    try:
        import ray
        root = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    except Exception:  # noqa: BLE001 (internal API; the default session link instead)
        root = Path("/tmp/ray/session_latest/logs")
    lines = []
    for f in sorted(root.glob("worker-*.err")):
        try:
            lines += [f"{f.name[7:15]} {ln}" for ln in f.read_text(errors="replace").splitlines()
                      if " q3tts." in ln or "Traceback" in ln or "Error" in ln or "Warning" in ln]
        except OSError:
            pass
    return lines[-limit:]


def deployed_at() -> float | None:
    from ray import serve

    from q3tts.server.ray_serve import APP_NAME
    app = serve.status().applications.get(APP_NAME)
    return None if app is None else app.last_deployed_time_s


def wait_replicas(url: str, n: int, timeout: float, before: float | None) -> float:
    """Until Serve took the config deployed after `before` (deployed_at()), its update is done with exactly n
    replicas running, and /ready answered 200 from n different replicas (by x-q3tts-replica); -> s."""
    from ray import serve

    from q3tts.server.ray_serve import APP_NAME, DEPLOYMENT_NAME
    t0, seen = time.perf_counter(), set()
    while True:
        try:
            r = httpx.get(url + "/ready", timeout=10)
            if r.status_code == 200 and "x-q3tts-replica" in r.headers:
                seen.add(r.headers["x-q3tts-replica"])
        except httpx.HTTPError:
            pass
        app = serve.status().applications.get(APP_NAME)
        if app is not None and app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"Serve application {app.status}: {app.message}")
        d = app.deployments.get(DEPLOYMENT_NAME) if app is not None else None
        states = {getattr(k, "value", str(k)): v for k, v in d.replica_states.items()} if d is not None else {}
        running = states.get("RUNNING", 0)
        done = app is not None and app.last_deployed_time_s != before and app.status == "RUNNING" \
            and d is not None and d.status == "HEALTHY"
        if done and len(seen) >= n and running == n and sum(states.values()) == n:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{n} replicas not ready after {timeout} s: saw {sorted(seen)}, states {states}")
        time.sleep(0.2)


def run_load(a, out: Path, name: str, args: list[str], timeout: float) -> dict:
    """bench.load.load in its own process (pinned by --client-cpus) while the proxy's and its own CPU are sampled;
    its JSON and stderr go to `out` (the work directory)."""
    cmd = [sys.executable, "-m", "bench.load.load", "--url", a.url, "--no-server-metrics", "--no-warmup",
           "--max-new-tokens", str(a.max_new_tokens), "--processes", str(a.processes), "--out", str(out / f"{name}.json"),
           *(["--client-cpus", a.client_cpus] if a.client_cpus else []), *args]
    with open(out / f"{name}.err", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        sampler = CpuSampler({"proxy": lambda: _pids_named("ProxyActor"), "client": lambda: _pids_under(proc.pid)})
        sampler.start()
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:  # also when this process is interrupted (the script's time limit): no client left running
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        cpu = sampler.result()
    if rc != 0:
        return {"error": f"bench.load.load exit {rc}: {(out / f'{name}.err').read_text()[-2000:]}", "cpu": cpu}
    return {**json.loads((out / f"{name}.json").read_text()), "cpu_cores": cpu}


def deploy(a, overrides: dict) -> None:
    """(Re)deploy the application from a Serve config; `overrides`: the Q3TTS deployment's options (num_replicas or
    autoscaling_config), the only part that changes between calls, so Serve updates the replicas in place."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from q3tts.server.ray_serve import APP_NAME, DEPLOYMENT_NAME
    args = {"model": a.ckpt, "device": a.device, "max_concurrent": a.slots, "max_seq_len": a.max_seq_len,
            "voice_dir": a.voice_dir, "served_model_name": "bench", "router": a.router, "replicas": 1,
            **({"compile_artifact": a.artifact} if a.artifact else {}),
            "max_replicas": max(a.replicas),
            "num_cpus": a.replica_cpus, "num_gpus": 0 if a.device.startswith("cpu") else 1}
    cfg = {"http_options": {"host": "127.0.0.1", "port": a.port},
           "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "q3tts.server.ray_serve:build_app",
                             "args": args, "deployments": [{"name": DEPLOYMENT_NAME, **overrides}]}]}
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(cfg))


def autoscale_summary(rows: list[dict], requests: list[dict], t0: float, tolerance_s: float) -> dict:
    """Times (s after the step test's start) at which Serve's replicas (per state) or status changed, and of the
    first request that stalled."""
    events, last = [], None
    for r in rows:
        if "error" in r:
            continue
        now = (r["status"], sorted(r["states"].items()))
        if now != last:
            events.append({"t": round(r["t"] - t0, 1), "status": r["status"], "replicas": r["states"]})
            last = now
    stalled = [q for q in requests if q.get("stall_s") is not None and q["stall_s"] > tolerance_s]
    return {"events": events,
            "first_stalled_request_sent_s": round(stalled[0]["sent"] - t0, 1) if stalled else None,
            "stalled_requests": len(stalled), "requests": len(requests)}


def step_summary(requests: list[dict], rows: list[dict], t0: float, rates: list[float], lengths: list[float],
                 tolerance_s: float) -> list[dict]:
    """Per step of the rate schedule (t0: its start, time.time()): the requests sent in it (the last step also takes
    those sent late), Serve's replicas RUNNING while it lasted (rows: ReplicaLog's), first audio and stalls of its
    requests, and how many each replica served."""
    out, start = [], 0.0
    for k, (rate, length) in enumerate(zip(rates, lengths)):
        end = start + length if k < len(rates) - 1 else float("inf")
        qs = [q for q in requests if q.get("sent") is not None and start <= q["sent"] - t0 < end]
        ok = [q for q in qs if not q.get("error")]
        ttfa, stall = [q["ttfa_s"] for q in ok], [q["stall_s"] for q in ok]
        running = [r["states"].get("RUNNING", 0) for r in rows if "states" in r and start <= r["t"] - t0 < end]
        ms = lambda xs, q: None if not xs else round(1000 * pct(xs, q), 1)  # noqa: E731
        out.append({"step": k, "rate": rate, "from_s": start, "to_s": start + length, "arrivals": len(qs),
                    "errors": len(qs) - len(ok),
                    "replicas_running": {"min": min(running), "max": max(running), "end": running[-1]}
                    if running else None,
                    "ttfa_ms": {"p50": ms(ttfa, 50), "p95": ms(ttfa, 95), "p99": ms(ttfa, 99),
                                "max": round(1000 * max(ttfa), 1) if ttfa else None},
                    "stalled": sum(s > tolerance_s for s in stall),
                    "stall_ms": {"p95": ms(stall, 95), "max": round(1000 * max(stall), 1) if stall else None},
                    "per_replica": dict(sorted(Counter(q.get("replica") for q in ok).items(), key=str))})
        start += length
    return out


def replica_starts(rows: list[dict], requests: list[dict], t0: float) -> dict:
    """The replicas Serve added during the step test (rows: ReplicaLog's; t0: the schedule's start): per added
    replica, when the replica count rose (asked) and when one more ran, paired in order; and each replica's first
    request (sent time), by its id."""
    asked, ran, total0, run0 = [], [], None, None
    for r in rows:
        if "states" not in r:
            continue
        total, running = sum(r["states"].values()), r["states"].get("RUNNING", 0)
        if total0 is not None:
            asked += [round(r["t"] - t0, 1)] * max(0, total - total0)
            ran += [round(r["t"] - t0, 1)] * max(0, running - run0)
        total0, run0 = max(total, total0 or 0), max(running, run0 or 0)
    first: dict[str, float] = {}
    for q in sorted((q for q in requests if q.get("replica") and q.get("sent") is not None), key=lambda q: q["sent"]):
        first.setdefault(q["replica"], round(q["sent"] - t0, 1))
    return {"added": [{"asked_s": a, "running_s": r, "start_s": round(r - a, 1)} for a, r in zip(asked, ran)]
            + [{"asked_s": a, "running_s": None, "start_s": None} for a in asked[len(ran):]],
            "first_request_s": first}


def table(res: dict) -> str:
    rows = [r for r in res["levels"] if "closed" in r]
    one = next((r for r in rows if r["replicas"] == 1), None)
    lines = [("| replicas | streams | audio s/s | efficiency vs R x one | first audio p50 / p95 ms | streams that stall "
             "| stall p95 / max ms | per replica | proxy CPU mean / max | Poisson req/s | Poisson first audio p95 / "
             "p99 ms | Poisson stall share |"), "|---:|---:|---:|---:|---|---:|---|---|---|---:|---|---:|"]
    for r in rows:
        c, p = r["closed"], r.get("poisson") or {}
        if "error" in c:
            lines.append(f"| {r['replicas']} | error: {c['error'][:80]} |")
            continue
        (cl,), pl = c["levels"], (p.get("levels") or [{}])[0]
        eff = ""
        if one and "error" not in one["closed"]:
            base = one["closed"]["levels"][0]["audio_s_per_s"]
            eff = f"{cl['audio_s_per_s'] / (r['replicas'] * base):.2f}" if base else ""
        cpu = c.get("cpu_cores", {}).get("proxy", {})
        prev = next((q for q in reversed(rows[:rows.index(r)]) if "replica_ids" in q), None)
        kept = "" if prev is None or set(r["replica_ids"]) <= set(prev["replica_ids"]) else " (restarted)"
        lines.append(
            f"| {r['replicas']}{kept} | {cl['concurrency']} | {cl['audio_s_per_s']} | {eff} | {cl['ttfa_ms']['p50']} / "
            f"{cl['ttfa_ms']['p95']} | {cl['stalled_share']:.0%} | {cl['stall_ms']['p95']} / {cl['stall_ms']['max']} "
            f"| {sorted(cl['replicas'].values())} | {cpu.get('mean')} / {cpu.get('max')} | {pl.get('rate', '')} | "
            f"{pl.get('ttfa_ms', {}).get('p95', '')} / {pl.get('ttfa_ms', {}).get('p99', '')} | "
            f"{pl.get('stalled_share', '')} |")
    auto = res.get("autoscale")
    if auto and "summary" in auto:
        s = auto["summary"]
        lines += ["", (f"autoscaling (target {auto['target_ongoing']} per replica, upscale delay "
                      f"{auto['config'].get('upscale_delay_s')} s, rates {auto['rates']} req/s for {auto['step_s']} s): "
                      f"first stalled request sent at {s['first_stalled_request_sent_s']} s; "
                      f"{s['stalled_requests']} of {s['requests']} requests stalled"), "",
                  "| step | req/s | s | arrivals | replicas running min / max / end | first audio p50 / p95 / p99 ms "
                  "| streams that stall | stall p95 / max ms | per replica |", "|---:|---:|---|---:|---|---|---:|---|---|"]
        for st in auto.get("steps", []):
            rr, t = st["replicas_running"] or {}, st["ttfa_ms"]
            lines.append(f"| {st['step']} | {st['rate']} | {st['from_s']:g}-{st['to_s']:g} | {st['arrivals']} | "
                         f"{rr.get('min')} / {rr.get('max')} / {rr.get('end')} | {t['p50']} / {t['p95']} / {t['p99']} | "
                         f"{st['stalled']} | {st['stall_ms']['p95']} / {st['stall_ms']['max']} | "
                         f"{sorted(st['per_replica'].values())} |")
        starts = auto.get("replica_starts", {})
        lines += ["", f"replicas added (s after the first step began): {starts.get('added')}; send time of the "
                      f"first request each replica served: {starts.get('first_request_s')}", "Serve's events:"]
        lines += [f"  {e}" for e in s["events"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--replicas", type=lambda s: sorted({int(x) for x in s.split(",")}, reverse=True),
                    default=[4, 2, 1], help="replica counts, measured from the largest down")
    ap.add_argument("--slots", type=int, default=64, help="--max-concurrent of each replica")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=126, help="frames + 1 per request (126: 10 s)")
    ap.add_argument("--streams-per-replica", type=int, default=32, help="closed loop: streams per replica")
    ap.add_argument("--closed-requests", type=int, default=1, help="closed loop: requests per stream, back to back")
    ap.add_argument("--rate-per-replica", type=float, default=3.0, help="open loop: requests/s per replica (0: none)")
    ap.add_argument("--duration", type=float, default=15.0, help="open loop: seconds of arrivals")
    ap.add_argument("--autoscale-rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="step test rates (requests/s), e.g. 2,4,8; none: no step test")
    ap.add_argument("--step-s", type=lambda s: [float(x) for x in s.split(",")], default=[20.0],
                    help="step test: seconds per rate (one for all, or one per rate, e.g. 20,70,40)")
    ap.add_argument("--target-ongoing", type=float, default=0, help="step test: target_ongoing_requests (0: slots)")
    ap.add_argument("--settle-s", type=float, default=30.0,
                    help="step test: keep logging Serve's replicas this long after the load while some start")
    ap.add_argument("--upscale-delay-s", type=float, default=None, help="step test: autoscaling upscale_delay_s")
    ap.add_argument("--router", default="least-ongoing")
    ap.add_argument("--replica-cpus", type=float, default=2.0)
    ap.add_argument("--processes", type=int, default=4, help="load client processes")
    ap.add_argument("--client-cpus", default=None, help="CPUs of the load client, e.g. 60-63 (the rest: Ray)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--voice-dir", default="/tmp/q3tts-voices")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds from this process's start by which it must be done: the step test's steps are "
                         "shortened to fit (or it is skipped below 40%% of their length)")
    ap.add_argument("--load-timeout", type=float, default=240.0)
    ap.add_argument("--artifact", default=None, help="a `q3tts warmup --save` file every replica loads")
    ap.add_argument("--warmup-json", default=None, help="the JSON line of the `q3tts warmup --save` run, merged in")
    ap.add_argument("--out", default="/tmp/out", help="scale_out.json and scale_out.md")
    ap.add_argument("--work", default=None, help="each load's JSON and stderr (default: --out)")
    a = ap.parse_args(argv)
    if a.autoscale_rates and len(a.step_s) not in (1, len(a.autoscale_rates)):
        ap.error(f"--step-s: one length or one per rate ({len(a.autoscale_rates)}), got {a.step_s}")
    a.url = f"http://127.0.0.1:{a.port}"
    out, work = Path(a.out), Path(a.work or a.out)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if a.client_cpus:  # Ray and its replicas inherit this process's CPUs: all but the client's
        rest = sorted(os.sched_getaffinity(0) - set(parse_cpus(a.client_cpus)))
        if rest:
            os.sched_setaffinity(0, rest)

    import ray
    from ray import serve

    from q3tts.server.ray_serve import autoscaling_config
    res = {"args": {k: v for k, v in vars(a).items()}, "compile": os.environ.get("Q3TTS_COMPILE", "default"),
           "host": host_info(), "server_cpus": sorted(os.sched_getaffinity(0)), "levels": []}
    if a.warmup_json:
        res["warmup"] = read_warmup(a.warmup_json)

    def save():
        (out / "scale_out.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / "scale_out.md").write_text(table(res) + "\n")

    t_start = time.perf_counter()
    ray.init(namespace="q3tts", log_to_driver=False, include_dashboard=False)  # Serve's API needs no dashboard
    res["ray"] = {"version": ray.__version__, "resources": ray.cluster_resources()}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        for r in a.replicas:
            t0 = time.perf_counter()
            before = deployed_at()  # fixed r: autoscaling between r and r, so that every change is Serve's in-place
            deploy(a, {"autoscaling_config": autoscaling_config(r, r, a.slots)})  # kind (code's has one too)
            wait_replicas(a.url, r, a.ready_timeout, before)
            level = {"replicas": r, "ready_s": round(time.perf_counter() - t0, 1),
                     "since_start_s": round(time.perf_counter() - t_start, 1)}
            print(f"scale_out: {r} replica(s) ready in {level['ready_s']} s", file=sys.stderr, flush=True)
            level["closed"] = run_load(a, work, f"closed-{r}", ["--concurrency", str(a.streams_per_replica * r),
                                                                 "--requests", str(a.closed_requests)], a.load_timeout)
            if a.rate_per_replica:
                level["poisson"] = run_load(a, work, f"poisson-{r}", [
                    "--rate", str(a.rate_per_replica * r), "--duration", str(a.duration)], a.load_timeout)
            level["replica_ids"] = sorted({rid for k in ("closed", "poisson") for lv in level.get(k, {}).get("levels", [])
                                           for rid in lv["replicas"]})
            res["levels"].append(level)
            save()
            print(table(res), file=sys.stderr, flush=True)
        lengths = []
        if a.autoscale_rates and max(a.replicas) > 1:
            lengths = a.step_s * len(a.autoscale_rates) if len(a.step_s) == 1 else a.step_s
            left = None if a.deadline_s is None else a.deadline_s - (time.perf_counter() - t_start)
            lengths = fit_steps(lengths, None if left is None else left - a.settle_s - 25)  # 25: redeploy, the
            # client's start, the last requests' end
            res["autoscale"] = {"skipped": f"{left:.0f} s left: too little for the step test"} if not lengths else {}
        if lengths:
            auto = {"rates": a.autoscale_rates, "step_s": lengths,
                    "target_ongoing": a.target_ongoing or a.slots, "max_replicas": max(a.replicas)}
            res["autoscale"] = auto
            t0 = time.perf_counter()
            auto["config"] = autoscaling_config(1, max(a.replicas), a.target_ongoing or a.slots,
                                                {"upscale_delay_s": a.upscale_delay_s}
                                                if a.upscale_delay_s is not None else None)
            before = deployed_at()
            deploy(a, {"autoscaling_config": auto["config"]})
            wait_replicas(a.url, 1, a.ready_timeout, before)
            auto["ready_s"] = round(time.perf_counter() - t0, 1)
            log = ReplicaLog()
            log.start()
            t_steps = time.time()
            auto["load"] = run_load(a, work, "autoscale", [
                "--rate", ",".join(map(str, a.autoscale_rates)), "--rate-steps", "--duration",
                ",".join(map(str, lengths)), "--per-request"], a.load_timeout + sum(lengths))
            settle = time.perf_counter() + a.settle_s  # replicas added late: log until they run (or give up)
            while time.perf_counter() < settle and (not log.rows or "error" in log.rows[-1]
                                                    or set(log.rows[-1]["states"]) - {"RUNNING"}):
                time.sleep(0.5)
            rows = log.stop()
            if "levels" in auto["load"]:
                (lvl,) = auto["load"]["levels"]
                t_steps = lvl.get("t0", t_steps)  # the schedule's start: the client's processes start after t_steps
                requests, tol = lvl.pop("per_request"), auto["load"].get("stall_tolerance_ms", 1.0) / 1000
                auto["summary"] = autoscale_summary(rows, requests, t_steps, tol)
                auto["steps"] = step_summary(requests, rows, t_steps, a.autoscale_rates, lengths, tol)
                auto["replica_starts"] = replica_starts(rows, requests, t_steps)
                auto["requests"] = {"fields": ["sent_s", "ttfa_ms", "stall_ms", "replica", "error"],  # compact
                                    "rows": [[round(q["sent"] - t_steps, 3) if q.get("sent") else None,
                                              None if q.get("ttfa_s") is None else round(1000 * q["ttfa_s"], 1),
                                              None if q.get("stall_s") is None else round(1000 * q["stall_s"], 1),
                                              q.get("replica"), q.get("error")] for q in requests]}
            auto["replica_log"] = [dict(r, t=round(r["t"] - t_steps, 2)) for r in rows]
            save()
    finally:
        res["total_s"] = round(time.perf_counter() - t_start, 1)
        res["replica_log_lines"] = replica_log_lines()
        save()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
