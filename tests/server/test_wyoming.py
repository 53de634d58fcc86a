"""`q3tts wyoming` (Home Assistant's Wyoming protocol) against Wyoming's own AsyncTcpClient, on a tiny CustomVoice
checkpoint made greedy by --generation-config (Wyoming sends no sampling fields): describe; synthesize gives the
official audio of the text; a text streamed in pieces gives the official streamed-text audio, speech starting
before the text is complete; bad events get an error event and the connection goes on; a client that leaves frees
its slot; the CLI serves it."""

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial

import numpy as np
import pytest

pytest.importorskip("wyoming", reason="pip install -e '.[wyoming]'")

from wyoming.audio import AudioChunk, AudioStart  # noqa: E402
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.error import Error  # noqa: E402
from wyoming.event import Event  # noqa: E402
from wyoming.info import Describe, Info  # noqa: E402
from wyoming.ping import Ping, Pong  # noqa: E402
from wyoming.server import AsyncTcpServer  # noqa: E402
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice  # noqa: E402

from q3tts.server.wyoming import WyomingHandler, build_service, model_language  # noqa: E402
from tests.golden import fixtures as fx  # noqa: E402

from .live import SR, pieces  # noqa: E402

TOL = 1e-4 + 0.5 / 32767  # float32 audio within 1e-4 of the official (test_parity.py), then rounded to int16


class LiveWyoming:
    """A Wyoming server on a free port of 127.0.0.1, its event loop in a thread (as uvicorn's in live.py)."""

    def __init__(self, variant: str, tmp_path, voice: str | None = "ryan", instructions: str | None = None,
                 **settings):
        from q3tts.server.app import load_model
        from q3tts.server.settings import ServerSettings

        gen = tmp_path / "greedy.json"
        gen.write_text(json.dumps(fx.manifest(variant)["greedy"]))  # greedy and 33 frames at most, as the fixtures
        self.settings = ServerSettings(**{"model": str(fx.checkpoint(variant)), "device": "cpu",
                                          "generation_config": str(gen), "max_concurrent": 2, "max_seq_len": 256,
                                          "voice_dir": str(tmp_path / "voices"), **settings})
        tts = load_model(self.settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="wyoming", daemon=True)
        self.thread.start()
        self.service, self.server, self.port = asyncio.run_coroutine_threadsafe(
            self._start(tts, voice, instructions), self.loop).result(60)

    async def _start(self, tts, voice, instructions):
        service = build_service(tts, self.settings, voice=voice, instructions=instructions)
        server = AsyncTcpServer("127.0.0.1", 0)
        await server.start(partial(WyomingHandler, service))
        return service, server, server._server.sockets[0].getsockname()[1]

    @property
    def stats(self):
        return self.service.serving.engine.stats()

    def wait_idle(self, timeout: float = 10.0) -> None:
        t = time.time() + timeout
        while time.time() < t:
            if self.stats.active_slots == 0 and self.stats.queue_depth == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle after {timeout} s: {self.stats}")

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.service.serving.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def wyo(tmp_path_factory):
    s = LiveWyoming("cv06", tmp_path_factory.mktemp("wyoming"))
    yield s
    s.stop()


def talk(server, script):
    """Run `script(client)` with a connected client (its own event loop, as a Home Assistant would be)."""
    async def go():
        async with AsyncTcpClient("127.0.0.1", server.port, read_timeout=60) as client:
            return await script(client)
    return asyncio.run(go())


async def until(client, *types) -> list[Event]:
    """Events up to and including the first of one of `types`."""
    out = []
    while True:
        event = await client.read_event()
        assert event is not None, f"connection closed; got {[e.type for e in out]}"
        out.append(event)
        if event.type in types:
            return out


def audio(events: list[Event]) -> np.ndarray:
    """audio-start, audio-chunk*, audio-stop -> float samples; the format checked."""
    kinds = [e.type for e in events]
    assert kinds[0] == "audio-start" and kinds[-1] == "audio-stop" and set(kinds[1:-1]) <= {"audio-chunk"}, kinds
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (SR, 2, 1)
    chunks = [AudioChunk.from_event(e) for e in events[1:-1]]
    assert all((c.rate, c.width, c.channels) == (SR, 2, 1) for c in chunks)
    return np.frombuffer(b"".join(c.audio for c in chunks), "<i2").astype(np.float32) / 32767


