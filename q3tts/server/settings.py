"""Server settings: `q3tts serve` flags, each with an environment-variable equivalent (flag wins)."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

from ..config import generation_overrides


def _default_voice_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "q3tts", "voices")


@dataclass(slots=True)
class ServerSettings:
    model: str = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"  # hub id or local directory
    served_model_name: str | None = None  # the id in /v1/models (default: the model's last path part)
    host: str = "127.0.0.1"
    port: int = 8000
    device: str | None = None  # default: cuda if available
    dtype: str | None = None  # default: bfloat16 on cuda, float32 on cpu
    quantization: str | None = None  # int8 / int4 / int8dyn (cpu), int8 / fp8 (cuda); default none (exact)
    voice_dir: str = ""  # stored voices (Base models): voices.sqlite3 + one .safetensors per voice
    max_text_length: int = 4096  # characters of `input` spoken as one request
    max_split_text_length: int = 1_000_000  # characters of `input` split into segments (split_granularity)
    max_unstreamed_text_length: int = 20_000  # characters of a response held whole (stream false: X-Finish-Reason)
    max_frames_per_token: float | None = None  # the runaway guard (None: q3tts.inputs.request.MAX_FRAMES_PER_TOKEN)
    max_upload_bytes: int = 10 * 1024 * 1024  # a reference clip (multipart file or decoded base64)
    max_queue: int = 256  # requests waiting for a slot; more get 503
    clone_workers: int = 2  # threads that clone reference audio (voice uploads, inline ref_audio)
    clone_queue: int = 16  # clones that may wait for one of them; more get 503
    encode_workers: int | None = None  # processes encoding mp3 / opus / aac / flac and speed (None: the CPUs less
    # one, 1 to 8; 0: in the server's process)
    max_concurrent: int | None = None  # engine slots: streams generated together (None: fitted to the memory budget)
    max_seq_len: int | None = None  # KV positions per slot: prompt + frames (12.5 per second of audio; None: 4096
    # where the budget allows)
    gpu_memory_utilization: float | None = None  # the budget as a fraction of the GPU's memory (default 0.9)
    gpu_memory: float | None = None  # the budget in GB (a GPU shared with other work, e.g. a Jetson)
    kv_block_size: int = 0  # > 0: paged KV cache with blocks of this many positions (memory follows use); 0: per slot
    compile_cache: str | None = None  # torch.compile's cache directory ("off": torch's /tmp default; None:
    # ~/.cache/q3tts/compile/torch-<version>, or TORCHINDUCTOR_CACHE_DIR where the user set it)
    compile_artifact: str | None = None  # a file from `q3tts warmup --save`: compiled code loaded before compiling
    generation_config: str | None = None  # a JSON file of generation_config.json's fields laid over the model's
    api_key: str | None = None  # when set, all but /health, /ready and / need "Authorization: Bearer <key>"
    first_chunk_frames: int = 1  # frames (80 ms each) in the first audio chunk of a stream
    chunk_frames: int = 16  # the largest chunk (chunks double from the first one up to it)
    warmup: bool = True  # run one short request at startup; /ready is true after it
    # WebSocket sessions: idle limits as vLLM-Omni's, and fairness (a session or a client cannot take every slot)
    ws_config_timeout: float = 10.0  # seconds for a new socket's first message / session.config
    ws_idle_timeout: float = 30.0  # seconds without a client message (and no audio going out) that end a session
    ws_max_utterances: int = 8  # utterances of one session in flight (speaking or queued); more get queue_full
    ws_max_client_utterances: int = 32  # the same over all sessions of one client address
    voice_alias: tuple[str, ...] = ()  # "NAME=VOICE": OpenAI voice names (Pipecat's) -> this model's voices
    batch_invariant: bool = False  # a request's audio bit-identical whatever shares its steps (CUDA; slower)
    log_level: str = "info"
    aligner: str | None = None  # forced aligner for word_timestamps (hub id or directory); None: refused with a 400
    # Ray Serve (q3tts.server.ray_serve): replicas > 0 or a ray_address serves through Ray instead of one uvicorn
    replicas: int = 0  # server replicas (one GPU each where there are GPUs); 0: no Ray
    max_replicas: int = 0  # > replicas: autoscale on queue length between replicas and this
    ray_address: str | None = None  # join this Ray cluster (default: start a local Ray, stopped on exit)
    replica_cpus: float = 1.0  # CPUs Ray reserves per replica (torch threads on CPU replicas)
    target_ongoing_requests: float = 0  # autoscaling: streams per replica it aims at (0: the slots)
    ray_router: str = "least-ongoing"  # Ray Serve's choice of replica (ray_serve.ROUTERS)

    def __post_init__(self):
        self.voice_dir = self.voice_dir or _default_voice_dir()

    @property
    def memory_budget(self) -> dict:
        """The engine's memory options (only those given: an existing engine is then taken as it is)."""
        return {k: v for k, v in (("gpu_memory_utilization", self.gpu_memory_utilization),
                                  ("gpu_memory", self.gpu_memory), ("kv_block_size", self.kv_block_size or None))
                if v is not None}

    @property
    def model_id(self) -> str:
        return self.served_model_name or Path(str(self.model).rstrip("/")).name or str(self.model)


