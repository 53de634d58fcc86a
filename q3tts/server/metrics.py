"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from q3tts.engine import compile_counts

TTFA_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class Metrics:
    """Args:
        engine_stats: () -> object with queue_depth, active_slots, max_slots and counters (an
            q3tts.engine.engine.EngineCounters), read at scrape time.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine_stats: Callable[[], object]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("q3tts_http_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.errors = Counter("q3tts_errors", "Error answers by OpenAI error type and code", ["type", "code"],
                              registry=r)
        self.speech = Counter("q3tts_speech_requests", "Speech generations by outcome "
                              "(completed, cancelled, failed) and response format", ["outcome", "format"], registry=r)
        self.audio_seconds = Counter("q3tts_audio_seconds", "Seconds of audio generated (before speed)", registry=r)
        self.ttfa = Histogram("q3tts_time_to_first_audio_seconds", "From request arrival to its first audio chunk",
                              buckets=TTFA_BUCKETS, registry=r)
        self.rtf = Histogram("q3tts_real_time_factor", "Per finished request: wall time / audio duration "
                             "(below 1 is faster than real time)", buckets=RTF_BUCKETS, registry=r)
        for stat, doc in (("queue_depth", "Requests waiting for an engine slot"),
                          ("active_slots", "Engine slots generating now"),
                          ("max_slots", "Engine slots (max concurrent streams)")):
            Gauge(f"q3tts_{stat}", doc, registry=r).set_function(lambda stat=stat: getattr(engine_stats(), stat))
        # memory, for soak tests and leak alarms: both must stay flat under steady load after warm-up
        Gauge("q3tts_process_resident_bytes", "Resident set size of the server process", registry=r).set_function(
            process_rss_bytes)
        Gauge("q3tts_gpu_allocated_bytes", "Bytes held by PyTorch tensors on the current CUDA device (0 without "
              "CUDA)", registry=r).set_function(gpu_allocated_bytes)
        Gauge("q3tts_gpu_reserved_bytes", "Bytes PyTorch's CUDA caching allocator holds (0 without CUDA)",
              registry=r).set_function(lambda: gpu_allocated_bytes(reserved=True))
        self.ready = Gauge("q3tts_ready", "1 once the warm-up request has finished", registry=r)
        r.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def process_rss_bytes() -> float:
    """Current (not peak) resident set size: /proc on Linux, psutil elsewhere if installed, else NaN."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return float("nan")
    return float(psutil.Process().memory_info().rss)


def gpu_allocated_bytes(reserved: bool = False) -> float:
    torch = sys.modules.get("torch")  # the server has imported it; never initialise CUDA from a scrape
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0.0
    return float(torch.cuda.memory_reserved() if reserved else torch.cuda.memory_allocated())


class _EngineCollector:
    """The engine's own cumulative counters: steps, time per step phase, admission wait."""

    def __init__(self, engine_stats: Callable[[], object]):
        self.engine_stats = engine_stats

    def collect(self):
        c = self.engine_stats().counters
        yield CounterMetricFamily("q3tts_engine_steps", "Engine steps (one frame for every running stream each)",
                                  value=c.steps)
        phases = CounterMetricFamily("q3tts_engine_step_seconds", "Engine thread time by step phase: admit "
                                     "(prefill of newcomers), decode (the frame), vocode (audio chunks)",
                                     labels=["phase"])
        for phase, seconds in c.phase_s.items():
            phases.add_metric([phase], seconds)
        yield phases
        yield CounterMetricFamily("q3tts_admitted_requests", "Requests prefilled into a slot", value=c.admitted)
        yield CounterMetricFamily("q3tts_admission_wait_seconds", "Summed over admitted requests: from arrival to "
                                  "the start of their prefill", value=c.admission_wait_s)
        if "torch._dynamo" in sys.modules:  # (never imported for a scrape)
            counts = compile_counts()
            graphs = CounterMetricFamily("q3tts_compiled_graphs", "Process totals of compilation: graphs Dynamo "
                                         "traced (traced), Inductor graphs found in the compile cache (cached) or "
                                         "compiled (compiled); once ready, none should grow while serving",
                                         labels=["kind"])
            for kind, key in (("traced", "traced"), ("cached", "fx_hit"), ("compiled", "fx_miss")):
                graphs.add_metric([kind], counts[key])
            yield graphs
