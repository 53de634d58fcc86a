"""Wyoming protocol server: Home Assistant's local text-to-speech protocol, `q3tts wyoming --uri tcp://0.0.0.0:10200`.

    client                                   server
    describe                                 info: one TtsProgram, voices with BCP-47 languages, streaming
    synthesize {text, voice?}                audio-start (24 kHz, 16-bit, mono), audio-chunk*, audio-stop
    synthesize-start {voice?}                (one engine request whose text stays open)
    synthesize-chunk {text}*                 audio-start, audio-chunk* from the first words on
    synthesize {text}                        inside a stream: the whole text again, for servers that cannot
                                             stream (ignored here)
    synthesize-stop                          ... audio-stop, synthesize-stopped
    ping                                     pong
    a bad event                              error {text, code}; the connection stays usable

A voice is named as `info` lists it: a CustomVoice speaker, a stored voice of a Base model (`--voice-dir`), or
"design" (a VoiceDesign model speaking as `--instructions` describes). `voice.language` (en, en-US, zh-CN, ...)
picks the model's language; none: Auto. The library sends a language only with no voice name; this server also
reads one sent beside a name.

An adapter, as the HTTP server's WebSocket session is: requests are checked and prepared by SpeechServing (the
same voices, languages and limits as `q3tts serve`) and run on its AsyncEngine (the same slots and queue; a full
queue is an error event). Streamed text goes into the engine's token-level text path as it arrives, so speech
starts after the first words and equals that of the whole text. Events go out in order through one sender task,
so the connection keeps being read while audio is made: a client that leaves frees its slot at once.
Wyoming has no authentication (q3tts serve's --api-key does not apply): serve it on a trusted network only.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import logging
import os
import sys
import time
from contextlib import aclosing
from dataclasses import dataclass, fields
from functools import partial

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler, AsyncServer, AsyncTcpServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from q3tts.audio import to_s16
from q3tts.config import generation_overrides
from q3tts.engine import AsyncEngine, RequestHandle
from q3tts.inputs.request import InputError, PreparedRequest

from .metrics import Metrics
from .protocol import ApiError, SpeechOptions
from .serving import Generation, Run, SpeechServing
from .settings import _FLAGS, ServerSettings, check_shared_flags, env_name
from .voices import VoiceService

log = logging.getLogger("q3tts.server")

# BCP-47 primary language subtag -> the model's language name (reference/models: codec_language_id)
LANGUAGE_TAGS = {"zh": "chinese", "en": "english", "de": "german", "fr": "french", "it": "italian", "ja": "japanese",
                 "ko": "korean", "pt": "portuguese", "ru": "russian", "es": "spanish"}
DESIGN_VOICE = "design"  # the one voice of a VoiceDesign model
WIDTH, CHANNELS = 2, 1  # 16-bit mono PCM


class Refused(Exception):
    """A bad event: answered with an `error` event (code, text); the connection goes on."""

    def __init__(self, code: str, text: str):
        super().__init__(text)
        self.code, self.text = code, text


def model_language(tag, languages: list[str]) -> str | None:
    """A BCP-47 tag (en, en-US, zh-CN, zh_Hans, ...) or one of the model's language names -> the model's language
    name; None or "" -> None (Auto). Refused naming the accepted tags otherwise."""
    if tag is None or (isinstance(tag, str) and not tag.strip()):
        return None
    t = str(tag).strip().lower().replace("_", "-")
    name = t if t in languages else LANGUAGE_TAGS.get(t.split("-")[0])
    if name not in languages:
        raise Refused("unsupported_language", f"unsupported language {tag!r}: accepted are "
                      f"{', '.join(language_tags(languages))} (with any region, e.g. en-US, zh-CN), or "
                      f"{', '.join(languages)}")
    return None if name == "auto" else name


def language_tags(languages: list[str]) -> list[str]:
    """The BCP-47 tags of the model's languages (those this table knows), in the order of LANGUAGE_TAGS."""
    return [tag for tag, name in LANGUAGE_TAGS.items() if name in languages]