def official(name: str, variant: str = "cv06") -> np.ndarray:
    return fx.outputs(variant)[f"{name}.wav.0"].numpy()


def test_describe(wyo):
    info = talk(wyo, lambda c: _describe(c))
    [program] = info.tts
    assert program.name == "q3tts" and program.installed and program.supports_synthesize_streaming
    tts = wyo.service.serving.tts
    assert sorted(v.name for v in program.voices) == sorted(tts.get_supported_speakers())
    for v in program.voices:
        assert v.installed and v.languages[:2] == ["zh", "en"] and {"de", "fr", "ja", "ko", "ru", "pt", "es",
                                                                     "it"} <= set(v.languages)
    assert {v.name: v.description for v in program.voices}["dylan"] == "Dylan (beijing dialect)"


async def _describe(client):
    await client.write_event(Describe().event())
    return Info.from_event((await until(client, "info"))[-1])


def test_synthesize_equals_the_official_output(wyo):
    """The whole text in one synthesize event, with the model's default layout (CustomVoice: the text in the
    prompt), the voice named as Home Assistant names it."""
    case = fx.get_case("cv06", "auto_nsm")

    async def script(client):
        await client.write_event(Synthesize(text=case["kw"]["text"], voice=SynthesizeVoice(name="Vivian")).event())
        return await until(client, "audio-stop")

    got, ref = audio(talk(wyo, script)), official("auto_nsm")
    assert got.shape == ref.shape and np.abs(got - ref).max() <= TOL
    wyo.wait_idle()


def test_streamed_text_equals_the_official_streamed_output(wyo):
    """Two text streams on one connection, split anywhere: by voice name (a dialect speaker, Auto), then by
    language only (en-US -> English, the server's --voice ryan). The English audio comes before half its text
    has (the Chinese text is one pre-tokenizer piece, held back until it is complete: q3tts.inputs.text); the
    copy of the whole text in a legacy synthesize inside the stream is ignored; synthesize-stopped ends each."""
    streams = [("dialect_dylan_auto_stream", SynthesizeVoice(name="dylan")),
               ("english_stream", SynthesizeVoice(language="en-US"))]

    async def script(client):
        results = []
        for i, (name, voice) in enumerate(streams):
            text = fx.get_case("cv06", name)["kw"]["text"]
            parts = pieces(text, random.Random(i))
            half = len(parts) // 2 if name == "english_stream" else len(parts)
            await client.write_event(SynthesizeStart(voice=voice).event())
            for p in parts[:half]:
                await client.write_event(SynthesizeChunk(text=p).event())
            early = await until(client, "audio-chunk")  # speech has started (English: half the text to come)
            for p in parts[half:]:
                await client.write_event(SynthesizeChunk(text=p).event())
            await client.write_event(Synthesize(text=text, voice=voice).event())
            await client.write_event(SynthesizeStop().event())
            rest = await until(client, "synthesize-stopped")
            results.append((name, early + rest[:-1]))
        return results

    for name, events in talk(wyo, script):
        got, ref = audio(events), official(name)
        assert got.shape == ref.shape and np.abs(got - ref).max() <= TOL, name
    wyo.wait_idle()


