"""Ray Serve: `q3tts serve --replicas 4` (a local Ray, four CPU replicas of the tiny CustomVoice checkpoint, a
quarter CPU each) driven through Ray's HTTP proxy by the official openai client and a WebSocket client: requests
spread evenly over the replicas (the least-ongoing router), audio streamed through the proxy, a WebSocket speech
session, a replica killed under load losing only its own streams, and Ray stopped with the server; then the deploy/
files and the deployment options (no Ray needed).

One Ray instance for the module (Ray and its replicas take a minute or more to start on two cores). The test
process joins that Ray as a second driver only to find and kill a replica actor.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve not installed: pip install 'q3tts[ray]' (in the test extra)")
import ray  # noqa: E402
from ray import serve  # noqa: E402

from q3tts.server.ray_serve import APP_NAME, DEPLOYMENT_NAME  # noqa: E402
from tests.golden import fixtures as fx  # noqa: E402

from .live import SPF  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXT = "The same sentence for every stream."
LONG = 200  # frames of a stream that must outlast the routing of the others (prompt + LONG <= --max-seq-len 256)
REPLICAS, SLOTS = 4, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayServer:
    def __init__(self, tmp: Path):
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "serve.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-c", "import sys; from q3tts.cli import main; sys.exit(main())", "serve",
               "--replicas", str(REPLICAS), "--replica-cpus", "0.25", "--model", str(fx.checkpoint("cv06")),
               "--served-model-name", "tiny", "--device", "cpu", "--port", str(self.port), "--max-concurrent", str(SLOTS),
               "--max-seq-len", "256", "--voice-dir", str(tmp / "voices")]
        with open(self.log, "wb") as out:  # a new session: the server, its Ray and Ray's workers form one group
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         start_new_session=True)
        self.gcs_address = None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 300) -> set[str]:
        """Until /ready answered 200 from every replica; -> their ids."""
        deadline, ready = time.time() + timeout, set()
        while len(ready) < REPLICAS:
            assert self.proc.poll() is None, f"q3tts serve exited ({self.proc.returncode}):\n{self.tail()}"
            assert time.time() < deadline, f"replicas not ready after {timeout} s:\n{self.tail()}"
            try:
                r = httpx.get(self.base_url + "/ready", timeout=5)
                # a 200 without the replica header is not a replica's answer (one came in a full run, cause unknown)
                if r.status_code == 200 and "x-q3tts-replica" in r.headers:
                    ready.add(r.headers["x-q3tts-replica"])
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        for line in self.log.read_text(errors="replace").splitlines():
            if "Ray started at " in line:
                self.gcs_address = line.rsplit(" ", 1)[-1]
        assert self.gcs_address, f"no Ray address in the log:\n{self.tail()}"
        return ready

    def client(self):
        import openai
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="none", max_retries=0, timeout=120)

    def stop(self, timeout: float = 90) -> int:
        """SIGINT, as Ctrl-C; -> exit status. SIGKILL of the whole group if it does not stop in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                raise
        return self.proc.returncode


@pytest.fixture(scope="module")
def rs(tmp_path_factory):
    server = RayServer(tmp_path_factory.mktemp("ray-serve"))
    try:
        server.replicas = server.wait_ready()
        # "auto" (the newest local Ray, which the server just started) rather than the address: only then does
        # a joining driver send Ray's token (~/.ray/auth_token), which a local Ray checks by default
        ray.init(address="auto", namespace="q3tts-tests", log_to_driver=False)
        assert ray.get_runtime_context().gcs_address == server.gcs_address
        yield server
    finally:
        ray.shutdown()
        if server.proc.poll() is None:
            try:
                server.stop()
            finally:
                try:  # anything of that group still alive (an earlier failure): end it
                    os.killpg(server.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class Stream:
    """One streamed pcm request in a thread: the replica that answered, each read's size and arrival time,
    and how it ended (None: the body ended cleanly; else the exception)."""

    def __init__(self, client, max_new_tokens: int):
        self.client, self.max_new_tokens = client, max_new_tokens
        self.replica, self.reads, self.error = None, [], None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            with self.client.audio.speech.with_streaming_response.create(
                    model="tiny", input=TEXT, voice="aiden", response_format="pcm",
                    extra_body={"max_new_tokens": self.max_new_tokens, "do_sample": False,
                                "subtalker_dosample": False}) as r:
                self.replica = r.headers.get("x-q3tts-replica")
                for b in r.iter_bytes():
                    self.reads.append((time.monotonic(), len(b)))
                    self.first.set()
        except Exception as e:  # noqa: BLE001 (recorded, asserted on by the test)
            self.error = e
        finally:
            self.first.set()

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.reads)

    def join(self, timeout: float = 120) -> "Stream":
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "stream did not end"
        return self


