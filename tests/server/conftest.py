"""Session-wide live servers (see live.py): one per tiny checkpoint, started on first use."""

import importlib.util

import pytest

# the server's optional dependencies (pip install -e ".[serve,test]"); without them these tests are skipped
MISSING = [m for m in ("fastapi", "uvicorn", "openai", "httpx", "av", "prometheus_client", "multipart")
           if importlib.util.find_spec(m) is None]
if MISSING:
    pytest.skip(f"server dependencies missing: {', '.join(MISSING)}", allow_module_level=True)

from .live import start_server


@pytest.fixture(scope="session")
def cv_server(tmp_path_factory):
    s = start_server("cv06", tmp_path_factory.mktemp("voices-cv"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def base_server(tmp_path_factory):
    s = start_server("base06", tmp_path_factory.mktemp("voices-base"), max_upload_bytes=400_000)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def vd_server(tmp_path_factory):
    s = start_server("vd17", tmp_path_factory.mktemp("voices-vd"), max_concurrent=2)
    yield s
    s.stop()
