"""The per-step CSV telemetry file of one rank (``log_csv``): what the policy saw and decided, step by step."""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from crossover.adaptive.gravac import StepStats
from crossover.driver.records import StepRecord

__all__ = ["StepLog"]

log = logging.getLogger("crossover.driver")


class StepLog:
    """The per-step CSV telemetry file of one rank (`log_csv`).

    * One file per rank: `{rank}` in the pattern is replaced by the rank; a pattern without it gets
      `.rank<r>` before its extension (`gravac.csv` -> `gravac.rank0.csv`), so ranks never share a file.
    * Never mixed into an existing file: the file is created at the first step; if the path exists,
      the next free `<name>.<n><ext>` is used and a warning names it.
    * A header that cannot lie: fixed columns, the probed CFs are values in each row
      (`probe1_cf, probe1_gain, probe2_cf, probe2_gain`; GraVAC probes at most two CFs), `skipped` = 1
      when the policy did not observe the step (non-finite or saturated statistics).
    * The squared norms the gains come from, summed over ranks and tensors (`grad_sq` = ||g||^2,
      `acc_sq` = ||g + e||^2, `probe1_sq`, `probe2_sq` = ||C_cf(g + e)||^2): `probeN_gain` is the "norm"
      definition, sqrt(probeN_sq / acc_sq); the default "delivered" gain is min(1, sqrt(probeN_sq / grad_sq)).
      A policy's decisions can be replayed from these columns.
    """

    HEADER = ("step", "sent_cf", "step_time_s", "bytes_sent", "bytes_dense", "probe1_cf", "probe1_gain",
              "probe2_cf", "probe2_gain", "skipped", "grad_sq", "acc_sq", "probe1_sq", "probe2_sq")
    MAX_PROBES = 2

    def __init__(self, pattern: str | None, rank: Callable[[], int]) -> None:
        self.pattern = pattern
        self._rank = rank
        self.path: str | None = None  # the file actually written, once opened

    def open(self) -> None:
        """Create this rank's file with its header (first step); idempotent."""
        if not self.pattern or self.path is not None:
            return
        pattern = self.pattern
        if "{rank}" not in pattern:
            root, ext = os.path.splitext(pattern)
            pattern = root + ".rank{rank}" + ext
        wanted = pattern.format(rank=self._rank())
        root, ext = os.path.splitext(wanted)
        path, n = wanted, 0
        while True:
            try:
                fh = open(path, "x", newline="")
                break
            except FileExistsError:
                n += 1
                path = f"{root}.{n}{ext}"
        with fh:
            csv.writer(fh).writerow(self.HEADER)
        if path != wanted:
            log.warning("crossover: log_csv file %s exists; writing %s instead (an existing file is never "
                        "appended to)", wanted, path)
        self.path = path

    @classmethod
    def row_stats(cls, row: Mapping[str, str]) -> StepStats | None:
        """The policy's view of one row that `write` wrote (built as the driver builds it, `to_stats`); None for
        a step the policy did not observe (`skipped`). The norm sums are not in the file: they read as 0."""
        if row["skipped"] not in ("0", ""):
            return None
        probes = tuple(float(row[f"probe{i}_cf"]) for i in range(1, cls.MAX_PROBES + 1) if row[f"probe{i}_cf"] != "")
        rec = StepRecord(step=int(row["step"]), sent_cf=float(row["sent_cf"]), probes=probes)
        if row["grad_sq"] != "":  # written only for a measured step
            rec.grad_sq, rec.acc_sq = float(row["grad_sq"]), float(row["acc_sq"])
            rec.probe_sq = [float(row[f"probe{i}_sq"]) for i in range(1, len(probes) + 1)]
        return rec.to_stats(float(row["step_time_s"]))

    def write(self, step: int, rec: StepRecord, step_time: float) -> None:
        if not self.pattern:
            return
        self.open()
        probes: list[Any] = []
        for cf, g in list(zip(rec.probes, rec.gains()))[:self.MAX_PROBES]:
            probes += [cf, "" if g is None or rec.skipped else g]
        probes += [""] * (2 * self.MAX_PROBES - len(probes))
        measured = rec.tensors > 0 and not rec.skipped
        norms = [rec.grad_sq, rec.acc_sq, *rec.probe_sq[:self.MAX_PROBES]] if measured else []
        norms = [repr(float(v)) for v in norms] + [""] * (2 + self.MAX_PROBES - len(norms))
        with open(self.path, "a", newline="") as fh:  # type: ignore[arg-type]
            csv.writer(fh).writerow([step, rec.sent_cf, f"{step_time:.6f}", rec.bytes_sent, rec.bytes_dense,
                                     *probes, int(rec.skipped), *norms])