def _replica_actor(replica: str):
    return ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{replica}", namespace="serve")


def _running_replicas() -> int:
    status = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
    return status.replica_states.get("RUNNING", 0)


def staggered(client, n: int, max_new_tokens: int = LONG) -> list[Stream]:
    """n long streams, each started once the one before has its first audio (so the proxy has routed it)."""
    streams = []
    for _ in range(n):
        streams.append(Stream(client, max_new_tokens))
        assert streams[-1].first.wait(120), "no first chunk"
    assert all(s.error is None for s in streams), [s.error for s in streams]
    return streams


def test_streams_spread_evenly_over_the_replicas(rs):
    client = rs.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]  # the whole app is behind the proxy
    # one after another, 2 per replica: each goes to a replica with the fewest running streams, so every replica
    # gets 2 (Serve's default router compares 2 random replicas and can leave one with 3 and another with 1)
    streams = staggered(client, 2 * REPLICAS)
    last_start = streams[-1].reads[0][0]
    for s in streams:
        s.join()
    assert [s.error for s in streams] == [None] * len(streams)
    # the premise: every stream was still running when the last one started
    assert all(s.reads[-1][0] > last_start for s in streams[:-1])
    by_replica = Counter(s.replica for s in streams)
    assert set(by_replica) == rs.replicas and sorted(by_replica.values()) == [2] * REPLICAS, by_replica

    # the same number at once: requests routed in the same instant are counted as they are chosen, so again 2 each
    burst = [Stream(client, max_new_tokens=LONG) for _ in range(2 * REPLICAS)]
    for s in burst:
        s.join()
    assert [s.error for s in burst] == [None] * len(burst)
    assert sorted(Counter(s.replica for s in burst).values()) == [2] * REPLICAS, Counter(s.replica for s in burst)

    # every slot at once: a replica takes at most SLOTS (max_ongoing_requests), so each takes exactly SLOTS. The streams
    # are long enough that none ends before the last is routed (a short one could, on a loaded machine, and its
    # replica would take one more)
    burst = [Stream(client, max_new_tokens=LONG) for _ in range(REPLICAS * SLOTS)]
    for s in burst:
        s.join()
    assert [s.error for s in burst] == [None] * len(burst)
    assert max(s.reads[0][0] for s in burst) < min(s.reads[-1][0] for s in burst)  # the premise
    assert Counter(s.replica for s in burst) == {r: SLOTS for r in rs.replicas}
    for s in burst:
        assert s.nbytes > 0 and s.nbytes % (2 * SPF) == 0  # whole 80 ms frames of s16 pcm
        # streamed through the proxy: the chunks (1, 2, 4, 8, ... frames) arrive as several reads over time
        assert len(s.reads) >= 2 and s.reads[0][0] < s.reads[-1][0]
    # four copies of one model: the same greedy request is the same length on any replica
    assert len({s.nbytes for s in burst}) == 1


def test_websocket_speech_session_through_the_proxy(rs):
    """/v1/audio/speech/stream through Ray's proxy: text streamed in pieces, the official audio of the whole
    text back (as tests/server/test_speech_stream.py checks it on one server), the replica named on the
    handshake."""
    import random

    import numpy as np
    from websockets.sync.client import connect

    from .test_speech_stream import pieces, utterance
    case = fx.get_case("cv06", "english_stream")
    kw = case["kw"]
    with connect(f"ws://127.0.0.1:{rs.port}/v1/audio/speech/stream", open_timeout=30) as ws:
        assert ws.response.headers["x-q3tts-replica"] in rs.replicas
        ws.send(json.dumps({"type": "session.config", "voice": kw["speaker"], "language": kw.get("language"),
                            **fx.manifest("cv06")["greedy"]}))
        for piece in pieces(kw["text"], random.Random(0)):
            ws.send(json.dumps({"type": "input.text", "text": piece}))
        ws.send(json.dumps({"type": "input.done"}))
        _, pcm, done, _ = utterance(ws)
        got = np.frombuffer(pcm, "<i2").astype(np.float32) / 32767
        ref = fx.outputs("cv06")[f"{case['name']}.wav.0"].numpy()
        # the same bound as on one server: float32 audio within 1e-4 of the official, then int16 rounding
        assert got.shape == ref.shape and np.abs(got - ref).max() <= 1e-4 + 0.5 / 32767
        ws.send(json.dumps({"type": "session.close"}))
        assert json.loads(ws.recv(timeout=30)) == {"type": "session.done"}


