"""The server's HTTP side under many streams, on any machine: `q3tts serve` with the model's work replaced by time.

    python -m bench.load.paced_server --port 8000 --slots 256 --decode-ms 6.8 --vocode-ms 4.0 --prefill-ms 5 &
    python -m bench.load.paced_server --port 8000 --slots 128 --prefill-table 1:3.68,2:6.55,4:11.67,16:30.34,64:104.4 &
    python -m bench.load.load --url http://127.0.0.1:8000 --concurrency 64,128,256 --max-new-tokens 126

Everything from the socket to the engine's step is the real code: uvicorn, the middleware, validation, the text
processor, AsyncEngine, the Engine's scheduling, prompt embedding (a tiny random model on the CPU), chunking and
encoding. Only the device's work becomes a wait that releases the GIL, as a wait for the GPU does: each frame
(decode-ms, every step with a running row), each step's vocoding (vocode-ms + vocode-ms-per-frame x its frames, when a
chunk is due) and each admission's prefill of its W newcomers (prefill-ms + prefill-ms-per-request x W, or
--prefill-table's wait for W: admit times measured by wave size; --alone-max: the waves up to it are what the
engine tells the deadline policy are prefill graph replays, as a CUDA runner would; --text-ms: each call that hands a row its streamed text, as a GPU
runner's host->device copy and projection of it; --host-ms: part of each frame spent holding the GIL instead, as a GPU
runner's Python launches of a step do; --prefill-host-share: that share of each admission's wait spent holding the GIL,
as a GPU runner's host-bound admission does); the frames are code 1 (never EOS) and the audio a fixed noise (as a
random-weight checkpoint's vocoder makes: what costs as much to encode or compress as the GPU server's audio). Given the
step times measured on a GPU, the load bench then shows what the server delivers of what the engine makes, and whether
the HTTP side or the client is the limit, without a GPU.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from q3tts.engine.turn import device_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.golden: the tiny checkpoint's recipe


def parse_prefill_table(text: str) -> list[tuple[int, float]]:
    """"W:ms,W:ms,..." (newcomers in one admission step: the wave's whole prefill in ms) -> [(W, ms)] sorted by W."""
    table = {}
    for item in text.split(","):
        w, sep, ms = item.strip().partition(":")
        try:
            w, ms = int(w), float(ms)
        except ValueError:
            w = None
        if not sep or w is None or w < 1 or not 0 <= ms < float("inf") or w in table:
            raise argparse.ArgumentTypeError(f"bad --prefill-table entry {item.strip()!r} in {text!r}: expected "
                                             "W:ms pairs, W a distinct integer >= 1 and ms >= 0, e.g. 1:3.68,4:11.67")
        table[w] = ms
    return sorted(table.items())


def prefill_wait_s(table: list[tuple[int, float]], W: int) -> float:
    """The wait for a wave of W newcomers: the table's value at a given W, linear between given W (from (0, 0) below
    the first), extrapolated past the last along its last two points (never below 0)."""
    points = [(0, 0.0)] + [p for p in table if p[0] > 0]
    for (w0, ms0), (w1, ms1) in zip(points, points[1:]):
        if W <= w1:
            return (ms0 + (ms1 - ms0) * (W - w0) / (w1 - w0)) / 1000
    (w0, ms0), (w1, ms1) = points[-2:]
    return max(0.0, ms1 + (ms1 - ms0) * (W - w1) / (w1 - w0)) / 1000


def busy(seconds: float) -> None:
    """Hold the GIL for `seconds` (a busy loop), as the interpreter launching a step's work does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


_OP = torch.zeros(8)


def launches(n: int) -> None:
    """n tiny torch calls, each of which lets the GIL go and takes it back (torch's bindings release it around every
    op), as a GPU runner's kernel launches and copies do: while another thread runs Python, each of them waits for it
    to give the GIL back."""
    for _ in range(n):
        _OP.add_(1)


def device_sleep(seconds: float) -> None:
    """The device's work as a GIL-free wait: a host sync of the engine's thread (q3tts.engine.turn's device wait)."""
    with device_wait():
        time.sleep(seconds)


class PacedRunner:
    """The engine's ModelRunner with prefill and frame as GIL-free waits; the rest (slots, prompts) is the real one."""

    def __init__(self, runner, prefill_s: float, decode_s: float, prefill_per_request_s: float = 0.0,
                 prefill_table: list[tuple[int, float]] | None = None, alone_max: int | None = None,
                 text_s: float = 0.0, host_s: float = 0.0, prefill_host_share: float = 0.0, host_ops: int = 0):
        self._runner, self.prefill_s, self.decode_s = runner, prefill_s, decode_s
        self.host_ops = host_ops  # torch calls of each frame and of each newcomer's admission (`launches`)
        self.host_s = host_s  # each frame's part that holds the GIL (Python at work), before its GIL-free wait
        self.prefill_host_share = prefill_host_share  # of each admission's wait, the share that holds the GIL
        self.text_s = text_s  # each call that embeds streamed text into rows (the real one runs too)
        self.prefill_per_request_s = prefill_per_request_s  # a batched prefill's part that grows with its rows
        self.prefill_table = prefill_table  # given: replaces both (the wave's wait by its size)
        self.alone_max = alone_max  # given: the GPU runner's prefill regimes the table stands for

    def prefill_alone_max(self, graphs: bool = True) -> float:
        """What a CUDA runner with its prefill graphs answers (the table's waves up to it are graph replays), given
        alone_max; else the CPU runner's."""
        return self._runner.prefill_alone_max(graphs) if self.alone_max is None else self.alone_max

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def admit(self, lo, prepared) -> torch.Tensor:  # the engine's entry (the real one embeds, then prefill_batch)
        return torch.tensor(self.prefill_batch(lo, prepared, [], [p.params for p in prepared]))  # as its [N] code 0

    def prefill_batch(self, lo, prefills, trailings, params, graphs: bool = True) -> list[int]:
        W = len(prefills)
        wait = (prefill_wait_s(self.prefill_table, W) if self.prefill_table
                else self.prefill_s + self.prefill_per_request_s * W)
        busy(self.prefill_host_share * wait)
        launches(self.host_ops * W)
        device_sleep((1 - self.prefill_host_share) * wait)
        return [1] * len(prefills)

    def append_text(self, feeds) -> None:
        time.sleep(self.text_s)
        self._runner.append_text(feeds)

    def decode_frame(self, B: int, active: list[bool]):
        from q3tts.engine.scheduler import FrameResult
        busy(self.host_s)
        launches(self.host_ops)
        device_sleep(self.decode_s)
        return FrameResult(torch.ones(B, self._runner.K, dtype=torch.long), [1] * B)


# 10 s of uniform noise (peak 0.5), sliced for every chunk: silence would cost next to nothing to encode or deflate,
# and drawing noise per chunk would hold the GIL where a GPU vocoder's copy does not
NOISE = np.random.default_rng(0).uniform(-0.5, 0.5, 10 * 24000).astype(np.float32)


class PacedVocoder:
    """The StreamingVocoder with decoding as a GIL-free wait that returns slices of NOISE; rows are the real ones'."""

    def __init__(self, vocoder, vocode_s: float, vocode_frame_s: float = 0.0):
        self._vocoder, self.vocode_s, self.vocode_frame_s = vocoder, vocode_s, vocode_frame_s
        self._at = 0  # where the next chunk's slice of NOISE starts

    def __getattr__(self, name):
        return getattr(self._vocoder, name)

    def decode(self, work, sizes=None, final=None) -> list[np.ndarray]:
        if work:
            device_sleep(self.vocode_s + self.vocode_frame_s * sum(len(codes) for _, codes in work))
        out = []
        for _, codes in work:
            idx = np.arange(self._at, self._at + len(codes) * 1920) % NOISE.shape[0]
            out.append(NOISE[idx])
            self._at = (self._at + idx.shape[0]) % NOISE.shape[0]
        return out


def paced_app(slots: int = 256, decode_ms: float = 6.8, vocode_ms: float = 4.0, prefill_ms: float = 5.0,
              prefill_ms_per_request: float = 0.0, prefill_table: list[tuple[int, float]] | None = None,
              alone_max: int | None = None, text_ms: float = 0.0, trace: str | None = None, host_ms: float = 0.0,
              prefill_host_share: float = 0.0, host_ops: int = 0, host_turn: bool = True,
              vocode_ms_per_frame: float = 0.0):
    """The server's app on the tiny random CustomVoice checkpoint of the tests, its device work paced."""
    from q3tts import TTS
    from q3tts.server.app import create_app
    from q3tts.server.settings import ServerSettings
    from tests.golden import fixtures

    tts = TTS.from_pretrained(fixtures.checkpoint("cv06"), device="cpu", dtype=torch.float32, max_seq_len=512)
    app = create_app(tts, ServerSettings(model="paced", max_concurrent=slots, max_queue=4 * slots, max_seq_len=512,
                                         ws_max_client_utterances=4 * slots,
                                         voice_dir=tempfile.mkdtemp(prefix="q3tts-paced-")))
    engine = app.state.engine.engine  # its thread waits for work: no step runs before the first request
    engine.runner = PacedRunner(engine.runner, prefill_ms / 1000, decode_ms / 1000, prefill_ms_per_request / 1000,
                                prefill_table, alone_max, text_ms / 1000, host_ms / 1000, prefill_host_share,
                                host_ops)
    engine.vocoder = PacedVocoder(engine.vocoder, vocode_ms / 1000, vocode_ms_per_frame / 1000)
    engine.turn.enabled = host_turn  # as a CUDA engine's: the paced waits are its device waits
    if trace:
        from bench.load.phase_trace import PhaseTrace
        PhaseTrace(engine, trace)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--slots", type=int, default=256, help="--max-concurrent of the server")
    ap.add_argument("--decode-ms", type=float, default=6.8, help="one frame for all running rows")
    ap.add_argument("--vocode-ms", type=float, default=4.0, help="a step's vocoding, when some chunk is due")
    ap.add_argument("--vocode-ms-per-frame", type=float, default=0.0, help="and per frame it decodes")
    ap.add_argument("--prefill-ms", type=float, default=None,
                    help="a step's prefill of its newcomers (one batch; default 5)")
    ap.add_argument("--prefill-ms-per-request", type=float, default=None,
                    help="added to --prefill-ms per newcomer of the batch (default 0)")
    ap.add_argument("--prefill-table", type=parse_prefill_table, default=None,
                    help="W:ms,... the whole prefill of W newcomers in one step, by W (linear between the given W, "
                         "extrapolated past the last); replaces --prefill-ms and --prefill-ms-per-request")
    ap.add_argument("--alone-max", type=int, default=None,
                    help="with --prefill-table: the waves up to this size are a GPU runner's prefill graph replays "
                         "(what the engine tells the deadline policy; default PREFILL_GRAPH_MAX_REQUESTS)")
    ap.add_argument("--text-ms", type=float, default=0.0,
                    help="each call that hands rows their streamed text (a GPU runner's copy and projection of it)")
    ap.add_argument("--host-ms", type=float, default=0.0,
                    help="of each frame, the part that holds the GIL (a busy loop) before --decode-ms's GIL-free wait")
    ap.add_argument("--prefill-host-share", type=float, default=0.0,
                    help="of each admission's wait, the share spent holding the GIL (0-1; a host-bound admission)")
    ap.add_argument("--host-ops", type=int, default=0,
                    help="torch calls (each lets the GIL go) of each frame and of each newcomer's admission, as a GPU "
                         "runner's launches")
    ap.add_argument("--no-host-turn", dest="host_turn", action="store_false",
                    help="no host turn (q3tts.engine.turn): the engine's thread and the event loop take the GIL as "
                         "CPython hands it over (a CPU engine's way; a CUDA engine takes turns)")
    ap.add_argument("--trace", default=None, help="append a JSON line per streaming request at its first audio: "
                    "ms from its arrival to its prompt laid out, its admission and its first chunk")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for the server process (Python's default 5 ms)")
    ap.add_argument("--per-chunk-delivery", action="store_true",
                    help="hand each chunk to the event loop in a callback of its own (bench/load/deliver_serve.py's "
                         "per_chunk) instead of one per wake-up of the loop")
    a = ap.parse_args(argv)
    if a.alone_max is not None and (a.alone_max < 0 or not a.prefill_table):
        ap.error(f"--alone-max {a.alone_max}: expected an integer >= 0, with --prefill-table")
    if a.prefill_table and (a.prefill_ms is not None or a.prefill_ms_per_request is not None):
        ap.error("--prefill-table replaces --prefill-ms and --prefill-ms-per-request: give one or the other")
    if not 0 <= a.prefill_host_share <= 1:
        ap.error(f"--prefill-host-share {a.prefill_host_share}: expected a share from 0 to 1")
    if a.switch_interval_ms:
        sys.setswitchinterval(a.switch_interval_ms / 1000)
    if a.per_chunk_delivery:
        from bench.load import deliver_serve
        from q3tts.engine.async_engine import AsyncEngine
        AsyncEngine._deliver = deliver_serve.deliver
        deliver_serve.apply("per_chunk")
    import uvicorn

    from q3tts.server.app import uvicorn_config  # as `q3tts serve` runs uvicorn

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO)
    given = {k: v for k, v in (("prefill_ms", a.prefill_ms), ("prefill_ms_per_request", a.prefill_ms_per_request))
             if v is not None}  # else paced_app's defaults
    if a.prefill_table and a.alone_max is None:
        from q3tts.engine.runner import PREFILL_GRAPH_MAX_REQUESTS
        a.alone_max = PREFILL_GRAPH_MAX_REQUESTS
    app = paced_app(a.slots, a.decode_ms, a.vocode_ms, prefill_table=a.prefill_table, alone_max=a.alone_max,
                    text_ms=a.text_ms, trace=a.trace, host_ms=a.host_ms, prefill_host_share=a.prefill_host_share,
                    host_ops=a.host_ops, host_turn=a.host_turn, vocode_ms_per_frame=a.vocode_ms_per_frame, **given)
    uvicorn.Server(uvicorn_config(app, "127.0.0.1", a.port, "warning")).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
