"""What the scheduler daemon needs of its process, apart from serving.

Descriptors: the daemon raises its soft ``RLIMIT_NOFILE`` as far as the hard limit allows (up to what it needs)
and serves at most ``MAX_CLIENTS`` connections, fewer when the limit is lower, keeping ``FD_RESERVE``
descriptors free. CPUs: it runs on every CPU it may use, whatever the worker that started it was pinned to, and
first where its nice value may be lowered.
Logs: repetitive lines (refusals, closed connections, accept failures) are rate-limited: a burst, then about
one line per second, then a count of what was left out, so a flood of hostile connections is not a flood of lines.
"""

from __future__ import annotations

import logging
import os
import resource
import time

__all__ = ["LogLimiter", "fd_limit_cap", "renice", "unpin"]

log = logging.getLogger("crossover.scheduler.daemon")

MAX_CLIENTS = 1024
FD_RESERVE = 32  # descriptors kept free for the daemon itself (listener, epoll, lock, log, trace, accept)
LOG_BURST = 20
LOG_PER_S = 1.0
_CPU_MASK_BITS = 1024  # CPU ids covered when resetting the affinity (beyond os.cpu_count(): ids may have holes)


class LogLimiter:
    """Rate-limited logging per kind of message: ``burst`` lines at once, then ``per_s`` lines per second;
    what is left out is counted and reported as one line ("N more 'KIND' messages suppressed")."""

    def __init__(self, logger: logging.Logger, burst: int = LOG_BURST, per_s: float = LOG_PER_S) -> None:
        self._log = logger
        self.burst = float(burst)
        self.per_s = per_s
        self._state: dict[str, list[float]] = {}  # kind -> [tokens, last refill, suppressed]

    def _refill(self, kind: str, now: float) -> list[float]:
        st = self._state.get(kind)
        if st is None:
            st = self._state[kind] = [self.burst, now, 0.0]
        st[0] = min(self.burst, st[0] + (now - st[1]) * self.per_s)
        st[1] = now
        return st

    def log(self, kind: str, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
        """Log ``msg % args`` unless ``kind`` is over its rate (then count it)."""
        st = self._refill(kind, time.monotonic())
        if st[0] < 1.0:
            st[2] += 1
            return
        st[0] -= 1.0
        if st[2]:
            self._report(kind, st)
        self._log.log(level, msg, *args, exc_info=exc_info)

    def _report(self, kind: str, st: list[float]) -> None:
        self._log.warning("%d more '%s' messages suppressed", int(st[2]), kind)
        st[2] = 0.0

    def next_flush(self) -> float | None:
        """When a count of left-out lines is due (monotonic time), or None."""
        due = [st[1] + max(0.0, 1.0 - st[0]) / self.per_s for st in self._state.values() if st[2]]
        return min(due, default=None)

    def flush(self, now: float, force: bool = False) -> None:
        """Report the counts of left-out lines that are due (all of them with ``force``)."""
        for kind in list(self._state):
            st = self._refill(kind, now)
            if st[2] and (force or st[0] >= 1.0):
                st[0] = max(0.0, st[0] - 1.0)
                self._report(kind, st)


def fd_limit_cap(requested: int | None) -> int:
    """How many connections to serve: raise the soft descriptor limit if the hard one allows, keep a reserve."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_CLIENTS + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want and (hard == resource.RLIM_INFINITY or hard > soft):
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if requested is not None:  # tests: exercise what happens beyond the descriptor limit
        return max(1, requested)
    if soft == resource.RLIM_INFINITY:
        return MAX_CLIENTS
    return max(1, min(MAX_CLIENTS, soft - min(FD_RESERVE, soft // 2)))


def unpin() -> None:
    """Run on every CPU this process may use (the kernel keeps only those its cpuset allows)."""
    try:
        os.sched_setaffinity(0, range(max(os.cpu_count() or 1, _CPU_MASK_BITS)))
    except (AttributeError, OSError) as exc:
        log.info("cannot reset the daemon's CPU affinity (%s); keeping %s", exc, sorted(os.sched_getaffinity(0)))


def renice(increment: int) -> None:
    """Add `increment` to this process's nice value where allowed (a tiny, latency-bound process: a negative one lets
    it run first when a worker waits for it); kept as it is, with one line, where not."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(-20, min(19, os.getpriority(os.PRIO_PROCESS, 0) + increment)))
    except OSError as exc:
        log.info("cannot change the daemon's priority (%s); keeping it", exc)