def test_replica_killed_under_load_loses_only_its_own_streams(rs):
    client = rs.client()
    # long streams (LONG frames: seconds on CPU), 2 per replica, so every one is mid-way when a replica dies
    streams = staggered(client, 2 * REPLICAS)
    by_replica = Counter(s.replica for s in streams)
    assert set(by_replica) == rs.replicas, by_replica
    victim = streams[0].replica
    ray.kill(_replica_actor(victim), no_restart=True)
    for s in streams:
        s.join()
    survivors = [s for s in streams if s.replica != victim]
    killed = [s for s in streams if s.replica == victim]
    assert len(survivors) == len(streams) - by_replica[victim] > 0
    assert [s.error for s in survivors] == [None] * len(survivors)
    full = {s.nbytes for s in survivors}
    assert len(full) == 1, full
    full = full.pop()
    # the killed replica's streams had audio before they ended: the proxy streams; none of them was whole
    assert all(s.nbytes > 0 for s in killed)
    assert all(s.error is not None or s.nbytes < full for s in killed), [(s.error, s.nbytes) for s in killed]

    # Serve replaces the replica; then new requests succeed, on the survivors and the replacement
    deadline = time.time() + 180
    while _running_replicas() < REPLICAS:
        assert time.time() < deadline, "the killed replica was not replaced"
        time.sleep(0.5)
    seen, after = set(), []
    while time.time() < deadline and len(seen) < REPLICAS:
        batch = [Stream(client, max_new_tokens=24) for _ in range(REPLICAS * SLOTS)]  # every slot
        after += [s.join() for s in batch]
        seen |= {s.replica for s in batch}
    assert [s.error for s in after] == [None] * len(after)
    assert len({s.nbytes for s in after}) == 1 and after[0].nbytes > 0
    assert victim not in seen and len(seen) == REPLICAS, seen


def test_stopping_the_server_stops_ray(rs):
    ray.shutdown()  # the test's driver leaves first
    assert rs.stop() == 0, rs.tail()
    host, port = rs.gcs_address.rsplit(":", 1)
    with pytest.raises(OSError):  # Ray's GCS is gone with the server that started it
        socket.create_connection((host, int(port)), timeout=2).close()
    with pytest.raises(httpx.TransportError):  # and so is the proxy
        httpx.get(rs.base_url + "/ready", timeout=2)


# --------------------------------------------------------------------------- deploy/ files (no Ray started)
def _serve_configs() -> list[dict]:
    """deploy/serve_config.yaml and the serveConfigV2 inside the KubeRay RayService manifest."""
    import yaml
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "kuberay-rayservice.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # the voice store every replica reads
    return [yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text()),
            yaml.safe_load(service["spec"]["serveConfigV2"])]


def test_deploy_configs_are_valid_serve_configs_that_build():
    from ray.serve.schema import ServeDeploySchema
    for cfg in _serve_configs():
        schema = ServeDeploySchema.model_validate(cfg)
        (app,) = schema.applications
        module, _, name = app.import_path.partition(":")
        build = getattr(__import__(module, fromlist=[name]), name)
        d = build(app.args)._bound_deployment  # what Serve would deploy (no Ray needed to build it)
        settings, _ = d.init_args
        assert settings.voice_dir == app.args["voice_dir"] and settings.model == app.args["model"]
        assert d.ray_actor_options == {"num_cpus": app.args["num_cpus"], "num_gpus": 1}
        auto = d._deployment_config.autoscaling_config
        assert (auto.min_replicas, auto.max_replicas) == (app.args["replicas"], app.args["max_replicas"])
        assert auto.target_ongoing_requests == app.args["target_ongoing_requests"]
        assert d._deployment_config.max_ongoing_requests == app.args["max_concurrent"]


def test_build_app_checks_its_args():
    from q3tts.server.ray_serve import build_app
    with pytest.raises(ValueError, match="unknown q3tts args \\['replica'\\].*accepted"):
        build_app({"model": "m", "replica": 2})
    with pytest.raises(ValueError, match="max_replicas \\(1\\) must be >= replicas \\(2\\)"):
        build_app({"model": "m", "replicas": 2, "max_replicas": 1, "num_gpus": 0})
    d = build_app({"model": "m", "replicas": 3, "num_cpus": 2, "num_gpus": 0})._bound_deployment
    assert d._deployment_config.num_replicas == 3 and d._deployment_config.autoscaling_config is None
    assert d.init_args[1] == 2  # torch threads on a CPU replica: its CPUs


