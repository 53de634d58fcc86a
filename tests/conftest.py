import os

import pytest
import torch

SUITE_KNOBS = ("Q3TTS_ARTIFACTS", "Q3TTS_SOAK_S")  # the suite's own settings (tests/server/test_web_page.py, test_soak.py)


def pytest_configure(config):
    # The suite tests q3tts's defaults. A Q3TTS_* setting left in the caller's environment (e.g. Q3TTS_DEADLINE=1 from
    # a benchmark's shell) would change every engine and server under test, and the subprocesses the tests start
    # inherit it; so they go before any test module imports q3tts. A test that wants a setting sets it itself
    # (monkeypatch.setenv, run_child's environment).
    for name in [k for k in os.environ if k.startswith("Q3TTS_") and k not in SUITE_KNOBS]:
        del os.environ[name]


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    # Tiny models: a second intra-op thread only adds synchronisation (100x slower on a loaded 2-core box).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def real_checkpoint(tmp_path_factory):
    """model (q3tts.randomckpt.MODELS) -> the directory of its random checkpoint at the real dimensions (GPU tests),
    written once per run: under pytest-xdist the workers share the directory (a file lock: one writes, the others
    wait), as writing one is slow (gigabytes for 1.7B)."""
    import fcntl
    import os

    from q3tts import randomckpt
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def path(model: str):
        out = root / f"real-{model}"
        with open(f"{out}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "bench_checkpoint.json").exists():  # written last
                randomckpt.make_checkpoint(model, out)
        return out
    return path
