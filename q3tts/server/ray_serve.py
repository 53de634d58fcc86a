"""Scale out on Ray Serve: one q3tts server per replica behind Ray's HTTP proxy.

    client -> Ray Serve proxy (HTTP + WebSocket, streamed) -> replica: create_app(tts, settings) -> AsyncEngine

Each replica loads its own model (one GPU each when the cluster has GPUs: Ray sets CUDA_VISIBLE_DEVICES, so
"cuda" is the replica's GPU) and serves the FastAPI app that `q3tts serve` serves, every route of it, plus a
response header `x-q3tts-replica` naming the replica. Replicas share nothing but the voice store: give them
one `voice_dir` that all of them read (one machine: any directory; a cluster: a shared filesystem).

Routing: Ray holds the requests a replica has no slot for (max_ongoing_requests = the engine's slots), so a
waiting request goes to whichever replica frees a slot first. Among replicas with free slots the router picks the
one with the fewest ongoing requests of all (LeastOngoingRouter; "power-of-two" keeps Serve's default, the fewer of
two random ones): a stream holds its slot for the whole utterance and every stream of a batch costs the same, so a
replica's step time, and its streams' risk of stalling, grow with its count; equal counts keep the slowest replica
as fast as the others. Serve's proxy measures each replica's count (probed, then kept up to date as it routes).

Autoscaling (--max-replicas > --replicas): Serve's autoscaler sums the requests running on and waiting for the
replicas and asks for ceil(sum / target_ongoing_requests) replicas, between the two bounds; AUTOSCALING holds the
rest of its settings, stated rather than left to Serve's defaults. Set target_ongoing_requests to the streams one
replica serves without stalls (bench/load/load.py's knee on that GPU), below its slots: at the slots a replica is added
only once requests queue, by when its streams have long been stalling. A new replica takes its start-up time (model
load, compile, warm-up) before it serves, so the target must leave that much headroom at the rate's growth.

Three ways in:
    q3tts serve --replicas N [--max-replicas M] [--ray-address ADDR]   (serve_main: a local Ray, or join one)
    serve run deploy/serve_config.yaml                                 (build_app: the config's import path)
    kubectl apply -f deploy/kuberay-rayservice.yaml                    (KubeRay; the same config inside)
"""

from __future__ import annotations

import logging
import random
import signal
import time
from collections import Counter
from dataclasses import fields, replace

from ray import serve
from ray.serve.request_router import FIFOMixin, RequestRouter

from q3tts.engine import DEFAULT_MAX_SLOTS

from .settings import ServerSettings, parse_args

log = logging.getLogger("q3tts.server")

APP_NAME = "q3tts"  # the Serve application
DEPLOYMENT_NAME = "Q3TTS"
REPLICA_HEADER = b"x-q3tts-replica"

# Serve's autoscaler, beyond min / max / target (ray.serve.config.AutoscalingConfig):
AUTOSCALING = {
    "metrics_interval_s": 1.0,  # how often replicas and handles report their ongoing requests (Serve's default
    # of 10 s would add up to that much to every reaction)
    "upscale_delay_s": 5.0,  # load above target this long before a replica is added: a burst of a few seconds
    # passes (each replica costs its start-up), a rate step does not wait long
    "downscale_delay_s": 300.0,  # below target this long before one is removed: no flapping between steps
    "look_back_period_s": 5.0,  # the mean over this window (> metrics_interval_s) is compared with the target
    "upscaling_factor": 1.0,  # go straight to ceil(sum / target), not part of the way
    "downscaling_factor": 0.5,  # halfway down at a time
}