def test_bad_events_get_an_error_and_the_connection_goes_on(wyo):
    ev = lambda kind, **data: Event(type=kind, data=data)  # noqa: E731 (raw events: what the classes cannot send)
    bad = [
        (Synthesize(text="").event(), "empty_input", ["empty"]),
        (Synthesize(text="   \n").event(), "empty_input", ["empty"]),
        (Synthesize(text="Hi.", voice=SynthesizeVoice(name="nobody")).event(), "voice_not_found", ["vivian"]),
        (Synthesize(text="Hi.", voice=SynthesizeVoice(language="xx-YY")).event(), "unsupported_language",
         ["'xx-YY'", "en, ", "en-US"]),
        (ev("synthesize", text="Hi.", voice={"name": "ryan", "language": "klingon"}), "unsupported_language", ["zh"]),
        (Synthesize(text="<speak>Hi.</speak>", text_format="ssml").event(), "unsupported_text_format", ["ssml"]),
        (ev("synthesize", text=5), "invalid_event", ["text"]),
        (ev("synthesize", text="Hi.", voice="ryan"), "invalid_event", ["voice"]),
        (SynthesizeChunk(text="Hi.").event(), "no_stream", ["synthesize-start"]),
        (SynthesizeStop().event(), "no_stream", ["synthesize-start"]),
        (Synthesize(text="x" * 5000).event(), "input_too_long", ["4096"]),
    ]

    async def script(client):
        for event, code, words in bad:
            await client.write_event(event)
            [err] = await until(client, "error", "audio-start")
            err = Error.from_event(err)
            assert err.code == code and all(w in err.text for w in words), (event, err)
        # a stream of blanks: nothing to say (no audio), then synthesize-stopped
        for event in (SynthesizeStart().event(), SynthesizeChunk(text=" ").event(), SynthesizeStop().event()):
            await client.write_event(event)
        assert [e.type for e in await until(client, "synthesize-stopped", "audio-start")] == \
            ["error", "synthesize-stopped"]
        # a stream refused at its start: its text is dropped, its stop still answered
        for event in (SynthesizeStart(voice=SynthesizeVoice(name="nobody")).event(),
                      SynthesizeChunk(text="Dropped.").event(), SynthesizeStop().event()):
            await client.write_event(event)
        events = await until(client, "synthesize-stopped", "audio-start")
        assert [e.type for e in events] == ["error", "synthesize-stopped"]
        assert Error.from_event(events[0]).code == "voice_not_found"
        # a second start inside an open stream is refused; the open one goes on
        await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="aiden")).event())
        await client.write_event(SynthesizeStart().event())
        assert Error.from_event((await until(client, "error"))[-1]).code == "stream_open"
        await client.write_event(SynthesizeChunk(text="Still usable.").event())
        await client.write_event(SynthesizeStop().event())
        events = await until(client, "synthesize-stopped")
        await client.write_event(Ping(text="hi").event())
        pong = (await until(client, "pong"))[-1]
        return events, Pong.from_event(pong)

    events, pong = talk(wyo, script)
    assert audio(events[:-1]).size > 0 and pong.text == "hi"
    wyo.wait_idle()


def test_a_client_that_leaves_frees_its_slot(wyo):
    """A stream opened and left unfinished holds a slot, waiting for text; the client going away frees it."""
    async def script(client):
        await client.write_event(SynthesizeStart().event())
        await client.write_event(SynthesizeChunk(text="Waiting for the rest of").event())
        await until(client, "audio-chunk")
        assert wyo.stats.active_slots == 1  # admitted, speaking what it has, waiting for the rest
        client._writer.transport.abort()  # no goodbye: the client is simply gone

    talk(wyo, script)
    wyo.wait_idle()


def test_a_stream_left_open_is_ended_by_the_idle_limit(wyo):
    """A stream that holds a slot and sends no text for --stream-idle-timeout is cancelled (the slot comes back);
    its later chunks are dropped, its stop still answered, and the connection goes on."""
    wyo.service.stream_idle_timeout = 0.5
    try:
        async def script(client):
            await client.write_event(SynthesizeStart().event())
            await client.write_event(SynthesizeChunk(text="Waiting for the rest of").event())
            events = await until(client, "error")
            await client.write_event(SynthesizeChunk(text=" the text.").event())
            await client.write_event(SynthesizeStop().event())
            return events, await until(client, "synthesize-stopped")

        events, rest = talk(wyo, script)
    finally:
        wyo.service.stream_idle_timeout = 30.0
    kinds = [e.type for e in events]
    assert kinds[0] == "audio-start" and kinds[-2:] == ["audio-stop", "error"], kinds
    assert Error.from_event(events[-1]).code == "idle_timeout" and [e.type for e in rest] == ["synthesize-stopped"]
    wyo.wait_idle()


