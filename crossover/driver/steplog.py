"""The per-step CSV telemetry file of one rank (``log_csv``): what the policy saw and decided, step by step."""

from __future__ import annotations

import csv
import errno
import io
import logging
import os
import stat
from collections.abc import Callable
from typing import Any

__all__ = ["StepLog", "check_log_pattern"]

log = logging.getLogger("crossover.driver")

#: Free names tried after the wanted one exists (`<name>.1<ext>`, ...): past that, someone is filling the
#: directory on purpose, and the log stops with a warning instead of scanning further.
MAX_NAME_TRIES = 100
#: The file's mode: the log is this user's (it names the run's gradient norms); umask may narrow it further.
FILE_MODE = 0o600


def check_log_pattern(pattern: object) -> str | None:
    """`log_csv` validated at construction: None, or a file path (str or os.PathLike) whose only
    placeholder is `{rank}`. ValueError saying what to change otherwise."""
    if pattern is None:
        return None
    if isinstance(pattern, os.PathLike):
        pattern = os.fspath(pattern)
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"log_csv must be None or a file path (str), e.g. 'gravac-{{rank}}.csv'; got {pattern!r}")
    if pattern.endswith(("/", os.sep)):
        raise ValueError(f"log_csv must name a file, not a directory: {pattern!r} (e.g. {pattern}gravac.csv)")
    try:
        pattern.format(rank=0)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise ValueError(f"log_csv {pattern!r}: the only placeholder allowed is {{rank}} (write {{{{ and }}}} for a "
                         f"literal brace); {type(exc).__name__}: {exc}") from None
    return pattern