class LeastOngoingRouter(FIFOMixin, RequestRouter):
    """Every replica is a candidate: Serve sends the request to the one with the fewest ongoing requests of all
    that have a free slot, where its default compares two random ones.

    NOTE(scale): Serve's router counts a request against its replica only once the request has been sent, after
    the routing task hands it over, and a replica's own count (a probe's answer, or its reply on accepting a
    request) leaves out what is routed to it but not yet arrived; requests routed in the same instant (a burst of
    streams) would see the same counts and pile onto one replica. So the choice is made again from the counts as
    they are once any probe returned, each replica's count taken as at least the requests this router sent it that
    have not completed, and counted at once; Serve's own count on send is then skipped for it. A replica whose
    cached count has expired (no probe or reply from it for Serve's staleness timeout, 10 s) counts as those
    requests alone: a lower bound, probed in the background meanwhile (skipped, it would leave a burst to the one
    replica still in the cache until that one was full). A replica that is full after all (another proxy's
    streams) rejects the request and Serve routes it again. Ties go in random order, so that several proxies do
    not pile onto one replica either. This uses two of Serve's internal methods (ray 2.60); without them it is
    the plain choice among all replicas.
    """

    @property
    def _claimed(self) -> Counter:  # replica id -> requests counted when chosen, not yet sent
        return self.__dict__.setdefault("_claimed_requests", Counter())

    @property
    def _inflight(self) -> Counter:  # replica id -> requests chosen for it here, not yet completed
        return self.__dict__.setdefault("_inflight_requests", Counter())

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        return [random.sample(candidate_replicas, len(candidate_replicas))] if candidate_replicas else []

    async def _select_from_candidate_replicas(self, candidates, backoff_index):
        chosen = await super()._select_from_candidate_replicas(candidates, backoff_index)
        cache = getattr(self, "_replica_queue_len_cache", None)
        if chosen is None or cache is None or not getattr(self, "_use_replica_queue_len_cache", False):
            return chosen

        def load(r) -> int:  # the cache's count (None: not probed, or expired), at least what this router sent
            return max(cache.get(r.replica_id) or 0, self._inflight[r.replica_id])

        best, best_len = chosen, load(chosen)
        for r in candidates:  # no await from here on: the choice and its count are one step
            n = load(r)
            if n < r.max_ongoing_requests and n < best_len and r.replica_id in self._replicas:
                best, best_len = r, n
        cache.update(best.replica_id, best_len + 1)
        self._claimed[best.replica_id] += 1
        self._inflight[best.replica_id] += 1
        return best

    def on_send_request(self, replica_id):
        if self._claimed[replica_id] > 0:  # counted when chosen
            self._claimed[replica_id] -= 1
        else:
            super().on_send_request(replica_id)

    def on_request_completed(self, replica_id, internal_request_id):
        if self._inflight[replica_id] > 0:
            self._inflight[replica_id] -= 1
        super().on_request_completed(replica_id, internal_request_id)


ROUTERS = {"least-ongoing": LeastOngoingRouter, "power-of-two": None}  # None: Serve's default


