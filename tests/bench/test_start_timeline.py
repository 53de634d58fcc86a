"""bench/start_timeline.py: the CLI's command runs as it would, with a line per phase on stderr."""

import re
import subprocess
import sys
from pathlib import Path

from tests.golden import fixtures as fx

ROOT = Path(__file__).resolve().parents[2]


def test_a_command_runs_unchanged_with_its_phases_timed(tmp_path):
    out = tmp_path / "hello.wav"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "start_timeline.py"), "say", "Hello.", "--model",
                           str(fx.checkpoint("cv06")), "-o", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.stat().st_size > 44  # a WAV with samples
    lines = [m.group(1) for m in re.finditer(r"^\[tl +[\d.]+\] (.*)$", done.stderr, re.M)]
    ends = [s for s in lines if " end: " in s]
    assert [s.split(" end")[0] for s in ends] == ["load_checkpoint", "ModelRunner.__init__",
                                                  "ModelRunner.capture_graphs", "StreamingVocoder.capture_graphs"]
    assert all(re.search(r"end: [\d.]+ s, dynamo [\d.]+ s, \d+ graphs from the compile cache", s) for s in ends)
