"""The HTTP layer's assembly: the FastAPI app factory and `q3tts serve`.

    routes.py -> SpeechServing / VoiceService (serving.py, voices.py) -> AsyncEngine
    middleware.py: the API key, the body limit and request counting before routing; the error answers

Handles live on `app.state`; the WebSocket session (session.py) shares the serving's submit path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from q3tts.engine import AsyncEngine, step_stream

from . import logfilter
from .metrics import Metrics
from .middleware import GuardMiddleware, install_error_handlers
from .routes import router
from .serving import SpeechServing, thaw_heap
from .settings import ServerSettings
from .voices import VoiceService

log = logging.getLogger("q3tts.server")
STATIC = Path(__file__).resolve().parent / "static"


# --------------------------------------------------------------------------- the app
def create_app(tts, settings: ServerSettings | None = None) -> FastAPI:
    """The server for a loaded model.

    Args:
        tts: a q3tts.TTS (any model type).
        settings: limits, voice directory, API key, stream chunking (defaults: ServerSettings()).
    """
    settings = settings or ServerSettings()
    logfilter.install()  # no API key (?api_key=) in uvicorn's request logs
    invariant = {"batch_invariant": True} if settings.batch_invariant else {}
    engine = AsyncEngine.of(tts.build_engine(max_slots=settings.max_concurrent, max_seq_len=settings.max_seq_len,
                                             max_queue=settings.max_queue, **invariant, **settings.memory_budget))
    metrics = Metrics(engine.stats)
    voices = VoiceService(tts, settings.voice_dir, settings.max_upload_bytes, settings.voice_alias,
                          settings.clone_workers, settings.clone_queue)
    serving = SpeechServing(tts, engine, voices, metrics, settings)
    if getattr(tts, "aligner", None) is not None:  # word timestamps: one aligner worker beside the engine
        from q3tts.align import AlignerWorker
        # the engine's steps above the aligner's stream, and its passes waiting while the engine admits newcomers and
        # makes their first audio (Engine.settled)
        engine.step_stream = step_stream(tts.ckpt.device)
        serving.aligner = AlignerWorker(tts.aligner, busy=lambda: not engine.engine.settled)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        warm = asyncio.ensure_future(serving.warmup()) if settings.warmup else None
        if warm is None:
            serving.ready = True
            metrics.ready.set(1)
        try:
            yield
        finally:
            if warm is not None and not warm.done():
                warm.cancel()
            engine.shutdown()
            serving.encoders.close()
            thaw_heap()
            if serving.aligner is not None:
                serving.aligner.close()

    app = FastAPI(title="q3tts", description="OpenAI-compatible speech server for Qwen3-TTS", lifespan=lifespan)
    st = app.state
    st.tts, st.engine, st.metrics, st.voices, st.serving, st.settings = tts, engine, metrics, voices, serving, settings
    st.started = int(time.time())
    st.index_html = (STATIC / "index.html").read_text(encoding="utf-8")  # the web page, read once
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics)
    return app


def load_model(settings: ServerSettings):
    """The q3tts.TTS a server with these settings serves (one per process / Ray Serve replica)."""
    from q3tts.api import TTS
    return TTS.from_pretrained(settings.model, device=settings.device, dtype=settings.dtype,
                               quantization=settings.quantization, compile_cache=settings.compile_cache,
                               compile_artifact=settings.compile_artifact,
                               generation_config=settings.generation_config, aligner=settings.aligner)


def main(settings: ServerSettings) -> int:
    """`q3tts serve [flags]` (cli.cmd_serve parses them): load the model and serve until interrupted."""
    import uvicorn

    t0 = time.perf_counter()
    tts = load_model(settings)
    log.info("loaded %s (%s, %s) on %s in %.1f s", settings.model, tts.cfg.tts_model_type, tts.cfg.tts_model_size,
             tts.device, time.perf_counter() - t0)
    app = create_app(tts, settings)
    uvicorn.Server(uvicorn_config(app, settings.host, settings.port, settings.log_level.lower())).run()
    return 0


def uvicorn_config(app, host: str, port: int, log_level: str = "info"):
    """How uvicorn serves a q3tts app (the server, the tests' live servers, the paced benchmark server alike).

    No permessage-deflate on the WebSocket: the messages that count are audio (PCM, or already-compressed formats),
    which deflate barely shrinks, and zlib runs on the event loop's thread: with tens of sessions that thread spent
    most of its time compressing and every session's chunks went out late."""
    import uvicorn
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          ws_per_message_deflate=False)