class ReplicaHeaderMiddleware:
    """Pure ASGI: adds `x-q3tts-replica: <replica id>` to every HTTP response and WebSocket handshake."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (REPLICA_HEADER, replica.encode("latin-1"))

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def _log_to_stderr(level: str) -> None:
    """Serve sets up only its own loggers in a replica: without a handler the q3tts ones (model load, compiled
    artifact, warm-up) would print warnings only. Their lines go to the replica's stderr (Ray's worker-*.err)."""
    qlog = logging.getLogger("q3tts")
    if not qlog.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        qlog.addHandler(handler)
        qlog.setLevel(level.upper())
        qlog.propagate = False


@serve.ingress()  # the app is built per replica, in __serve_build_asgi_app__ (after __init__)
class Q3TTSReplica:
    """One replica: the model, its engine and the server's FastAPI app, built in the replica's process.

    Args:
        settings: the server's settings (model, limits, voice_dir shared by every replica, ...).
        num_threads: torch CPU threads (the replica's share of the CPUs: Ray's num_cpus); None leaves torch's.
    """

    def __init__(self, settings: ServerSettings, num_threads: int | None = None):
        import torch

        from .app import create_app, load_model
        if num_threads:
            torch.set_num_threads(num_threads)
        _log_to_stderr(settings.log_level)
        self.replica_id = serve.get_replica_context().replica_tag
        t0 = time.perf_counter()
        tts = load_model(settings)
        t1 = time.perf_counter()
        log.info("replica %s: loaded %s on %s in %.1f s", self.replica_id, settings.model, tts.device, t1 - t0)
        self._app = create_app(tts, settings)  # builds the engine: compiles, captures its graphs
        self._app.add_middleware(ReplicaHeaderMiddleware, replica=self.replica_id)
        log.info("replica %s: engine built in %.1f s (%.1f s since the replica started)", self.replica_id,
                 time.perf_counter() - t1, time.perf_counter() - t0)

    def __serve_build_asgi_app__(self):
        return self._app

    def check_health(self) -> None:
        """Serve replaces a replica whose check raises: its engine cannot serve (the rule of /health)."""
        engine = self._app.state.engine
        if not engine.healthy():
            raise RuntimeError(f"replica {self.replica_id} cannot serve: {engine.last_error or 'engine stopped'}")


def autoscaling_config(replicas: int, max_replicas: int, target: float, autoscaling: dict | None = None) -> dict:
    """Serve's autoscaling_config: replicas..max_replicas aiming at `target` ongoing requests per replica, with
    AUTOSCALING's settings updated by `autoscaling`."""
    unknown = sorted(set(autoscaling or {}) - set(AUTOSCALING))
    if unknown:
        raise ValueError(f"unknown autoscaling settings {unknown}; accepted: {sorted(AUTOSCALING)}")
    return {"min_replicas": replicas, "max_replicas": max_replicas, "initial_replicas": replicas,
            "target_ongoing_requests": target, **AUTOSCALING, **(autoscaling or {})}


