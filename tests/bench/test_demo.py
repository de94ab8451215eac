"""`make demo` (benchmarks/demo.py), shortened: its four runs train, each shows progress while it trains,
and the comparison table follows. Not on a terminal here, so the progress is plain lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_demo_shows_each_run_progress_then_the_table() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/demo.py", "--epochs", "1", "--width", "0.25", "--loopback"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for name in ("dense fp32", "Horovod fp16", "top-k 10x", "AdaptiveCompression()"):
        assert f"{name}: done, 22/22 steps in " in out, out
    assert "SGD momentum 0.9" in out and "AdaptiveCompression() chose powersgd" in out, out  # the defaults' family
    assert out.index("AdaptiveCompression(): done") < out.index("time to target"), out