# flag -> (field, type, help); environment variable: Q3TTS_<FIELD upper-cased>
_FLAGS = [
    ("--model", "model", str, "hub id or local checkpoint directory"),
    ("--served-model-name", "served_model_name", str, "model id reported by /v1/models"),
    ("--host", "host", str, "bind address"),
    ("--port", "port", int, "bind port"),
    ("--device", "device", str, "cuda, cuda:1, cpu (none: cuda if available)"),
    ("--dtype", "dtype", str, "bfloat16 / float16 / float32 (none: bf16 on GPU, fp32 on CPU)"),
    ("--quantization", "quantization", str, "int8 / int4 (weight-only) or int8dyn (int8 weights and "
                                            "activations) on cpu, int8 / fp8 on cuda; none (default) is exact"),
    ("--voice-dir", "voice_dir", str, "directory of stored voices (created if missing)"),
    ("--max-text-length", "max_text_length", int, "maximum characters of input text spoken as one request (a "
                                                   "longer text is split at sentences)"),
    ("--max-split-text-length", "max_split_text_length", int, "maximum characters of input text split into "
                                                               "segments spoken in parallel"),
    ("--max-unstreamed-text-length", "max_unstreamed_text_length", int, "maximum characters of a response that is "
                                                                         "not streamed (stream false)"),
    ("--max-frames-per-token", "max_frames_per_token", float, "runaway guard: a request without max_new_tokens "
                                                              "stops after this many frames per text token (at "
                                                              "least 64 frames; 0: off; default 16)"),
    ("--max-upload-bytes", "max_upload_bytes", int, "maximum size of a reference audio upload"),
    ("--max-queue", "max_queue", int, "requests that may wait for a slot; more are refused with 503"),
    ("--clone-workers", "clone_workers", int, "threads that clone reference audio (uploads, inline ref_audio)"),
    ("--encode-workers", "encode_workers", int, "processes that encode mp3 / opus / aac / flac and change speed, "
                                                "beside the server's (default: one fewer than its CPUs, 1 to 8; 0: "
                                                "in the server's own process)"),
    ("--clone-queue", "clone_queue", int, "clones that may wait for a clone thread; more are refused with 503"),
    ("--max-concurrent", "max_concurrent", int, "streams generated at once (engine slots; default: as many as the "
                                                "memory budget holds at --max-seq-len, at most 32; on a CPU 4)"),
    ("--max-seq-len", "max_seq_len", int, "KV-cache positions per stream (prompt + 12.5 frames per second; "
                                          "default 4096, less if not even one stream fits the budget)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float, "memory budget as a fraction of the GPU's "
                                                                  "total (default 0.9; on a CPU, of the host memory "
                                                                  "available, default 0.5)"),
    ("--gpu-memory", "gpu_memory", float, "memory budget in GB (for a GPU shared with other work; overrides "
                                          "--gpu-memory-utilization)"),
    ("--kv-block-size", "kv_block_size", int, "paged KV cache: blocks of this many positions (1..64, a power of "
                                              "two, e.g. 64) handed to streams as they grow, as many as the budget "
                                              "holds; 0: max-seq-len positions per slot from the start"),
    ("--compile-cache", "compile_cache", str, "directory that keeps what torch.compile compiled, so a restart "
                                              "reuses it ('off': torch's default under /tmp; default "
                                              "~/.cache/q3tts/compile/torch-<version>, or $TORCHINDUCTOR_CACHE_DIR)"),
    ("--load-artifact", "compile_artifact", str, "a compiled artifact from `q3tts warmup --save FILE` (built on a "
                                                 "machine with the same GPU, torch and model): loaded into the "
                                                 "compile cache before anything compiles, for a start in seconds "
                                                 "(made for another setup: a warning and a normal cold start)"),
    ("--generation-config", "generation_config", str, "a JSON file of generation_config.json's fields (e.g. "
                                                      '{"do_sample": false}) laid over the model\'s: the defaults '
                                                      "of requests that send no sampling fields"),
    ("--api-key", "api_key", str, "require this Bearer token on every route but /health, /ready and the web "
                                  "page (WebSockets: also ?api_key=)"),
    ("--first-chunk-frames", "first_chunk_frames", int, "frames (80 ms) in the first streamed chunk"),
    ("--chunk-frames", "chunk_frames", int, "largest streamed chunk (chunks double up to it)"),
    ("--ws-config-timeout", "ws_config_timeout", float, "WebSocket: seconds a new session has for its first "
                                                        "message"),
    ("--ws-idle-timeout", "ws_idle_timeout", float, "WebSocket: seconds without a client message (while no audio "
                                                    "is going out) that end a session and free its slots"),
    ("--ws-max-utterances", "ws_max_utterances", int, "WebSocket: utterances one session may have speaking or "
                                                      "queued; more are refused (queue_full)"),
    ("--ws-max-client-utterances", "ws_max_client_utterances", int, "WebSocket: the same over all sessions of one "
                                                                    "client address"),
    ("--log-level", "log_level", str, "debug, info, warning, error"),
    ("--aligner", "aligner", str, "forced aligner for word timestamps (e.g. Qwen/Qwen3-ForcedAligner-0.6B or a "
                                  "directory), loaded beside the model; without it word_timestamps is refused"),
    ("--replicas", "replicas", int, "serve N replicas on Ray Serve (pip install 'q3tts[ray]'); 0: one process"),
    ("--max-replicas", "max_replicas", int, "autoscale on queue length up to this many replicas (Ray Serve)"),
    ("--ray-address", "ray_address", str, "join this Ray cluster (e.g. ray://head:10001 or auto) instead of a "
                                          "local Ray"),
    ("--replica-cpus", "replica_cpus", float, "CPUs Ray reserves per replica"),
    ("--target-ongoing", "target_ongoing_requests", float, "autoscaling: streams per replica to aim at (the "
                                                           "stall-free count of one GPU; 0: the slots)"),
    ("--ray-router", "ray_router", str, "replica choice: least-ongoing (fewest streams of all) or power-of-two "
                                        "(Serve's default)"),
]