def test_a_full_queue_is_an_error_event(tmp_path):
    """One slot, a queue of one: a third request, whole or streamed, gets queue_full; the others go on."""
    server = LiveWyoming("cv06", tmp_path, max_concurrent=1, max_queue=1)
    try:
        async def script():
            clients = [AsyncTcpClient("127.0.0.1", server.port, read_timeout=60) for _ in range(3)]
            for c in clients:
                await c.connect()
            holder, queued, late = clients
            await holder.write_event(SynthesizeStart().event())
            await holder.write_event(SynthesizeChunk(text="Holding the only slot").event())
            early = await until(holder, "audio-chunk")
            await queued.write_event(Synthesize(text="Waiting in the queue.").event())
            while server.stats.queue_depth == 0:
                await asyncio.sleep(0.01)
            await late.write_event(Synthesize(text="No room.").event())
            refused = [Error.from_event((await until(late, "error", "audio-start"))[-1])]
            for event in (SynthesizeStart().event(), SynthesizeChunk(text="No room either.").event(),
                          SynthesizeChunk(text=" Dropped.").event(), SynthesizeStop().event()):
                await late.write_event(event)
            late_stream = await until(late, "synthesize-stopped", "audio-start")
            await holder.write_event(SynthesizeStop().event())
            held, waited = early + await until(holder, "synthesize-stopped"), await until(queued, "audio-stop")
            for c in clients:
                await c.disconnect()
            return refused, late_stream, held, waited

        refused, late_stream, held, waited = asyncio.run(script())
        assert refused[0].code == "queue_full" and "max_queue 1" in refused[0].text
        assert [e.type for e in late_stream] == ["error", "synthesize-stopped"]
        assert Error.from_event(late_stream[0]).code == "queue_full"
        assert audio(held[:-1]).size > 0 and audio(waited).size > 0
        server.wait_idle()
    finally:
        server.stop()


def test_zeroconf_needs_tcp_and_its_package():
    import importlib.util

    from wyoming.server import AsyncServer

    from q3tts.server.wyoming import _announce
    with pytest.raises(ValueError, match="needs a tcp:// --uri"):
        asyncio.run(_announce(AsyncServer.from_uri("unix:///tmp/q3tts-wyoming.sock"), "q3tts"))
    if importlib.util.find_spec("zeroconf") is None:  # (with it, announcing needs a multicast network)
        with pytest.raises(ValueError, match="pip install zeroconf"):
            asyncio.run(_announce(AsyncServer.from_uri("tcp://127.0.0.1:10200"), "q3tts"))


def test_language_tags():
    langs = ["auto", "chinese", "english", "french", "german", "italian", "japanese", "korean", "portuguese",
             "russian", "spanish"]
    for tag, name in [("en", "english"), ("en-US", "english"), ("EN_gb", "english"), ("zh-CN", "chinese"),
                      ("zh-Hans-CN", "chinese"), ("zh", "chinese"), ("de-DE", "german"), ("fr", "french"),
                      ("ja", "japanese"), ("ko-KR", "korean"), ("ru", "russian"), ("pt-BR", "portuguese"),
                      ("es-419", "spanish"), ("it", "italian"), ("English", "english"), (None, None), ("", None),
                      ("auto", None)]:
        assert model_language(tag, langs) == name, tag
    with pytest.raises(Exception, match="accepted are zh, en, de"):
        model_language("nl-NL", langs)
    with pytest.raises(Exception, match="accepted are zh, en"):
        model_language("de", ["auto", "chinese", "english"])  # a model without German


