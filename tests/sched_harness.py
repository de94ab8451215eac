"""Real scheduler daemons for the scheduler tests: a scratch directory per test, a daemon started in it,
and the clean-up that kills every daemon serving that directory (also a stopped one) when the test ends."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from crossover.scheduler import paths

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def daemons_for(d: str) -> list[int]:
    """Pids of running (not zombie) daemon processes whose command line names directory ``d``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if (b"crossover.scheduler.daemon" in cmd and d.encode() in cmd
                    and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"):
                out.append(int(pid))
        except (OSError, IndexError):
            continue
    return out


def kill_daemons(d: str) -> None:
    """SIGKILL every daemon of ``d`` (after SIGCONT: a test may have stopped one)."""
    for pid in daemons_for(d):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def scratch_dir(prefix: str) -> Iterator[str]:
    """A fresh directory under /tmp for one test (the body of a ``sched_dir`` fixture); removed afterwards,
    with its daemons killed. Short: Unix socket paths are limited to 107 bytes."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield d
    finally:
        kill_daemons(d)
        shutil.rmtree(d, ignore_errors=True)


def start_daemon(d: str, *args: str, nofile: int | None = None, timeout: float = 20.0) -> subprocess.Popen[bytes]:
    """A daemon for ``d`` (optionally under ``ulimit -n nofile``), returned once its socket exists; its output
    goes to ``d/daemon.log``."""
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(os.path.join(d, "daemon.log"), "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "crossover.scheduler.daemon", "--dir", d, *args],
                                env=ENV, stdout=log, stderr=log, start_new_session=True, preexec_fn=limit)
    deadline = time.monotonic() + timeout
    while not os.path.exists(paths.socket_path(d)):
        assert proc.poll() is None, Path(d, "daemon.log").read_text()
        assert time.monotonic() < deadline, "daemon did not start"
        time.sleep(0.02)
    return proc


#: A stand-in job's body: one rank's telemetry of three steps (compute, then waiting on communication), at once.
TELEMETRY_OF_THREE_STEPS = """
import os, time
from crossover.scheduler.telemetry import Recorder
r = Recorder(os.environ["CROSSOVER_TELEMETRY_DIR"], os.environ["CROSSOVER_JOB"], "rank0", "localhost", "cpu")
t = time.time()
for i in range(3):
    r.span("compute", t + i, t + i + 0.5)
    r.span("wait_comm", t + i + 0.5, t + i + 1)
    r.step(i, t + i + 1, 0.5, 0.0, 0.5)
r.close()
"""


def stand_in_horovodrun(d: Path, script: str, job: str = "") -> Path:
    """Into folder ``d``: job.py (``job``'s text) and an executable ``horovodrun`` running ``script`` (Python) in
    its place, for crossover-run tests that need no Horovod start-up. Returns the stand-in's path."""
    (d / "job.py").write_text(job)
    fake = d / "horovodrun"
    fake.write_text(f"#!{sys.executable}\n" + script)
    fake.chmod(0o755)
    return fake