def env_name(field: str) -> str:
    return "Q3TTS_" + field.upper()


# flags whose values must be >= 1 (when given)
POSITIVE_FLAGS = ("max_text_length", "max_split_text_length", "max_unstreamed_text_length", "max_upload_bytes",
                  "max_queue", "clone_workers", "max_concurrent", "max_seq_len", "first_chunk_frames", "chunk_frames",
                  "ws_max_utterances", "ws_max_client_utterances")


def check_shared_flags(ap: argparse.ArgumentParser, ns) -> None:
    """The checks of the flags `q3tts serve` and `q3tts wyoming` share: counts, the memory budget and the KV block
    size (ns: either's parsed flags; a name it lacks is not checked). ap.error on the first bad one."""
    for name in POSITIVE_FLAGS:
        if getattr(ns, name, None) is not None and getattr(ns, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if ns.gpu_memory_utilization is not None and not 0 < ns.gpu_memory_utilization <= 1:
        ap.error("--gpu-memory-utilization must be in (0, 1]")
    kv = ns.kv_block_size
    if kv and (kv < 0 or kv > 64 or kv & (kv - 1)):
        ap.error("--kv-block-size must be 0 or a power of two up to 64")
    if ns.gpu_memory is not None and not ns.gpu_memory > 0:
        ap.error("--gpu-memory must be > 0 (GB)")


def parse_args(argv: list[str] | None = None, environ: dict | None = None) -> ServerSettings:
    """Flags, then Q3TTS_* environment variables, then defaults."""
    env = os.environ if environ is None else environ
    defaults = ServerSettings()
    ap = argparse.ArgumentParser(prog="q3tts serve", description="OpenAI-compatible speech server for Qwen3-TTS.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for flag, name, typ, help_ in _FLAGS:
        default = env.get(env_name(name))
        default = typ(default) if default not in (None, "") else getattr(defaults, name)
        ap.add_argument(flag, dest=name, type=typ, default=default, help=f"{help_} [env {env_name(name)}]")
    no_warmup = env.get(env_name("warmup"), "1").lower() in ("0", "false", "no")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", default=not no_warmup,
                    help=f"skip the warm-up request (/ready is true at once) [env {env_name('warmup')}=0]")
    alias_env = [a for a in env.get(env_name("voice_alias"), "").split(",") if a.strip()]
    ap.add_argument("--voice-alias", dest="voice_alias", action="append", default=None, metavar="NAME=VOICE",
                    help="map a voice name clients send (OpenAI's: alloy, ash, ...) to one of this model's voices; "
                         "repeatable; defaults in docs/integrations.md [env "
                         f"{env_name('voice_alias')}=alloy=vivian,echo=ryan]")
    invariant = env.get(env_name("batch_invariant"), "0").lower() in ("1", "true", "yes")
    ap.add_argument("--batch-invariant", dest="batch_invariant", action="store_true", default=invariant,
                    help="on CUDA, a request's codes and audio bit-identical alone and beside any other streams "
                         f"(slower: BENCHMARKS.md) [env {env_name('batch_invariant')}=1]")
    a = ap.parse_args(argv)
    a.voice_alias = tuple(a.voice_alias if a.voice_alias is not None else alias_env)
    for alias in a.voice_alias:
        if not re.fullmatch(r"[^=\s]+=[^=\s]+", alias.strip()):
            ap.error(f"--voice-alias {alias!r}: expected NAME=VOICE, e.g. alloy=vivian")
    s = ServerSettings(**{f.name: getattr(a, f.name) for f in fields(ServerSettings) if hasattr(a, f.name)})
    if s.max_frames_per_token is not None and not 0 <= s.max_frames_per_token < float("inf"):
        ap.error("--max-frames-per-token must be >= 0")
    check_shared_flags(ap, s)
    if s.clone_queue < 0:
        ap.error("--clone-queue must be >= 0")
    if s.encode_workers is not None and s.encode_workers < 0:
        ap.error("--encode-workers must be >= 0")
    if not (s.ws_config_timeout > 0 and s.ws_idle_timeout > 0):
        ap.error("--ws-config-timeout and --ws-idle-timeout must be > 0 (seconds)")
    if s.compile_artifact and not os.path.isfile(s.compile_artifact):  # (refused before the model loads)
        ap.error(f"--load-artifact {s.compile_artifact}: no such file (write one with `q3tts warmup --save FILE`)")
    try:
        generation_overrides(s.generation_config)  # refused here, before the model loads
    except ValueError as e:
        ap.error(str(e))
    if s.replicas < 0 or s.max_replicas < 0 or not s.replica_cpus > 0:
        ap.error("--replicas and --max-replicas must be >= 0, --replica-cpus > 0")
    if s.max_replicas and s.max_replicas < max(1, s.replicas):
        ap.error(f"--max-replicas ({s.max_replicas}) must be >= --replicas ({max(1, s.replicas)})")
    if s.target_ongoing_requests < 0 or s.ray_router not in ("least-ongoing", "power-of-two"):
        ap.error("--target-ongoing must be >= 0, --ray-router least-ongoing or power-of-two")
    return s
