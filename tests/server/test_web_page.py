"""The web page in a real browser: headless Chromium (Debian's chromium + chromium-driver) driven by
Selenium against live servers on tiny checkpoints (the session's CustomVoice, VoiceDesign and Base servers).
Chromium runs with a fake microphone, so recording a voice in the page is tested too. Every test saves
screenshots (PNG) to $Q3TTS_ARTIFACTS (default: a pytest temporary directory).
Skipped where no Chromium / chromedriver is installed."""

import base64
import os
import shutil
import time
import wave
from io import BytesIO

import pytest

webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip("no chromium / chromedriver on this machine", allow_module_level=True)

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

WAIT_S = 120  # generous: a tiny model on a slow shared CI CPU
MAX_S = 1.2  # the page's "Max seconds": 15 frames per request keeps each generation short on CPU
MAX_FRAMES = 15


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    d = os.environ.get("Q3TTS_ARTIFACTS")
    if d:
        os.makedirs(d, exist_ok=True)
        return d
    return str(tmp_path_factory.mktemp("web-artifacts"))


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--autoplay-policy=no-user-gesture-required", "--window-size=1100,1500",
              # a microphone that plays a beep, granted without asking
              "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield d
    d.quit()


def by_id(d, i):
    return d.find_element("id", i)


def js(d, script, *args):
    return d.execute_script(script, *args)


def open_page(d, server):
    d.set_window_size(1100, 1500)
    d.get(server.base_url + "/")
    WebDriverWait(d, WAIT_S).until(lambda d: by_id(d, "status").text != "Connecting…")
    assert by_id(d, "status").text == "Ready.", by_id(d, "status").text
    set_text(d, "max-seconds", str(MAX_S))


def status_after(d, click_id, done=("Done", "Streamed", "Error", "Saved", "Deleted")):
    js(d, "document.getElementById('status').textContent = ''")  # not the previous action's answer
    by_id(d, click_id).click()
    WebDriverWait(d, WAIT_S).until(lambda d: by_id(d, "status").text.startswith(done))
    return by_id(d, "status").text


def set_text(d, element_id, text):
    el = by_id(d, element_id)
    el.clear()
    if text:
        el.send_keys(text)


def shot(d, artifacts, name):
    path = os.path.join(artifacts, f"web-{name}.png")
    assert d.save_screenshot(path) and os.path.getsize(path) > 1000
    return path


def downloaded_wav(d) -> tuple[int, int]:
    """The 'Download WAV' link's file, fetched inside the page -> (sample rate, samples)."""
    b64 = d.execute_async_script("""
        const done = arguments[arguments.length - 1];
        fetch(document.getElementById('download').href).then(r => r.arrayBuffer()).then(b => {
          let s = ''; const u = new Uint8Array(b); for (let i = 0; i < u.length; i++) s += String.fromCharCode(u[i]);
          done(btoa(s)); });""")
    with wave.open(BytesIO(base64.b64decode(b64))) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        return w.getframerate(), w.getnframes()


def figures(d) -> dict:
    return {k: by_id(d, k).text for k in ("ttfa", "rtf", "audio-s", "elapsed")}


def check_streamed(d) -> float:
    """After a streamed generation: the status and the live figures agree; returns the audio seconds."""
    status = by_id(d, "status").text
    assert status.startswith("Streamed") and "first audio after" in status, status
    seconds = float(status.split()[1])
    f = figures(d)
    assert f["ttfa"].endswith(" ms") and 0 <= float(f["ttfa"].split()[0]) < WAIT_S * 1000, f
    assert f["rtf"].endswith("×") and float(f["rtf"][:-1]) > 0, f
    assert f["audio-s"] == f"{seconds:.2f} s", f
    # one 80 ms frame is 1920 samples: a whole number of frames, and the WAV download holds exactly them
    rate, n = downloaded_wav(d)
    assert rate == 24000 and 0 < n <= MAX_FRAMES * 1920 and n % 1920 == 0 and abs(n / 24000 - seconds) < 0.005
    assert js(d, "return document.getElementById('progress').value") == 1
    return seconds


