"""OpenAI-compatible speech server: `q3tts serve` (app.main) or `create_app(tts, settings)`.

    app.py       routes, middleware, app factory, CLI entry
    serving.py   speech request -> engine -> encoded stream
    voices.py    built-in speakers / stored cloned voices (SQLite index + voice files)
    encode.py    incremental encoders (pcm, wav, flac, mp3, aac, opus), streaming WSOLA, encoder processes
    protocol.py  pydantic wire types and ApiError
    metrics.py   Prometheus metrics
    settings.py  flags and Q3TTS_* environment variables
"""