def deployment_options(settings: ServerSettings, num_cpus: float, num_gpus: float, replicas: int = 1,
                       max_replicas: int | None = None, target_ongoing_requests: float | None = None,
                       router: str | None = None, autoscaling: dict | None = None) -> dict:
    """Serve deployment options for `replicas` replicas, or autoscaling between them and max_replicas.

    A replica takes at most settings.max_concurrent requests at once (its engine slots); the rest wait in Ray's
    router (up to settings.max_queue per proxy, then 503), where the autoscaler counts them: it aims at
    target_ongoing_requests (default settings.target_ongoing_requests, else the slots) running or waiting per
    replica, with AUTOSCALING's settings updated by `autoscaling`. `router`: a ROUTERS name (default
    settings.ray_router).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if max_replicas is not None and max_replicas < replicas:
        raise ValueError(f"max_replicas ({max_replicas}) must be >= replicas ({replicas})")
    router = router or settings.ray_router
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; accepted: {sorted(ROUTERS)}")
    slots = settings.max_concurrent or DEFAULT_MAX_SLOTS  # a replica's engine fits its slots to its GPU: at most this
    target = target_ongoing_requests or settings.target_ongoing_requests or slots
    if not 0 < target <= slots:
        raise ValueError(f"target_ongoing_requests must be in (0, {slots}] (the replica's slots), got {target}")
    opts = {"name": DEPLOYMENT_NAME, "max_ongoing_requests": slots,
            "max_queued_requests": settings.max_queue,
            "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
            "graceful_shutdown_timeout_s": 30, "health_check_period_s": 10}
    if ROUTERS[router] is not None:
        opts["request_router_config"] = {"request_router_class": ROUTERS[router]}
    if max_replicas is not None and max_replicas > replicas:
        opts["autoscaling_config"] = autoscaling_config(replicas, max_replicas, target, autoscaling)
    else:
        opts["num_replicas"] = replicas
    return opts


def _wants_gpu(settings: ServerSettings) -> bool:
    """A GPU per replica unless the device is the CPU, and only if the cluster has GPUs."""
    import ray
    if settings.device is not None and settings.device.startswith("cpu"):
        return False
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1


def deployment(settings: ServerSettings, replicas: int = 1, max_replicas: int | None = None,
               num_cpus: float | None = None, num_gpus: float | None = None,
               target_ongoing_requests: float | None = None, router: str | None = None,
               autoscaling: dict | None = None):
    """The bound Serve application (a Q3TTSReplica deployment) for `serve.run`.

    Args:
        settings: the server's settings, as for `q3tts serve`.
        replicas: replicas to start (with max_replicas: the autoscaling minimum).
        max_replicas: autoscale on queue length up to this many replicas (None: a fixed count).
        num_cpus: CPUs reserved per replica (default settings.replica_cpus); torch uses that many threads.
        num_gpus: GPUs per replica (default: 1 where the cluster has GPUs and the device is not the CPU).
        target_ongoing_requests: requests running or waiting per replica that autoscaling aims at.
        router: a ROUTERS name; autoscaling: AUTOSCALING settings to change.
    """
    num_cpus = settings.replica_cpus if num_cpus is None else num_cpus
    num_gpus = (1 if _wants_gpu(settings) else 0) if num_gpus is None else num_gpus
    opts = deployment_options(settings, num_cpus, num_gpus, replicas, max_replicas, target_ongoing_requests, router,
                              autoscaling)
    threads = max(1, int(num_cpus)) if not num_gpus else None
    return serve.deployment(Q3TTSReplica).options(**opts).bind(settings, threads)


_APP_ARGS = ("replicas", "max_replicas", "num_cpus", "num_gpus", "target_ongoing_requests", "router", "autoscaling")


def build_app(args: dict):
    """Application builder for Serve config files (`import_path: q3tts.server.ray_serve:build_app`).

    `args` holds ServerSettings fields (model, voice_dir, max_concurrent, ...) and the deployment's knobs
    (replicas, max_replicas, num_cpus, num_gpus, target_ongoing_requests, router, autoscaling); a config's `deployments:` entry
    for "Q3TTS" overrides the latter the usual Serve way. Settings not in `args` come from the Q3TTS_*
    environment variables (e.g. Q3TTS_API_KEY from a Kubernetes Secret), then the defaults.
    """
    names = {f.name for f in fields(ServerSettings)}
    unknown = sorted(set(args) - names - set(_APP_ARGS))
    if unknown:
        raise ValueError(f"unknown q3tts args {unknown}; accepted: {sorted(names | set(_APP_ARGS))}")
    settings = replace(parse_args([]), **{k: v for k, v in args.items() if k in names})
    return deployment(settings, **{k: args[k] for k in _APP_ARGS if k in args})


def start(settings: ServerSettings, **deployment_kwargs) -> None:
    """Connect to Ray (settings.ray_address, or a new local instance), start Serve's proxy on settings.host /
    settings.port and deploy the q3tts application there; returns once every replica is up."""
    import ray
    if not ray.is_initialized():
        ctx = ray.init(address=settings.ray_address or "local", namespace="q3tts")
        address = getattr(ctx, "address_info", {}).get("gcs_address", settings.ray_address)  # None via ray://
        log.info("Ray %s at %s", "joined" if settings.ray_address else "started", address)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    app = deployment(settings, replicas=max(1, settings.replicas), max_replicas=settings.max_replicas or None,
                     **deployment_kwargs)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)


def stop(settings: ServerSettings) -> None:
    """Undo start: a local Ray is shut down whole; on a joined cluster only our application is deleted."""
    import ray
    try:
        if settings.ray_address:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    # SIGTERM's default would leave a local Ray running; SIGINT is ignored in a shell script's background job;
    # ray.init installs handlers of its own: so (re)install ours, for both
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def serve_main(settings: ServerSettings) -> int:
    """`q3tts serve --replicas N`: start, serve until SIGINT / SIGTERM, stop (also when stopped mid-start)."""
    _stop_on_signals()
    t0 = time.perf_counter()
    try:
        start(settings)
        _stop_on_signals()
        log.info("Ray Serve: %d replica(s)%s of %s on http://%s:%d, up in %.1f s", max(1, settings.replicas),
                 f" (autoscaling up to {settings.max_replicas})" if settings.max_replicas else "", settings.model,
                 settings.host, settings.port, time.perf_counter() - t0)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log.info("stopping Ray Serve")
    finally:
        stop(settings)
    return 0
