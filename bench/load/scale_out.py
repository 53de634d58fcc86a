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
rate steps through --autoscale-rates (per second, --step-s each); Serve's replica states are polled meanwhile.
The log: when the target replica count rose, when each added replica came up, and when streams first stalled.

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
from pathlib import Path

import httpx

from bench.load.load import parse_cpus


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
    """bench.load.load in its own process (pinned by --client-cpus) while the proxy's and its own CPU are sampled."""
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
        lines += ["", (f"autoscaling (target {auto['target_ongoing']} per replica, rates {auto['rates']} req/s, "
                      f"{auto['step_s']} s each): first stalled request sent at {s['first_stalled_request_sent_s']} s; "
                      f"{s['stalled_requests']} of {s['requests']} requests stalled; events:")]
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
    ap.add_argument("--rate-per-replica", type=float, default=3.0, help="open loop: requests/s per replica (0: none)")
    ap.add_argument("--duration", type=float, default=15.0, help="open loop: seconds of arrivals")
    ap.add_argument("--autoscale-rates", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="step test rates (requests/s), e.g. 2,4,8; none: no step test")
    ap.add_argument("--step-s", type=float, default=20.0, help="step test: seconds per rate")
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
    ap.add_argument("--load-timeout", type=float, default=240.0)
    ap.add_argument("--out", default="/tmp/out")
    a = ap.parse_args(argv)
    a.url = f"http://127.0.0.1:{a.port}"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.client_cpus:  # Ray and its replicas inherit this process's CPUs: all but the client's
        rest = sorted(os.sched_getaffinity(0) - set(parse_cpus(a.client_cpus)))
        if rest:
            os.sched_setaffinity(0, rest)

    import ray
    from ray import serve

    from q3tts.server.ray_serve import autoscaling_config
    res = {"args": {k: v for k, v in vars(a).items()}, "compile": os.environ.get("Q3TTS_COMPILE", "default"),
           "server_cpus": sorted(os.sched_getaffinity(0)), "levels": []}

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
            level["closed"] = run_load(a, out, f"closed-{r}", ["--concurrency", str(a.streams_per_replica * r),
                                                                "--requests", "1"], a.load_timeout)
            if a.rate_per_replica:
                level["poisson"] = run_load(a, out, f"poisson-{r}", [
                    "--rate", str(a.rate_per_replica * r), "--duration", str(a.duration)], a.load_timeout)
            level["replica_ids"] = sorted({rid for k in ("closed", "poisson") for lv in level.get(k, {}).get("levels", [])
                                           for rid in lv["replicas"]})
            res["levels"].append(level)
            save()
            print(table(res), file=sys.stderr, flush=True)
        if a.autoscale_rates and max(a.replicas) > 1:
            auto = {"rates": a.autoscale_rates, "step_s": a.step_s,
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
            auto["load"] = run_load(a, out, "autoscale", [
                "--rate", ",".join(map(str, a.autoscale_rates)), "--rate-steps", "--duration", str(a.step_s),
                "--per-request"], a.load_timeout + len(a.autoscale_rates) * a.step_s)
            settle = time.perf_counter() + a.settle_s  # replicas added late: log until they run (or give up)
            while time.perf_counter() < settle and (not log.rows or "error" in log.rows[-1]
                                                    or set(log.rows[-1]["states"]) - {"RUNNING"}):
                time.sleep(0.5)
            rows = log.stop()
            auto["replica_log"] = [dict(r, t=round(r["t"] - t_steps, 2)) for r in rows]
            if "levels" in auto["load"]:
                (lvl,) = auto["load"]["levels"]
                auto["summary"] = autoscale_summary(rows, lvl.pop("per_request"), t_steps,
                                                    auto["load"].get("stall_tolerance_ms", 1.0) / 1000)
            save()
    finally:
        res["total_s"] = round(time.perf_counter() - t_start, 1)
        save()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
