"""bench/load.py's figures against a server whose output is known: bench/paced_server.py's real server, whose paced
engine makes exactly max_new_tokens - 1 frames of silence per request (its code 1 is never EOS). With either client
library, every byte the server sends is counted, and each figure is what it claims to be."""

import json

import pytest

pytest.importorskip("aiohttp")

from bench import load  # noqa: E402
from bench.paced_server import paced_app  # noqa: E402
from tests.server.live import SPF, SR, serve  # noqa: E402


@pytest.fixture(scope="module")
def paced():
    live = serve(paced_app(slots=4, decode_ms=1.0, vocode_ms=1.0, prefill_ms=1.0), "uvicorn-paced")
    yield live
    live.stop()


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_load_counts_every_byte_the_server_sends(paced, client, tmp_path):
    out = tmp_path / "load.json"
    assert load.main(["--url", paced.base_url, "--concurrency", "3", "--requests", "2", "--max-new-tokens", "11",
                      "--client", client, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["client"] == client
    (level,) = result["levels"]
    assert level["requests"] == 6 and level["errors"] == 0, level["error_samples"]
    seconds = 10 * SPF / SR  # 10 frames of 80 ms each
    assert level["mean_audio_s_per_request"] == round(seconds, 3) and level["audio_s"] == round(6 * seconds, 3)
    assert 0 < level["ttfa_ms"]["p50"] <= level["ttfa_ms"]["max"] <= 1000 * level["wall_s"]
    assert level["buffer_needed_ms"]["p50"] >= 0 and level["replicas"] == {"null": 6}
    server = level["server"]  # the /metrics deltas cover this level's 6 requests and no other
    assert server["engine_steps"] >= 10 and server["ttfa_ms_mean"] > 0