def test_deployment_options_state_router_and_autoscaling():
    from q3tts.server.ray_serve import AUTOSCALING, LeastOngoingRouter, build_app
    d = build_app({"model": "m", "replicas": 1, "max_replicas": 4, "num_gpus": 0, "max_concurrent": 32,
                   "target_ongoing_requests": 16, "autoscaling": {"upscale_delay_s": 2}})._bound_deployment
    cfg = d._deployment_config
    assert cfg.max_ongoing_requests == 32 and cfg.request_router_config.request_router_class.endswith(
        "ray_serve.LeastOngoingRouter")
    auto = cfg.autoscaling_config
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 1, 4, 16)
    assert auto.upscale_delay_s == 2 and all(getattr(auto, k) == v for k, v in AUTOSCALING.items()
                                             if k != "upscale_delay_s")
    d = build_app({"model": "m", "num_gpus": 0, "router": "power-of-two"})._bound_deployment
    assert d._deployment_config.request_router_config.request_router_class.endswith("PowerOfTwoChoicesRequestRouter")
    for args, match in [({"router": "random"}, "unknown router 'random'; accepted: \\['least-ongoing', 'power-of-two'\\]"),
                        ({"max_concurrent": 8, "target_ongoing_requests": 9}, "target_ongoing_requests must be in \\(0, 8\\]"),
                        ({"max_replicas": 2, "autoscaling": {"upscale": 1}}, "unknown autoscaling settings")]:
        with pytest.raises(ValueError, match=match):
            build_app({"model": "m", "num_gpus": 0, **args})
    assert LeastOngoingRouter.__mro__[1].__name__ == "FIFOMixin"  # requests leave Serve's queue in arrival order


def test_every_replica_gets_the_compiled_artifact_and_logs_its_start(tmp_path, capsys):
    import logging

    from q3tts.server.ray_serve import _log_to_stderr, build_app
    d = build_app({"model": "m", "num_gpus": 0, "replicas": 1, "max_replicas": 3,
                   "compile_artifact": str(tmp_path / "a.bin")})._bound_deployment
    settings, _ = d.init_args  # one bound init for the first replica and those the autoscaler adds
    assert settings.compile_artifact == str(tmp_path / "a.bin")
    qlog = logging.getLogger("q3tts")
    saved = qlog.handlers[:], qlog.level, qlog.propagate
    try:  # a replica's process: Serve configures only its own loggers
        qlog.handlers[:] = []
        _log_to_stderr("info")
        logging.getLogger("q3tts.server").info("replica r: engine built")
        logging.getLogger("q3tts.engine").debug("not at info")
        _log_to_stderr("info")  # once: no second handler
        assert len(qlog.handlers) == 1
    finally:
        qlog.handlers[:], qlog.level, qlog.propagate = saved
    err = capsys.readouterr().err
    assert "INFO q3tts.server: replica r: engine built" in err and "not at info" not in err


def test_a_burst_spreads_over_replicas_whose_cached_counts_expired():
    """The router's choice alone (no Ray): of four idle replicas only one is still in Serve's queue-length cache
    (the others' entries expired), a burst of 8 is routed in one instant (no probe answers), and every replica
    gets 2. Taking only cached replicas as candidates gave that one replica 4, until it was full."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.request_router.common import ReplicaQueueLengthCache

    from q3tts.server.ray_serve import LeastOngoingRouter

    async def burst():
        router = LeastOngoingRouter.__new__(LeastOngoingRouter)  # its state, not Serve's machinery
        replicas = {f"r{i}": SimpleNamespace(replica_id=f"r{i}", max_ongoing_requests=SLOTS) for i in range(REPLICAS)}
        probed = []

        async def probe(rs, backoff_index):  # no answer in time, as under a burst on a loaded machine
            probed.append(sorted(r.replica_id for r in rs))
            return []

        router.__dict__.update(_replicas=replicas, _replica_queue_len_cache=ReplicaQueueLengthCache(),
                               _use_replica_queue_len_cache=True, _probe_queue_lens=probe,
                               _lazily_fetched_loop=None)
        router._replica_queue_len_cache.update("r0", 0)
        chosen = []
        for _ in range(2 * REPLICAS):
            candidates = (await router.choose_replicas(list(replicas.values())))[0]
            r = await router._select_from_candidate_replicas(candidates, 0)
            chosen.append(r.replica_id)
            router.on_send_request(r.replica_id)
        await asyncio.sleep(0)  # the background probes Serve started for the replicas not in its cache
        return router, chosen, probed

    router, chosen, probed = asyncio.run(burst())
    assert Counter(chosen) == {f"r{i}": 2 for i in range(REPLICAS)}, chosen
    assert probed[0] == ["r1", "r2", "r3"]  # the expired ones: probed in the background, not waited for
    for r in set(chosen):
        router.on_request_completed(r, "id")
    assert router._inflight == Counter({f"r{i}": 1 for i in range(REPLICAS)})