def test_the_cli_serves_wyoming(tmp_path):
    """`q3tts wyoming` as a user starts it: describe and a synthesis, then SIGTERM stops it cleanly."""
    gen = tmp_path / "greedy.json"
    gen.write_text(json.dumps({"do_sample": False, "subtalker_dosample": False, "max_new_tokens": 5}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bad = subprocess.run([sys.executable, "-m", "q3tts.cli", "wyoming", "--model", str(fx.checkpoint("cv06")),
                          "--device", "cpu", "--voice", "nobody", "--no-warmup"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert bad.returncode == 2 and "--voice 'nobody' is not a speaker" in bad.stderr, bad.stderr[-2000:]
    proc = subprocess.Popen([sys.executable, "-m", "q3tts.cli", "wyoming", "--model", str(fx.checkpoint("cv06")),
                             "--device", "cpu", "--uri", f"tcp://127.0.0.1:{port}", "--max-concurrent", "1",
                             "--max-seq-len", "256", "--generation-config", str(gen)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        class At:
            pass
        at = At()
        at.port = port
        deadline = time.time() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "timeout"
                time.sleep(0.2)

        async def script(client):
            info = await _describe(client)
            await client.write_event(Synthesize(text="Hello there.").event())
            return info, await until(client, "audio-stop")

        info, events = talk(at, script)
        samples = audio(events).size
        assert info.tts[0].supports_synthesize_streaming and 0 < samples <= 4 * 1920 and samples % 1920 == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_base_model_voices_are_the_stored_ones(tmp_path):
    """A Base model: its voices are those stored in --voice-dir (read at each describe). A whole text gets the
    model's default layout (Base: text streamed in the prompt's trailing part); the language beside a voice name
    (this server reads it; the library's classes send a language only without a name) picks English."""
    from q3tts.inputs.voice import Voice
    from q3tts.server.voices import VoiceStore

    server = LiveWyoming("base06", tmp_path, voice=None)
    try:
        store = VoiceStore(server.settings.voice_dir, server.service.cfg)
        assert talk(server, _describe).tts[0].voices == []
        err = talk(server, lambda c: _say(c, Synthesize(text="Hi.").event(), "error"))
        assert Error.from_event(err[-1]).code == "missing_voice"

        def add(name, case):
            [item] = fx.case_prompt_items("base06", fx.get_case("base06", case))
            store.add(name, Voice.from_prompt_item(item, "0b6", name))

        add("xv", "xvec_stream")
        voices = talk(server, _describe).tts[0].voices
        assert [v.name for v in voices] == ["xv"] and "en" in voices[0].languages
        text = fx.get_case("base06", "xvec_stream")["kw"]["text"]
        raw = Event(type="synthesize", data={"text": text, "voice": {"name": "xv", "language": "en"}})
        got, ref = audio(talk(server, lambda c: _say(c, raw, "audio-stop"))), official("xvec_stream", "base06")
        assert got.shape == ref.shape and np.abs(got - ref).max() <= TOL
        # no voice named: the oldest stored one
        default = audio(talk(server, lambda c: _say(c, Synthesize(text=text, voice=SynthesizeVoice(
            language="en")).event(), "audio-stop")))
        assert np.array_equal(default, got)
        add("icl5", "icl_short_ref_stream")
        assert sorted(v.name for v in talk(server, _describe).tts[0].voices) == ["icl5", "xv"]
        # streamed into an ICL voice: the reference warms the decoder, only the new speech comes out
        # (upstream cuts the reference's share of its audio proportionally: one sample may differ in length)
        events = talk(server, lambda c: _stream(c, {"name": "icl5", "language": "en"},
                                                pieces(text, random.Random(3))))
        got, ref = audio(events[:-1]), official("icl_short_ref_stream", "base06")
        n = min(len(got), len(ref))
        assert abs(len(got) - len(ref)) <= 1 and np.abs(got[-n:] - ref[-n:]).max() <= TOL
        server.wait_idle()
    finally:
        server.stop()


def test_voice_design_model_speaks_as_instructed(tmp_path):
    """A VoiceDesign model: one voice, "design", described by --instructions; the official output."""
    case = fx.get_case("vd17", "auto_nsm")
    server = LiveWyoming("vd17", tmp_path, voice=None, instructions=case["kw"]["instruct"])
    try:
        [voice] = talk(server, _describe).tts[0].voices
        assert voice.name == "design" and voice.description == case["kw"]["instruct"]
        events = talk(server, lambda c: _say(c, Synthesize(text=case["kw"]["text"]).event(), "audio-stop"))
        got, ref = audio(events), official("auto_nsm", "vd17")
        assert got.shape == ref.shape and np.abs(got - ref).max() <= TOL
        err = talk(server, lambda c: _say(c, Synthesize(text="Hi.", voice=SynthesizeVoice(name="ryan")).event(),
                                          "error"))
        assert Error.from_event(err[-1]).code == "voice_not_found" and "'design'" in err[-1].data["text"]
    finally:
        server.stop()


async def _say(client, event, *until_types):
    await client.write_event(event)
    return await until(client, *until_types)


async def _stream(client, voice: dict, parts: list[str]):
    await client.write_event(Event(type="synthesize-start", data={"voice": voice}))
    for p in parts:
        await client.write_event(SynthesizeChunk(text=p).event())
    await client.write_event(SynthesizeStop().event())
    return await until(client, "synthesize-stopped")