class StepLog:
    """The per-step CSV telemetry file of one rank (`log_csv`).

    * One file per rank: `{rank}` in the pattern is replaced by the rank; a pattern without it gets
      `.rank<r>` before its extension (`gravac.csv` -> `gravac.rank0.csv`), so ranks never share a file.
    * Checked at construction: the pattern (only `{rank}` as a placeholder) and this rank's directory
      (it must exist and be writable), ValueError otherwise. When the rank is not known yet (Horovod
      not initialised), a directory that depends on `{rank}` is checked at the first step instead.
    * Never mixed into an existing file, never written through a symlink: the file is created at the
      first step with O_CREAT | O_EXCL | O_NOFOLLOW (mode 0600) and kept open; if the path exists (a
      file, a symlink), the next free `<name>.<n><ext>` is used and a warning names it.
    * Never stops training: the rows are written from inside the backward pass (Horovod's hook, DDP's),
      so an I/O error there (a full disk, a removed directory) stops the log with one warning.
    * A header that cannot lie: fixed columns, the probed CFs are values in each row
      (`probe1_cf, probe1_gain, probe2_cf, probe2_gain`; GraVAC probes at most two CFs), `skipped` = 1
      when the policy did not observe the step (non-finite or saturated statistics).
    * The squared norms the gains come from, summed over ranks and tensors (`grad_sq` = ||g||^2,
      `acc_sq` = ||g + e||^2, `probe1_sq`, `probe2_sq` = ||C_cf(g + e)||^2): `probeN_gain` is the "norm"
      definition, sqrt(probeN_sq / acc_sq); the default "delivered" gain is min(1, sqrt(probeN_sq / grad_sq)).
    * `momentum`: the optimizers' momentum the step's statistics carried (mean over ranks; empty when not
      reported), which caps the ladder. A policy's decisions can be replayed from these columns.
    """

    HEADER = ("step", "sent_cf", "step_time_s", "bytes_sent", "bytes_dense", "probe1_cf", "probe1_gain",
              "probe2_cf", "probe2_gain", "skipped", "grad_sq", "acc_sq", "probe1_sq", "probe2_sq", "momentum")
    #: columns added since the first logs: a file without them still replays (the momentum then reads as unreported)
    ADDED_LATER = ("momentum",)
    MAX_PROBES = 2
    _file: io.FileIO | None = None  # the open log (a class default: __del__ after a refused construction)

    def __init__(self, pattern: object, rank: Callable[[], int]) -> None:
        self.pattern = check_log_pattern(pattern)
        self._rank = rank
        self.path: str | None = None  # the file actually written, once opened
        self.stopped: str | None = None  # why the log stopped (an I/O error), None while it runs
        self._file: io.FileIO | None = None
        if self.pattern:
            self._check_directory()

    def _wanted(self, rank: int) -> str:
        pattern = self.pattern or ""
        if "{rank}" not in pattern:
            root, ext = os.path.splitext(pattern)
            pattern = root + ".rank{rank}" + ext
        return pattern.format(rank=rank)

    def _check_directory(self) -> None:
        """This rank's directory exists and is writable (ValueError otherwise); skipped while the rank is
        unknown and the directory depends on it."""
        try:
            rank = int(self._rank())
        except Exception:  # noqa: BLE001 - e.g. Horovod not initialised yet: checked at the first step
            if "{rank}" in os.path.dirname(self.pattern or ""):
                return
            rank = 0
        folder = os.path.dirname(self._wanted(rank)) or "."
        if not os.path.isdir(folder):
            raise ValueError(f"log_csv {self.pattern!r}: directory {folder!r} (rank {rank}) does not exist; "
                             f"create it before training, or change log_csv")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"log_csv {self.pattern!r}: directory {folder!r} (rank {rank}) is not writable; "
                             f"change log_csv")

    def open(self) -> None:
        """Create this rank's file with its header (first step); idempotent. An I/O error stops the log."""
        if not self.pattern or self.path is not None or self.stopped is not None:
            return
        try:
            wanted = self._wanted(self._rank())
            self._file, self.path = self._create(wanted)
            self._write_row(self.HEADER)
        except OSError as exc:
            self._stop(exc)
            return
        if self.path != wanted:
            log.warning("crossover: log_csv file %s exists; writing %s instead (an existing file or link is never "
                        "written to)", wanted, self.path)

    @staticmethod
    def _create(wanted: str) -> tuple[io.FileIO, str]:
        """A new regular file of this user at `wanted`, or at the next free `<name>.<n><ext>`."""
        root, ext = os.path.splitext(wanted)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        for n in range(MAX_NAME_TRIES + 1):
            path = wanted if n == 0 else f"{root}.{n}{ext}"
            try:
                fd = os.open(path, flags, FILE_MODE)
            except FileExistsError:
                continue
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():  # O_EXCL made it: never expected
                os.close(fd)
                raise OSError(errno.EPERM, f"{path} is not a regular file of this user")
            return io.FileIO(fd, "w", closefd=True), path
        raise OSError(errno.EEXIST, f"{wanted} and {MAX_NAME_TRIES} numbered alternatives exist")

    def _write_row(self, row: Any) -> None:
        buf = io.StringIO()
        csv.writer(buf).writerow(row)
        data = memoryview(buf.getvalue().encode())
        while data:  # unbuffered: an error shows here, not at some later flush
            n = self._file.write(data)  # type: ignore[union-attr]
            if not n:
                raise OSError(errno.EIO, "short write")
            data = data[n:]

    def _stop(self, exc: OSError) -> None:
        """Stop the log after an I/O error: one warning, the file closed, training untouched."""
        self.stopped = f"{type(exc).__name__}: {exc}"
        log.warning("crossover: log_csv %s: %s; the per-step CSV log stops here, training goes on",
                    self.path or self.pattern, self.stopped)
        self.close()

    def close(self) -> None:
        """Close the file (it is also closed when this object is collected)."""
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """A copy (deepcopy, pickle) never shares the open file: it creates its own at its first step."""
        state = dict(self.__dict__)
        state.update(_file=None, path=None)
        return state

    def write(self, step: int, rec: Any, step_time: float) -> None:
        """One finished step's row (`rec`: the sparse driver's `StepRecord`); an I/O error stops the log (one
        warning), never the caller."""
        if not self.pattern:
            return
        self.open()
        if self._file is None:
            return
        probes: list[Any] = []
        for cf, g in list(zip(rec.probes, rec.gains()))[:self.MAX_PROBES]:
            probes += [cf, "" if g is None or rec.skipped else g]
        probes += [""] * (2 * self.MAX_PROBES - len(probes))
        measured = rec.tensors > 0 and not rec.skipped
        norms = [rec.grad_sq, rec.acc_sq, *rec.probe_sq[:self.MAX_PROBES]] if measured else []
        norms = [repr(float(v)) for v in norms] + [""] * (2 + self.MAX_PROBES - len(norms))
        try:
            self._write_row([step, rec.sent_cf, f"{step_time:.6f}", rec.bytes_sent, rec.bytes_dense,
                             *probes, int(rec.skipped), *norms,
                             "" if rec.momentum is None else repr(float(rec.momentum))])
        except OSError as exc:
            self._stop(exc)
