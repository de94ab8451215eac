"""Progress of benchmark trainings, for the person watching: one line per training while it runs.

Read from the ``progress`` file rank 0 of each training writes after every step (benchmarks/trainer.py,
``write_progress``): ``step total loss t_first t_last``, the last two wall-clock times (``time.time()``)
at which the first step began and the latest step ended.

* On a terminal: a tqdm bar per training, made at its first step with its clock set to when that step
  began (the seconds of start-up before it are not training), and closed as soon as the last step is
  seen, showing the training's own time (not the evaluation and shutdown after it).
* Elsewhere (a pipe, a log file, CI): a plain line per training when it starts, every ``interval``
  seconds, and when it ends.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

__all__ = ["PLAIN_INTERVAL_S", "ProgressDisplay", "Reading", "format_line", "read_progress", "write_progress"]

PLAIN_INTERVAL_S = 10.0  # often enough to see a run move, rare enough to keep a CI log of a long run short
POLL_S = 0.5  # how often the files are read: a bar moves smoothly, and the trainer's own writes dominate


@dataclass(frozen=True)
class Reading:
    """One training's progress as of its latest step."""

    step: int
    total: int
    loss: float
    t_first: float  # wall time when the first step began
    t_last: float  # wall time when step `step` ended

    @property
    def elapsed(self) -> float:
        return max(0.0, self.t_last - self.t_first)

    @property
    def done(self) -> bool:
        return self.step >= self.total


def write_progress(path: Path, reading: Reading) -> None:
    """Replace `path` atomically with `reading` (rank 0 of the trainer, after every step)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{reading.step} {reading.total} {reading.loss:.4f} {reading.t_first:.6f} {reading.t_last:.6f}")
    tmp.replace(path)


def read_progress(path: Path) -> Reading | None:
    """The reading in `path`, or None before the first step (no file yet, or not one of ours)."""
    try:
        fields = path.read_text().split()
        step, total = int(fields[0]), int(fields[1])
        loss, t_first, t_last = float(fields[2]), float(fields[3]), float(fields[4])
    except (OSError, ValueError, IndexError):
        return None
    if step < 1 or total < 1:
        return None
    return Reading(step, total, loss, t_first, t_last)


def _clock(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes}:{s:02d}" if minutes < 60 else f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


def format_line(name: str, r: Reading) -> str:
    """A plain progress line: `name: step 40/88 (45%), 12.1 s training, 3.31 steps/s, loss 0.412`."""
    rate = f"{r.step / r.elapsed:.2f} steps/s" if r.elapsed > 0 else "- steps/s"
    if r.done:
        return f"{name}: done, {r.step}/{r.total} steps in {_clock(r.elapsed)} ({rate}), loss {r.loss:.3f}"
    return (f"{name}: step {r.step}/{r.total} ({100 * r.step // r.total}%), {_clock(r.elapsed)} training, {rate}, "
            f"loss {r.loss:.3f}")


class _Bar:
    """One training's tqdm bar, on the training's clock."""

    def __init__(self, name: str, r: Reading, stream: TextIO) -> None:
        from tqdm import tqdm

        # smoothing=0: the rate is steps / elapsed (steps are uneven: evaluations pause some of them)
        self.bar = tqdm(total=r.total, desc=name, unit="step", leave=True, dynamic_ncols=True, file=stream,
                        smoothing=0, mininterval=0)
        self.closed = False

    def _set_elapsed(self, seconds: float) -> None:
        self.bar.start_t = self.bar._time() - seconds  # tqdm shows now - start_t as the elapsed time

    def show(self, r: Reading) -> None:
        self.bar.n = r.step
        self.bar.set_postfix_str(f"loss {r.loss:.3f}", refresh=False)
        if r.done:  # freeze the clock at the last step's end, then close
            self._set_elapsed(r.elapsed)
            self.close()
        else:
            self._set_elapsed(max(0.0, time.time() - r.t_first))
            self.bar.refresh()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.bar.close()


class ProgressDisplay:
    """Shows the progress of trainings (name -> progress file) while used as a context manager.

    `terminal=None` decides from `stream.isatty()`; `poll()` does one round of reading and showing
    (the background thread calls it every POLL_S seconds)."""

    def __init__(self, files: dict[str, Path], stream: TextIO | None = None, terminal: bool | None = None,
                 interval: float = PLAIN_INTERVAL_S) -> None:
        self.files = dict(files)
        self.stream = stream if stream is not None else sys.stdout
        if terminal is None:
            terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self.terminal = terminal and self._have_tqdm()
        self.interval = interval
        self._bars: dict[str, _Bar] = {}
        self._latest: dict[str, Reading] = {}
        self._printed_at: dict[str, float] = {}  # plain mode: monotonic time of each training's last line
        self._ended: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="progress")

    @staticmethod
    def _have_tqdm() -> bool:
        try:
            import tqdm  # noqa: F401
        except ImportError:
            return False
        return True

    def __enter__(self) -> ProgressDisplay:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()  # the last steps written before the job ended
        self.close()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def poll(self, now: float | None = None) -> None:
        """Read every file once and show what changed (`now`: a time.monotonic() value, for tests)."""
        now = time.monotonic() if now is None else now
        for name, path in self.files.items():
            if name in self._ended:
                continue
            r = read_progress(path)
            if r is None or r == self._latest.get(name):
                continue
            self._latest[name] = r
            if r.done:
                self._ended.add(name)
            if self.terminal:
                bar = self._bars.get(name)
                if bar is None:
                    bar = self._bars[name] = _Bar(name, r, self.stream)
                bar.show(r)
            elif r.done or name not in self._printed_at or now - self._printed_at[name] >= self.interval:
                self._printed_at[name] = now
                self._say(format_line(name, r))

    def close(self) -> None:
        """Close the bars; in plain mode, say where an unfinished training stopped."""
        for bar in self._bars.values():
            bar.close()
        if not self.terminal:
            for name, r in self._latest.items():
                if name not in self._ended:
                    self._ended.add(name)
                    self._say(f"{name}: stopped at step {r.step}/{r.total}")

    def _say(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
