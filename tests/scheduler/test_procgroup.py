"""Tests of crossover.procgroup with real processes: whole groups die, output and exit codes come back.

A group is "gone" when no live (non-zombie) process in /proc has it as its process group. About 4 s.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crossover import procgroup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(path.split("/")[2]))
    return members


def assert_group_gone(pgid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        assert time.monotonic() < deadline, f"group {pgid} still has {group_members(pgid)}"
        time.sleep(0.05)


def test_timeout_kills_the_whole_group_and_returns_output() -> None:
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        procgroup.run(["sh", "-c", "echo $$; sleep 100 & sleep 100"], capture_output=True, text=True, timeout=0.5)
    assert time.monotonic() - t0 < 5
    pgid = int(info.value.output.split()[0])  # sh leads its own group: $$ is the group id
    assert pgid != os.getpgid(0)
    assert_group_gone(pgid)


def test_output_and_exit_codes_pass_through() -> None:
    res = procgroup.run(["sh", "-c", "echo out; echo err >&2; exit 3"], capture_output=True, text=True)
    assert (res.returncode, res.stdout, res.stderr) == (3, "out\n", "err\n")
    assert procgroup.run(["true"]).returncode == 0
    assert procgroup.run(["cat"], input=b"abc", capture_output=True).stdout == b"abc"
    with pytest.raises(subprocess.CalledProcessError) as info:
        procgroup.run(["sh", "-c", "exit 5"], check=True)
    assert info.value.returncode == 5


def test_normal_exit_kills_background_children() -> None:
    res = procgroup.run(["sh", "-c", "sleep 100 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                        timeout=10)
    assert res.returncode == 0
    child = int(res.stdout)
    deadline = time.monotonic() + 5
    while _alive(child):
        assert time.monotonic() < deadline, f"background child {child} survived"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_ignored_gets_sigkill_after_grace() -> None:
    proc = procgroup.start(["sh", "-c", "trap '' TERM; echo ready; sleep 100"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    t0 = time.monotonic()
    procgroup.terminate(proc, grace=1.0)
    elapsed = time.monotonic() - t0
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert 0.9 <= elapsed < 4.0
    assert_group_gone(proc.pid)


def test_terminate_all_shares_one_grace_period() -> None:
    procs = [procgroup.start(["sh", "-c", "trap '' TERM; echo ready; sleep 100"], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    t0 = time.monotonic()
    procgroup.terminate_all(procs, grace=1.0)
    assert time.monotonic() - t0 < 2.5  # one grace period for all, not one each
    for p in procs:
        assert p.stdout is not None
        p.stdout.close()
        assert p.returncode == -signal.SIGKILL
        assert_group_gone(p.pid)


def test_keyboard_interrupt_kills_the_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pgid"

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            procgroup.run(["sh", "-c", f"echo $$ > {pid_file}; sleep 100 & sleep 100"], timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert_group_gone(int(pid_file.read_text()))


def test_process_outside_its_own_group_is_killed_alone() -> None:
    proc = procgroup.start(["sleep", "100"], start_new_session=False)
    procgroup.terminate(proc, grace=0.5)  # must not signal the group pytest runs in
    assert proc.returncode == -signal.SIGKILL
