"""`q3tts serve` (or any CLI command) with a timeline of its start on stderr: '[tl  12.34] ...' lines, seconds since
this process started, at each phase (torch imported, the checkpoint loading, the runner built, the captures) and at
the end of each warm-up the engine runs, with its seconds, Dynamo's seconds and the compile-cache counts between its
start and end (q3tts.engine.compile.describe_counts): which classes a cold start compiled, took from the cache or
waited for (BENCHMARKS.md: where a cold start's time goes). The server itself is unchanged; each timed phase
synchronizes the device before and after it. Dynamo is imported where the command imports it (`q3tts serve` starts its
compile helpers before that: importing it here first would start them seconds later than the real command does).

    Q3TTS_COMPILE_CACHE=/tmp/cc TRITON_CACHE_DIR=/tmp/cc/triton \
        python bench/start_timeline.py serve --model /tmp/ck06 --port 8101 2> start.log
"""

import sys
import time

T0 = time.perf_counter()


def stamp(msg: str) -> None:
    print(f"[tl {time.perf_counter() - T0:7.2f}] {msg}", file=sys.stderr, flush=True)


import torch  # noqa: E402

stamp("torch imported")
import q3tts.api  # noqa: E402
from q3tts.engine import compile as qc  # noqa: E402
from q3tts.engine import graphs  # noqa: E402
from q3tts.engine import runner as qrunner  # noqa: E402
from q3tts.engine import vocoder as qvoc  # noqa: E402
from q3tts.models import loaders  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(label: str, fn):
    """fn with a line at its start and one at its end (seconds, Dynamo's seconds, the compile counts between)."""
    def run(*a, **k):
        sync()
        t, counts, dyn = time.perf_counter(), qc.compile_counts(), qc.dynamo_seconds()
        stamp(f"{label} start")
        out = fn(*a, **k)
        sync()
        stamp(f"{label} end: {time.perf_counter() - t:.2f} s, dynamo {qc.dynamo_seconds() - dyn:.2f} s, "
              f"{qc.describe_counts(counts)}")
        return out
    return run


def install() -> None:
    """Wrap the phases: the checkpoint's loading, the runner's construction, each warm-up (graphs.warm_ups), the
    runner's and the vocoder's captures, and every CUDA graph capture (a running count every 20)."""
    warm_ups, capture, captured = graphs.warm_ups, graphs.capture, [0, 0.0]
    graphs.warm_ups = lambda runner: [(n, timed(f"unit {n}", fn)) for n, fn in warm_ups(runner)]

    def counted(fn, pool):
        t = time.perf_counter()
        out = capture(fn, pool)
        captured[0] += 1
        captured[1] += time.perf_counter() - t
        if captured[0] % 20 == 0:
            stamp(f"captures so far {captured[0]}: {captured[1]:.2f} s")
        return out
    graphs.capture = qvoc.capture = counted
    for cls, name in ((qrunner.ModelRunner, "capture_graphs"), (qvoc.StreamingVocoder, "capture_graphs"),
                      (qrunner.ModelRunner, "__init__")):
        setattr(cls, name, timed(f"{cls.__name__}.{name}", getattr(cls, name)))
    q3tts.api.load_checkpoint = loaders.load_checkpoint = timed("load_checkpoint", loaders.load_checkpoint)


if __name__ == "__main__":
    install()
    from q3tts.cli import main
    stamp("cli imported")
    sys.exit(main(sys.argv[1:]))
