"""`make demo` (benchmarks/demo.py), shortened: its three runs train, each shows progress while it trains,
and the comparison table follows. Not on a terminal here, so the progress is plain lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_shows_each_run_progress_then_the_table() -> None:
    proc = subprocess.run([sys.executable, "benchmarks/demo.py", "--epochs", "1", "--width", "0.25", "--loopback"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for name in ("dense fp32", "Horovod fp16", "AdaptiveCompression()"):
        assert f"{name}: done, 22/22 steps in " in out, out
    assert out.index("AdaptiveCompression(): done") < out.index("time to target"), out