def test_custom_voice_page(cv_server, browser, artifacts):
    d = browser
    open_page(d, cv_server)
    assert "tiny-cv06" in by_id(d, "model").text and "custom_voice" in by_id(d, "model").text
    voices = [o.text for o in Select(by_id(d, "voice")).options]
    assert "vivian" in voices and "dylan" in voices
    # 0.6B CustomVoice: speakers, no style instruction, no cloning
    assert by_id(d, "voice").is_displayed() and not by_id(d, "instructions").is_displayed()
    assert not by_id(d, "clone").is_displayed() and not by_id(d, "delete-voice").is_displayed()
    Select(by_id(d, "voice")).select_by_visible_text("ryan")
    set_text(d, "text", "Hello from a real browser.")

    # streaming (the default): PCM into Web Audio, live figures, waveform, WAV download
    assert status_after(d, "generate").startswith("Streamed"), by_id(d, "status").text
    check_streamed(d)
    painted = js(d, """const c = document.getElementById('wave'), g = c.getContext('2d');
        const p = g.getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 0; i < p.length; i += 4) if (p[i + 2] > 200) n++; return n;""")
    assert painted > 0  # the waveform's colour (#5fb3ff) is on the canvas
    shot(d, artifacts, "custom-voice-streamed")

    # not streaming: the chosen format, progress while it arrives, then the <audio> element plays the file
    by_id(d, "streaming").click()
    Select(by_id(d, "format")).select_by_visible_text("wav")
    status = status_after(d, "generate")
    assert status.startswith("Done") and status.endswith("wav)"), status
    assert js(d, "return document.getElementById('progress').value") == 1
    WebDriverWait(d, WAIT_S).until(lambda d: js(d, "return document.getElementById('player').readyState") >= 1)
    duration = js(d, "return document.getElementById('player').duration")
    assert abs(duration - float(status.split()[1])) < 0.01, (duration, status)  # status prints 2 decimals
    assert downloaded_wav(d)[1] == round(duration * 24000)
    Select(by_id(d, "format")).select_by_visible_text("mp3")  # decoded in the page for the waveform + WAV
    status = status_after(d, "generate")
    assert status.startswith("Done") and status.endswith("mp3)") and downloaded_wav(d)[1] > 0, status
    by_id(d, "streaming").click()

    # errors: the server's own words on the status line
    set_text(d, "text", "")
    status = status_after(d, "generate")
    assert status == "Error: input is empty: give the words to speak", status
    set_text(d, "text", "Who?")
    js(d, "const s = document.getElementById('voice'); s.add(new Option('nobody', 'nobody')); s.value = 'nobody';")
    status = status_after(d, "generate")
    assert status.startswith("Error: Unsupported voice 'nobody'. Supported: ['aiden'"), status
    cv_server.wait_idle()


def test_keyboard_only_and_phone_width(cv_server, browser, artifacts):
    d = browser
    open_page(d, cv_server)
    # Tab order follows the page: voice -> text -> language -> ... -> Generate; Enter on it generates
    by_id(d, "voice").send_keys(Keys.TAB)
    order = []
    for _ in range(12):
        el = d.switch_to.active_element
        order.append(el.get_attribute("id"))
        if order[-1] == "generate":
            break
        el.send_keys(Keys.TAB)
    assert order[0] == "text" and order[-1] == "generate", order
    assert order.index("language") < order.index("streaming") < order.index("generate"), order
    d.switch_to.active_element.send_keys(Keys.ENTER)
    WebDriverWait(d, WAIT_S).until(lambda d: by_id(d, "status").text.startswith(("Streamed", "Error")))
    check_streamed(d)
    # Ctrl+Enter in the text box generates too
    by_id(d, "text").send_keys(Keys.CONTROL, Keys.ENTER)
    WebDriverWait(d, WAIT_S).until(lambda d: by_id(d, "status").text.startswith(("Streamed", "Error")))
    check_streamed(d)

    # a 390 px wide phone: one column, nothing wider than the screen
    d.set_window_size(390, 844)
    width = js(d, "return window.innerWidth")
    assert js(d, "return document.documentElement.scrollWidth") <= width
    left = [by_id(d, i).rect["x"] for i in ("language", "format", "speed")]
    assert max(left) - min(left) < 1, left  # stacked, not side by side
    shot(d, artifacts, "phone")
    d.set_window_size(1100, 1500)
    cv_server.wait_idle()


def test_voice_design_page(vd_server, browser, artifacts):
    d = browser
    open_page(d, vd_server)
    assert "voice_design" in by_id(d, "model").text
    assert not by_id(d, "voice").is_displayed() and by_id(d, "instructions").is_displayed()
    assert by_id(d, "instr-label").text == "Voice description (required)"
    set_text(d, "instructions", "A cheerful robot with a metallic ring.")
    set_text(d, "text", "Designed in the browser.")
    assert status_after(d, "generate").startswith("Streamed"), by_id(d, "status").text
    check_streamed(d)
    shot(d, artifacts, "voice-design")
    set_text(d, "instructions", "")
    status = status_after(d, "generate")
    assert status.startswith("Error: instructions is required"), status
    vd_server.wait_idle()


