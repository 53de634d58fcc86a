"""The web page in a real browser: headless Chromium (Debian's chromium + chromium-driver) driven by
Selenium against a live server. Skipped where no Chromium / chromedriver is installed."""

import shutil

import pytest

from .live import start_server

webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip("no chromium / chromedriver on this machine", allow_module_level=True)

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server("cv06", tmp_path_factory.mktemp("voices-web"), max_seq_len=96)  # short requests on CPU
    yield s
    s.stop()


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--autoplay-policy=no-user-gesture-required"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield d
    d.quit()


def by_id(d, i):
    return d.find_element("id", i)


def test_page_lists_voices_plays_and_streams(server, browser):
    d = browser
    d.get(server.base_url + "/")
    wait = WebDriverWait(d, 120)
    wait.until(lambda d: len(Select(by_id(d, "voice")).options) > 0)
    assert "tiny-cv06" in by_id(d, "model").text and "custom_voice" in by_id(d, "model").text
    voices = [o.text for o in Select(by_id(d, "voice")).options]
    assert "vivian" in voices and "dylan" in voices
    Select(by_id(d, "voice")).select_by_visible_text("ryan")
    Select(by_id(d, "format")).select_by_visible_text("wav")
    text = by_id(d, "text")
    text.clear()
    text.send_keys("Hello from a real browser.")

    by_id(d, "play").click()  # non-streaming: the response becomes the <audio> element's source
    wait.until(lambda d: by_id(d, "status").text.startswith(("Done", "Error")))
    assert by_id(d, "status").text.startswith("Done"), by_id(d, "status").text
    wait.until(lambda d: d.execute_script("return document.getElementById('player').readyState") >= 1)
    duration = d.execute_script("return document.getElementById('player').duration")
    frames = duration * 12.5  # 80 ms frames, capped by the engine's cache (max_seq_len 96 -> 128 positions)
    assert 1 <= round(frames) <= 128 and abs(frames - round(frames)) < 1e-3, duration

    by_id(d, "stream").click()  # streaming raw PCM into Web Audio
    wait.until(lambda d: by_id(d, "status").text.startswith(("Streamed", "Error")))
    status = by_id(d, "status").text
    assert status.startswith("Streamed") and " s of audio in " in status, status
    assert float(status.split()[1]) > 0

    Select(by_id(d, "voice")).select_by_index(0)
    text.clear()  # an empty input is refused with the server's message, shown on the page
    by_id(d, "play").click()
    wait.until(lambda d: by_id(d, "status").text.startswith(("Done", "Error")))
    assert by_id(d, "status").text.startswith("Error") and "input" in by_id(d, "status").text.lower()
    server.wait_idle()
