"""Run commands in their own process group and stop the whole group, never just its leader.

Launchers in this project (``horovodrun`` jobs in the test harness and the benchmark CLI, the ranks and
helpers of the emulated network in :mod:`benchmarks.netem`, the jobs of ``crossover-run``) start a
process that starts more processes. Killing only the process we started leaves its children running,
so every launcher starts its command in a new session (``start_new_session=True``, which also makes
it a process group leader) and, on timeout, Ctrl-C or an explicit stop, signals the whole group:
SIGTERM, a grace period, then SIGKILL.

* :func:`start` -- :class:`subprocess.Popen` in a new session.
* :func:`terminate` / :func:`terminate_all` -- SIGTERM the group(s), wait up to ``grace`` seconds for
  the leader(s), SIGKILL the group(s), reap.
* :func:`run` -- like :func:`subprocess.run`, but the group is always terminated when it returns:
  after a timeout (:class:`subprocess.TimeoutExpired` carries what the command printed), on
  KeyboardInterrupt or any other exception, and also after a normal exit (background children
  left in the group are killed).
* :func:`drain` -- what a terminated process left in its pipes.

Standard library only; POSIX only (process groups).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from typing import Any, Iterable, Sequence

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_GRACE", "drain", "run", "start", "terminate", "terminate_all"]

#: Seconds a group gets between SIGTERM and SIGKILL unless the caller says otherwise.
DEFAULT_GRACE = 1.0
#: Upper bound on collecting output after a kill (an escaped grandchild may keep the pipes open).
_DRAIN_TIMEOUT = 5.0


def start(argv: Sequence[str], **popen_kw: Any) -> subprocess.Popen[Any]:
    """:class:`subprocess.Popen` of ``argv`` as the leader of a new session and process group."""
    popen_kw.setdefault("start_new_session", True)
    return subprocess.Popen(list(argv), **popen_kw)


def _group_of(proc: subprocess.Popen[Any]) -> int | None:
    """``proc``'s process group id when it leads its own group, else None (never signal our own group)."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return proc.pid  # leader already reaped: its group may still hold children
    return pgid if pgid == proc.pid else None


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def terminate_all(procs: Iterable[subprocess.Popen[Any]], grace: float = DEFAULT_GRACE) -> None:
    """Stop every process group in ``procs``: SIGTERM all, wait up to ``grace`` s in total, SIGKILL all.

    Each process should have been started with :func:`start` (its own group). A process that does not
    lead its own group is killed alone, so the caller's group is never signalled. The groups are
    SIGKILLed after the wait even when their leaders exited, which also ends children that ignore
    SIGTERM or outlived the leader. Never raises for processes that are already gone.
    """
    procs = list(procs)
    groups = [_group_of(p) for p in procs]
    for proc, pgid in zip(procs, groups):
        if pgid is None:
            if proc.poll() is None:
                proc.kill()
        else:
            _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for pgid in groups:
        if pgid is not None:
            _signal_group(pgid, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("process %d did not exit after SIGKILL", proc.pid)


def terminate(proc: subprocess.Popen[Any], grace: float = DEFAULT_GRACE) -> None:
    """Stop ``proc``'s process group (see :func:`terminate_all`)."""
    terminate_all([proc], grace)


def drain(proc: subprocess.Popen[Any]) -> tuple[Any, Any]:
    """``(stdout, stderr)`` left in a terminated process's pipes; ``(None, None)`` if they stay open."""
    try:
        return proc.communicate(timeout=_DRAIN_TIMEOUT)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return None, None


def run(argv: Sequence[str], *, input: Any = None, capture_output: bool = False,
        timeout: float | None = None, check: bool = False, grace: float = DEFAULT_GRACE,
        **popen_kw: Any) -> subprocess.CompletedProcess[Any]:
    """Like :func:`subprocess.run`, but ``argv`` gets its own process group, which is killed on return.

    After ``timeout`` seconds the group is terminated (SIGTERM, ``grace`` s, SIGKILL) and
    :class:`subprocess.TimeoutExpired` is raised with the output collected so far. On any exception,
    KeyboardInterrupt included, and after a normal exit the group is terminated too (half the grace
    period), so no background child survives. ``check=True`` raises
    :class:`subprocess.CalledProcessError` for a non-zero exit status.
    """
    if capture_output:
        if "stdout" in popen_kw or "stderr" in popen_kw:
            raise ValueError("stdout and stderr arguments may not be used with capture_output")
        popen_kw["stdout"] = popen_kw["stderr"] = subprocess.PIPE
    if input is not None:
        if "stdin" in popen_kw:
            raise ValueError("stdin and input arguments may not both be used")
        popen_kw["stdin"] = subprocess.PIPE
    proc = start(argv, **popen_kw)
    try:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            terminate(proc, grace)
            out, err = drain(proc)
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
        retcode = proc.poll()
        assert retcode is not None
        if check and retcode:
            raise subprocess.CalledProcessError(retcode, proc.args, output=out, stderr=err)
        return subprocess.CompletedProcess(proc.args, retcode, out, err)
    finally:
        terminate(proc, grace / 2)  # also background children left in the group
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