def test_base_clone_from_file_and_microphone(base_server, browser, artifacts, tmp_path):
    from .test_voices import REF_TEXT, reference_wav
    d = browser
    open_page(d, base_server)
    assert by_id(d, "clone").is_displayed() and not by_id(d, "instructions").is_displayed()
    before = {o.get_attribute("value") for o in Select(by_id(d, "voice")).options} - {""}

    # 1. an uploaded file with its transcript -> an ICL voice, listed, selected, used
    clip = tmp_path / "ref.wav"
    clip.write_bytes(reference_wav())
    set_text(d, "vname", "web-file")
    by_id(d, "vfile").send_keys(str(clip))
    set_text(d, "vreftext", REF_TEXT)
    status = status_after(d, "vsave")
    assert status == "Saved voice web-file (icl).", status
    assert Select(by_id(d, "voice")).first_selected_option.text == "web-file (icl)"
    set_text(d, "text", "Cloned from a file.")
    assert status_after(d, "generate").startswith("Streamed"), by_id(d, "status").text
    check_streamed(d)

    # 2. the (fake) microphone, x-vector only
    by_id(d, "record").click()
    WebDriverWait(d, 10).until(lambda d: by_id(d, "recording").text.startswith("● recording"))
    time.sleep(2.5)  # the clip must be at least 1 s
    by_id(d, "record").click()
    recorded = by_id(d, "recording").text
    assert recorded.startswith("recorded ") and float(recorded.split()[1]) >= 2, recorded
    set_text(d, "vname", "web-mic")
    set_text(d, "vreftext", "")
    by_id(d, "vxvec").click()
    status = status_after(d, "vsave")
    assert status == "Saved voice web-mic (x_vector).", status
    with base_server.http() as h:
        names = {v["name"]: v for v in h.get("/v1/audio/voices").json()["data"]}
    assert {"web-file", "web-mic"} <= set(names) and names["web-mic"]["mode"] == "x_vector"
    set_text(d, "text", "Cloned from the microphone.")
    assert status_after(d, "generate").startswith("Streamed"), by_id(d, "status").text
    check_streamed(d)
    shot(d, artifacts, "base-clone")

    # 3. a silent clip is refused with the server's reason
    import numpy as np

    from q3tts.audio import wav_bytes
    silent = tmp_path / "silent.wav"
    silent.write_bytes(wav_bytes(np.zeros(48000, np.float32), 24000))
    set_text(d, "vname", "web-silent")
    by_id(d, "vfile").send_keys(str(silent))
    status = status_after(d, "vsave")
    assert status.startswith("Error: ") and "silent" in status, status

    # 4. delete both from the page
    for name in ("web-file", "web-mic"):
        Select(by_id(d, "voice")).select_by_value(names[name]["id"])
        status = status_after(d, "delete-voice")
        assert status.startswith("Deleted voice"), status
    after = {o.get_attribute("value") for o in Select(by_id(d, "voice")).options} - {""}
    assert after == before
    base_server.wait_idle()


def test_live_typing_speaks_before_the_text_is_finished(cv_server, browser, artifacts):
    d = browser
    open_page(d, cv_server)
    total = js(d, "return LLM_TEXT.length")
    # a cap above the paragraph's ~60 text tokens, so each sentence's text is all read before the cap ends it
    set_text(d, "max-seconds", "6")
    set_text(d, "llm-rate", "8")  # 8 tokens of 4 characters a second: the paragraph takes ~7 s to write
    by_id(d, "llm-sim").click()
    # audio arrives while the 'LLM' is still writing
    WebDriverWait(d, WAIT_S).until(lambda d: js(d, "return out && out.samples > 0"))
    typed = len(by_id(d, "live-text").get_attribute("value"))
    assert typed < total, (typed, total)
    assert by_id(d, "ttfa").text.endswith(" ms")
    WebDriverWait(d, WAIT_S).until(lambda d: by_id(d, "status").text.startswith(("Live: sentence 1 done", "Error")))
    assert "Error" not in by_id(d, "status").text
    shot(d, artifacts, "live-typing")
    # typing by hand: keys sent one by one, Enter ends the sentence
    by_id(d, "live-text").send_keys(" And typed by hand.", Keys.ENTER)
    WebDriverWait(d, WAIT_S).until(lambda d: by_id(d, "status").text.startswith(("Live: sentence 2 done", "Error")))
    assert "Error" not in by_id(d, "status").text
    by_id(d, "live-stop").click()
    cv_server.wait_idle()