class WyomingService:
    """What every connection shares: the HTTP server's SpeechServing (engine, voices, limits) and the voice
    settings of this server."""

    def __init__(self, serving: SpeechServing, voice: str | None = None, instructions: str | None = None,
                 stream_idle_timeout: float = 30.0):
        self.serving, self.instructions = serving, (instructions or "").strip() or None
        self.stream_idle_timeout = stream_idle_timeout  # seconds an open stream may hold its slot without text
        self.cfg = serving.tts.cfg
        self.model_type = self.cfg.tts_model_type
        if self.model_type == "voice_design" and self.instructions is None:
            raise ValueError("a VoiceDesign model speaks in a voice described in words: give --instructions "
                             '(e.g. "A warm, low female voice, speaking slowly")')
        builtin = serving.voices.builtin()
        if voice and self.model_type == "custom_voice" and voice.strip().lower() not in builtin:
            raise ValueError(f"--voice {voice!r} is not a speaker of this model: {', '.join(builtin)}")
        self.default_voice = voice or ("vivian" if "vivian" in builtin else next(iter(builtin), None))

    def voices(self) -> list[tuple[str, str]]:
        """(name, description) of every voice a request may name (a Base model's: read now, as they may change)."""
        if self.model_type == "voice_design":
            return [(DESIGN_VOICE, self.instructions)]
        if self.model_type == "base":
            return [(v.name, f"{v.name} (cloned voice, {v.mode})") for v in self.serving.voices.list()]
        dialects = self.cfg.talker.spk_is_dialect
        return [(s, s.replace("_", " ").title() + (f" ({dialects[s].replace('_', ' ')})" if dialects.get(s) else ""))
                for s in self.serving.voices.builtin()]

    def info(self) -> Info:
        tags = language_tags(self.cfg.languages)
        attribution = Attribution(name="Qwen", url="https://github.com/QwenLM/Qwen3-TTS")
        voices = [TtsVoice(name=n, description=d, attribution=attribution, installed=True, version=None,
                           languages=tags) for n, d in self.voices()]
        program = TtsProgram(name="q3tts", description=f"Qwen3-TTS {self.serving.settings.model_id} (q3tts)",
                             attribution=attribution, installed=True, version=_version(), voices=voices,
                             supports_synthesize_streaming=True)
        return Info(tts=[program])

    def options(self, data: dict) -> SpeechOptions:
        """A synthesize / synthesize-start event's voice and text format -> the HTTP API's speech options."""
        if data.get("text_format") not in (None, "text"):
            raise Refused("unsupported_text_format", f"text_format {data.get('text_format')!r} is not supported: "
                          "send plain text (text_format \"text\")")
        voice = data.get("voice") or {}
        if not isinstance(voice, dict):
            raise Refused("invalid_event", 'voice must be an object: {"name": ..., "language": ...}')
        name, language = voice.get("name"), model_language(voice.get("language"), self.cfg.languages)
        if name is not None and not isinstance(name, str):
            raise Refused("invalid_event", f"voice.name must be a string, got {name!r}")
        if self.model_type == "voice_design":
            if name not in (None, DESIGN_VOICE):
                raise Refused("voice_not_found", f"unknown voice {name!r}: this VoiceDesign model has one voice, "
                              f"{DESIGN_VOICE!r}")
            return SpeechOptions(language=language, instructions=self.instructions)
        name = name or self.default_voice
        if name is None:  # a Base model and no --voice: its oldest stored voice
            stored = self.serving.voices.list()
            if not stored:
                raise Refused("missing_voice", "this Base model has no stored voice yet: add one with `q3tts voices "
                              "add NAME --voice-dir DIR --ref-audio FILE ...`, or POST /v1/audio/voices")
            name = stored[0].name
        return SpeechOptions(voice=name, language=language, instructions=self.instructions)

    async def prepare(self, data: dict, text: str | None) -> PreparedRequest:
        try:
            return await self.serving.prepare(self.options(data), text)
        except ApiError as e:
            raise Refused(e.info.code or "invalid_request", e.info.message) from None


@dataclass(eq=False)
class Utterance:
    handle: RequestHandle
    run: Run  # metrics bookkeeping, as the HTTP server's
    chars: int = 0


