"""``crossover-run``'s progress: a line per job (steps, turns, rate) while the jobs run.

:class:`TelemetryTail` reads the workers' telemetry files as they grow (complete lines only; a file is
opened relative to the run directory's descriptor, never through a symbolic link); :class:`Console`
shares the terminal between the jobs' output and the progress: on a terminal one status line is redrawn
at the bottom (cleared before a job's line is printed, drawn again after), elsewhere a plain line is
printed every so often.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import stat
import threading
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["TelemetryTail", "JobProgress", "Console", "format_jobs"]

RATE_STEPS = 20  # the rate is taken over the last steps only: it follows a job that speeds up or slows down
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass
class JobProgress:
    """What one job has done so far, from its telemetry."""

    steps: int = 0
    turns: int = 0
    steps_per_s: float = 0.0


@dataclass
class _File:
    fd: int
    rest: bytes = b""
    job: str | None = None
    steps: int = 0
    turns: int = 0
    times: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=RATE_STEPS + 1))


class TelemetryTail:
    """Follows the ``*.jsonl`` telemetry files of one run directory (an open descriptor)."""

    def __init__(self, dir_fd: int) -> None:
        self._dir_fd = dir_fd
        self._files: dict[str, _File] = {}
        self._skip: set[str] = set()

    def _open_new(self) -> None:
        try:
            names = os.listdir(self._dir_fd)
        except OSError:
            return
        for name in names:
            if not name.endswith(".jsonl") or name in self._files or name in self._skip:
                continue
            try:
                fd = os.open(name, _READ, dir_fd=self._dir_fd)
            except OSError:
                self._skip.add(name)  # a link or gone: never followed
                continue
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                self._skip.add(name)
                continue
            self._files[name] = _File(fd)

    @staticmethod
    def _take(f: _File, rec: dict[str, Any]) -> None:
        kind = rec.get("type")
        if kind == "meta":
            f.job = str(rec.get("job"))
        elif kind == "step":
            f.steps = int(rec.get("step", f.steps)) + 1
            f.times.append(float(rec.get("t", 0.0)))
        elif kind == "span" and rec.get("name") == "compute":
            f.turns += 1

    def poll(self) -> dict[str, JobProgress]:
        """Read what was appended since the last call; per job: the worker that is furthest along."""
        self._open_new()
        for f in self._files.values():
            chunks = []
            with contextlib.suppress(OSError):
                while data := os.read(f.fd, 1 << 16):
                    chunks.append(data)
            if not chunks:
                continue
            *lines, f.rest = (f.rest + b"".join(chunks)).split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    self._take(f, json.loads(line))
        out: dict[str, JobProgress] = {}
        for f in sorted(self._files.values(), key=lambda f: (-f.steps, -f.turns)):
            if f.job is None or f.job in out:
                continue
            rate = 0.0
            if len(f.times) > 1 and f.times[-1] > f.times[0]:
                rate = (len(f.times) - 1) / (f.times[-1] - f.times[0])
            out[f.job] = JobProgress(f.steps, f.turns, rate)
        return out

    def close(self) -> None:
        """Close the files (idempotent)."""
        for f in self._files.values():
            with contextlib.suppress(OSError):
                os.close(f.fd)
        self._files.clear()


def format_jobs(states: dict[str, str | JobProgress]) -> str:
    """``name: step N, T turns, R steps/s`` for each job (or its state: starting, exit status)."""
    parts = []
    for name, st in states.items():
        if isinstance(st, JobProgress):
            rate = f", {st.steps_per_s:.3g} steps/s" if st.steps_per_s > 0 else ""
            parts.append(f"{name}: step {st.steps}, {st.turns} turns{rate}")
        else:
            parts.append(f"{name}: {st}")
    return "; ".join(parts)


class Console:
    """The jobs' output lines and the progress, on one stream (thread-safe)."""

    def __init__(self, out: IO[str], tty: bool) -> None:
        self.out = out
        self.tty = tty
        self.lock = threading.Lock()
        self._status = ""

    def _fit(self, text: str) -> str:
        width = shutil.get_terminal_size((100, 24)).columns
        return text if len(text) < width else text[:max(10, width - 2)] + "…"

    def line(self, text: str) -> None:
        """Print one line (above the status line on a terminal)."""
        with self.lock:
            if self.tty and self._status:
                self.out.write("\r\x1b[2K" + text + "\n" + self._status)
            else:
                self.out.write(text + "\n")
            self.out.flush()

    def status(self, text: str) -> None:
        """On a terminal: redraw the status line; elsewhere: print it as a plain line."""
        with self.lock:
            if self.tty:
                self._status = self._fit(text)
                self.out.write("\r\x1b[2K" + self._status)
            else:
                self.out.write(text + "\n")
            self.out.flush()

    def clear(self) -> None:
        """Remove the status line (before the final report)."""
        with self.lock:
            if self.tty and self._status:
                self.out.write("\r\x1b[2K")
                self.out.flush()
            self._status = ""
