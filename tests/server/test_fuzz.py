"""Schemathesis against the server's own OpenAPI schema (live tiny CustomVoice and Base servers, CPU), bounded:
valid (positive) and invalid (negative) requests for every documented operation. No answer may be a 5xx, and
every 4xx must be JSON of OpenAI's error shape {"error": {"message", "type", ...}}.

Bounded so the whole fuzz takes well under a minute on 2 cores: a fixed number of examples per operation and
mode (derandomized: the same cases on every run), and speech requests capped at a few frames (a request that
reaches the engine otherwise generates up to max_new_tokens frames)."""

import json

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 25}  # per operation and mode
SPEECH_EXAMPLES = 100  # per mode for POST /v1/audio/speech: the body with the most fields
MAX_FRAMES = 4  # speech requests that reach the engine: max_new_tokens capped here


def cap(case) -> None:
    body = case.body
    if isinstance(body, dict):
        n = body.get("max_new_tokens")
        if n is None or (isinstance(n, int) and not isinstance(n, bool) and n > MAX_FRAMES):
            body["max_new_tokens"] = MAX_FRAMES


def check(case, r: requests.Response, failures: list) -> None:
    what = f"{case.method} {case.formatted_path} -> {r.status_code}"
    if r.status_code >= 500:
        failures.append(f"{what}: 5xx: {r.text[:300]} (body {json.dumps(case.body, default=str)[:300]})")
    elif r.status_code >= 400:
        try:
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        except (ValueError, KeyError, TypeError, AssertionError):
            failures.append(f"{what}: 4xx without a JSON error: {r.text[:300]}")


def fuzz(server) -> tuple[int, list[str], dict]:
    schema = schemathesis.openapi.from_dict(server.app.openapi())
    session = requests.Session()
    failures: list[str] = []
    counts: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        for mode, n in EXAMPLES.items():
            n = SPEECH_EXAMPLES if op.path == "/v1/audio/speech" else n
            key = f"{op.method.upper()} {op.path} {mode.value}"

            @settings(max_examples=n, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                cap(case)
                r = case.call(base_url=server.base_url, session=session, timeout=60)
                counts[key] = counts.get(key, 0) + 1
                check(case, r, failures)

            try:
                run()
            except Unsatisfiable:  # negative mode, and the operation has no input that could be made invalid
                assert mode == GenerationMode.NEGATIVE and not counts.get(key), key
    return sum(counts.values()), failures, counts


@pytest.mark.parametrize("which", ["cv_server", "base_server"])
def test_fuzz_openapi_no_5xx_and_json_errors(which, request, tmp_path_factory):
    server = request.getfixturevalue(which)
    total, failures, counts = fuzz(server)
    report = {"server": which, "cases": total, "failures": failures, "per_operation": counts}
    out = tmp_path_factory.getbasetemp() / f"fuzz-{which}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"schemathesis {schemathesis.__version__} on {which}: {total} cases over {len(counts)} operation/mode "
          f"pairs, {len(failures)} failures ({out})")
    assert not failures, "\n".join(failures[:10])
    # every documented operation was exercised (positive), those with inputs also with invalid ones
    ops = {k.rsplit(" ", 1)[0] for k in counts}
    assert len(ops) == sum(len(methods) for methods in server.app.openapi()["paths"].values()), counts
    assert min(counts[f"POST /v1/audio/speech {m}"] for m in ("positive", "negative")) >= SPEECH_EXAMPLES // 2
    server.wait_idle(timeout=15)