class WyomingHandler(AsyncEventHandler):
    """One client connection."""

    def __init__(self, service: WyomingService, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        super().__init__(reader, writer)
        self.service, self.serving = service, service.serving
        self.outbox: asyncio.Queue[Event | Utterance] = asyncio.Queue()  # what to send, in order
        self.live: list[Utterance] = []  # submitted, not yet fully sent
        # the open text stream: None outside one; its request, prepared at synthesize-start, is submitted at the
        # first words (blank text before them is kept in `pending`); `refused`: its chunks are dropped
        self.stream: PreparedRequest | None = None
        self.streaming = self.refused = False
        self.utt: Utterance | None = None
        self.pending = ""
        self.idle: asyncio.TimerHandle | None = None  # ends a stream that holds a slot and sends nothing
        self.sender = asyncio.ensure_future(self._send_all())

    async def handle_event(self, event: Event) -> bool:
        kind, data = event.type, event.data if isinstance(event.data, dict) else {}
        try:
            if Describe.is_type(kind):
                self.outbox.put_nowait(self.service.info().event())
            elif Ping.is_type(kind):
                self.outbox.put_nowait(Pong(text=data.get("text")).event())
            elif Synthesize.is_type(kind):
                if not self.streaming:  # inside a stream it repeats the streamed text: ignored
                    await self._synthesize(data)
            elif SynthesizeStart.is_type(kind):
                await self._start(data)
            elif SynthesizeChunk.is_type(kind):
                self._chunk(data)
            elif SynthesizeStop.is_type(kind):
                self._stop()
            else:  # as Wyoming servers do: other events are not for this program
                log.debug("wyoming: ignoring a %r event", kind)
        except Refused as e:
            self._error(e)
        return True

    def _error(self, e: Refused) -> None:
        self.serving.metrics.errors.labels("invalid_request_error", e.code).inc()
        self.outbox.put_nowait(Error(text=e.text, code=e.code).event())

    async def disconnect(self) -> None:
        """The client is gone: free every slot it held now."""
        self._disarm()
        self.sender.cancel()
        for utt in self.live:
            utt.handle.close()

    # ------------------------------------------------------------------ events in
    async def _synthesize(self, data: dict) -> None:
        text = _text(data, "synthesize")
        utt = self._submit(await self.service.prepare(data, text))
        self.outbox.put_nowait(utt)

    async def _start(self, data: dict) -> None:
        if self.streaming:
            raise Refused("stream_open", "synthesize-start inside an open stream: send synthesize-stop first")
        self.streaming, self.refused, self.utt, self.pending = True, True, None, ""
        self.stream = await self.service.prepare(data, None)  # voice and language checked now
        self.refused = False

    def _chunk(self, data: dict) -> None:
        if not self.streaming:
            raise Refused("no_stream", "synthesize-chunk outside a stream: send synthesize-start first")
        text = _text(data, "synthesize-chunk")
        if self.refused:
            return
        limit = self.serving.settings.max_text_length
        if (self.utt.chars if self.utt else 0) + len(self.pending) + len(text) > limit:
            self.refused = True
            if self.utt is not None:
                self.utt.handle.cancel()
            raise Refused("input_too_long", f"the streamed text is more than {limit} characters "
                          "(--max-text-length): it was cancelled")
        if self.utt is None:
            self.pending += text
            if not self.pending.strip():
                return  # nothing to say yet: the request waits for words
            text, self.pending = self.pending, ""
            self.refused = True  # until it is queued (a full queue refuses the whole stream)
            self.utt = self._submit(self.stream)
            self.refused = False
            self.outbox.put_nowait(self.utt)
        self.utt.chars += len(text)
        self.stream.text.append(text)
        self._arm()

    def _stop(self) -> None:
        if not self.streaming:
            raise Refused("no_stream", "synthesize-stop outside a stream: send synthesize-start first")
        self.streaming = False
        self._disarm()
        if self.utt is not None:
            try:
                self.stream.text.close()  # its last audio, then audio-stop, then synthesize-stopped below
            except InputError as e:  # (it had words: not expected; the engine fails the request and says why)
                self._error(Refused(e.code or "invalid_request", str(e)))
        elif not self.refused:
            self._error(Refused("empty_input", "the streamed text is empty: give the words to speak"))
        self.outbox.put_nowait(SynthesizeStopped().event())

    def _arm(self) -> None:
        self._disarm()
        if self.service.stream_idle_timeout:
            self.idle = asyncio.get_running_loop().call_later(self.service.stream_idle_timeout, self._idle_out)

    def _disarm(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None

    def _idle_out(self) -> None:
        """No text for stream_idle_timeout seconds while the stream held a slot: cancel it (the slot is free at the
        next step); its chunks are dropped from now on and its synthesize-stop still answered."""
        if self.streaming and not self.refused and self.utt is not None:
            self.refused = True
            self.utt.handle.cancel()
            self._error(Refused("idle_timeout", f"no synthesize-chunk or synthesize-stop for "
                                f"{self.service.stream_idle_timeout:g} s: the stream was cancelled"))

    def _submit(self, prepared: PreparedRequest) -> Utterance:
        """Queue the request in the shared engine now, through the server's one submit path (a full queue or a
        prompt too long: refused)."""
        try:
            gen = self.serving.submit(prepared, "pcm", "speech-wyoming", time.perf_counter())
        except ApiError as e:
            raise Refused(e.info.code or "invalid_request", e.info.message) from None
        utt = Utterance(gen.handle, gen.run)
        self.live.append(utt)
        return utt

    # ------------------------------------------------------------------ events out
    async def _send_all(self) -> None:
        try:
            while True:
                item = await self.outbox.get()
                if isinstance(item, Event):
                    await self.write_event(item)
                    continue
                try:
                    await self._send_utterance(item)
                finally:
                    self.live.remove(item)
        except (ConnectionError, OSError):  # gone mid-write: the reader sees the end and disconnect() frees the rest
            for utt in self.live:
                utt.handle.close()

    async def _send_utterance(self, utt: Utterance) -> None:
        rate = self.serving.tts.sample_rate
        await self.write_event(AudioStart(rate=rate, width=WIDTH, channels=CHANNELS).event())
        try:  # the shared bookkeeping (serving.stream) records the chunks, books the run and frees the slot
            async with aclosing(self.serving.stream(Generation(utt.run, utt.handle))) as chunks:
                async for chunk in chunks:
                    if chunk.num_frames:
                        await self.write_event(AudioChunk(rate=rate, width=WIDTH, channels=CHANNELS,
                                                          audio=to_s16(chunk.audio).tobytes()).event())
                    if chunk.is_last and chunk.error:
                        await self.write_event(Error(text=chunk.error, code="generation_failed").event())
        except Exception as e:
            if isinstance(e, (ConnectionError, OSError)):
                raise
            log.exception("%s failed", utt.handle.request_id)  # an engine failure: this request ends, not the rest
            await self.write_event(Error(text=f"generation failed: {type(e).__name__}: {e}",
                                         code="generation_failed").event())
        await self.write_event(AudioStop().event())


def _version() -> str | None:
    try:
        return importlib.metadata.version("q3tts")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return None


def _text(data: dict, kind: str) -> str:
    text = data.get("text")
    if not isinstance(text, str):
        raise Refused("invalid_event", f'{kind} needs "text": a string')
    return text


# --------------------------------------------------------------------------- the server
def build_service(tts, settings: ServerSettings, voice: str | None = None, instructions: str | None = None,
                  stream_idle_timeout: float = 30.0) -> WyomingService:
    """The engine (sized by settings, as `q3tts serve` sizes it), voices and serving of a Wyoming server; call it
    inside the event loop that will serve it."""
    engine = AsyncEngine.of(tts.build_engine(max_slots=settings.max_concurrent, max_seq_len=settings.max_seq_len,
                                          max_queue=settings.max_queue, **settings.memory_budget))
    voices = VoiceService(tts, settings.voice_dir, settings.max_upload_bytes)
    try:
        return WyomingService(SpeechServing(tts, engine, voices, Metrics(engine.stats), settings), voice,
                              instructions, stream_idle_timeout)
    except BaseException:
        engine.shutdown()
        raise


async def serve(service: WyomingService, uri: str, zeroconf: str | None = None, warmup: bool = True) -> None:
    """Warm up, then serve until cancelled or SIGTERM."""
    server = AsyncServer.from_uri(uri)
    serving = service.serving
    try:
        if warmup:
            await serving.warmup()
            if serving.warmup_error:
                raise RuntimeError(f"warm-up failed: {serving.warmup_error}")
        if zeroconf:
            await _announce(server, zeroconf)
        log.info("wyoming: serving %s on %s", serving.settings.model_id, uri)
        await server.run(partial(WyomingHandler, service))
    finally:
        serving.engine.shutdown()


async def _announce(server: AsyncServer, name: str) -> None:
    if not isinstance(server, AsyncTcpServer):
        raise ValueError("--zeroconf needs a tcp:// --uri")
    try:
        from wyoming.zeroconf import HomeAssistantZeroconf
    except ImportError as e:
        raise ValueError(f"--zeroconf needs the zeroconf package (pip install zeroconf): {e}") from None
    host = None if server.host in ("0.0.0.0", "::", "") else server.host  # the library then finds the LAN address
    await HomeAssistantZeroconf(port=server.port, name=name, host=host).register_server()
    log.info("wyoming: announced as %r over zeroconf (mDNS)", name)


# flags of `q3tts serve` that mean the same here (same names, same Q3TTS_* variables)
SHARED_FLAGS = ("model", "served_model_name", "device", "dtype", "quantization", "voice_dir", "max_text_length",
                "max_queue", "max_concurrent", "max_seq_len", "gpu_memory_utilization", "gpu_memory", "kv_block_size",
                "compile_cache", "compile_artifact", "generation_config", "first_chunk_frames", "chunk_frames",
                "log_level")


def parse_args(argv: list[str] | None = None, environ: dict | None = None):
    """-> (ServerSettings, argparse.Namespace with uri, voice, instructions, zeroconf)."""
    env = os.environ if environ is None else environ
    defaults = ServerSettings()
    ap = argparse.ArgumentParser(prog="q3tts wyoming", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 description="Wyoming protocol server (Home Assistant) for Qwen3-TTS. Wyoming has no "
                                             "authentication: serve it on a trusted network only.")
    ap.add_argument("--uri", default=env.get("Q3TTS_WYOMING_URI") or "tcp://127.0.0.1:10200",
                    help="tcp://HOST:PORT (tcp://0.0.0.0:10200 for Home Assistant on another machine), unix://PATH "
                         "or stdio:// [env Q3TTS_WYOMING_URI]")
    ap.add_argument("--voice", default=None, help="the voice of requests that name none (CustomVoice: vivian, else "
                                                  "the first speaker; Base: a stored voice's name or id, else the "
                                                  "oldest stored voice)")
    ap.add_argument("--instructions", default=None, help="VoiceDesign: the voice in words (required); CustomVoice "
                                                         "1.7B: a style instruction for every request")
    ap.add_argument("--stream-idle-timeout", type=float, default=30.0, metavar="SECONDS",
                    help="a streamed synthesis that holds an engine slot and sends no text for this long is "
                         "cancelled, freeing the slot (0: never)")
    ap.add_argument("--zeroconf", nargs="?", const="q3tts", default=None, metavar="NAME",
                    help="announce the server to Home Assistant over mDNS (needs: pip install zeroconf)")
    for flag, name, typ, help_ in _FLAGS:
        if name in SHARED_FLAGS:
            default = env.get(env_name(name))
            default = typ(default) if default not in (None, "") else getattr(defaults, name)
            ap.add_argument(flag, dest=name, type=typ, default=default, help=f"{help_} [env {env_name(name)}]")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up request")
    a = ap.parse_args(argv)
    check_shared_flags(ap, a)
    if a.zeroconf and not (a.uri.startswith("tcp://") and importlib.util.find_spec("zeroconf")):
        ap.error("--zeroconf needs a tcp:// --uri and the zeroconf package (pip install zeroconf)")
    if not a.stream_idle_timeout >= 0:
        ap.error("--stream-idle-timeout must be >= 0 (seconds; 0: never)")
    try:
        generation_overrides(a.generation_config)
        AsyncServer.from_uri(a.uri)
    except ValueError as e:
        ap.error(str(e))
    settings = ServerSettings(**{f.name: getattr(a, f.name) for f in fields(ServerSettings) if f.name in SHARED_FLAGS})
    return settings, a


def main(argv: list[str] | None = None) -> int:
    """`q3tts wyoming [flags]`: load the model and serve Wyoming until interrupted."""
    from .app import load_model

    settings, a = parse_args(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = AsyncServer.from_uri(a.uri)
    if isinstance(server, AsyncTcpServer) and server.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("wyoming: serving on %s: the Wyoming protocol has no authentication, anyone who can reach this "
                    "port can use it", a.uri)

    async def run() -> None:
        await serve(build_service(tts, settings, a.voice, a.instructions, a.stream_idle_timeout), a.uri, a.zeroconf,
                    a.warmup)

    try:
        t0 = time.perf_counter()
        tts = load_model(settings)
        log.info("loaded %s (%s, %s) on %s in %.1f s", settings.model, tts.cfg.tts_model_type,
                 tts.cfg.tts_model_size, tts.device, time.perf_counter() - t0)
        asyncio.run(run())
    except (ValueError, FileNotFoundError) as e:  # a bad model, voice, instructions or --zeroconf
        print(f"q3tts wyoming: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0
