"""Replay a run's recorded GraVAC statistics through the current policy: where would its decisions differ?

A run with ``AdaptiveCompression(log_csv=...)`` (every ``crossover-bench --compression gravac`` run writes
``policy.rank0.csv``) records, per step, the CF it sent, the step time and the squared norms the gains
come from. :class:`~crossover.adaptive.gravac.GravacPolicy` is a pure function of those observations, fed
one step late as the glue feeds them (``crossover/driver/``: the plan of step t is made after
observing steps up to t - 2). So feeding the recorded rows to the policy of today's code reproduces the
recorded decisions exactly up to the first step where the code (or a setting) decides otherwise; after
that step the real run would have measured something else, and nothing more can be said.

Use it before re-running a benchmark for a policy change: a recorded run whose decisions do not change
needs no re-run to know the change leaves it alone (for the same observations).

    python -m benchmarks.replay_policy results/bench/tta-vgg16/gravac-1/policy.rank0.csv
    python -m benchmarks.replay_policy --set omega=0.2 $(find results -name policy.rank0.csv -path '*gravac*')

Exit status: 0 when every run keeps its decisions, 1 when some run's differ (as diff), 2 on bad input.

Only the "delivered" and "norm" gains can be replayed: the CSV keeps squared norms, not the per-tensor
norm sums of the "authors" gain.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossover.adaptive.gravac import GravacPolicy
from crossover.driver import StepLog, StepRecord

_REPLAYABLE_GAINS = ("delivered", "norm")


@dataclass(frozen=True)
class Replay:
    """Recorded and replayed CFs per step; ``diverges_at`` is the first step where they differ (None: never)."""

    recorded: list[float]
    replayed: list[float]
    diverges_at: int | None


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a policy CSV; ValueError if its header is not the one ``StepLog`` writes."""
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in StepLog.HEADER if c not in (reader.fieldnames or ()) and c not in StepLog.ADDED_LATER]
        if missing:
            raise ValueError(f"{path}: not a policy CSV written by AdaptiveCompression(log_csv=...): "
                             f"missing columns {', '.join(missing)}")
        return list(reader)


def replay(rows: Sequence[dict[str, str]], settings: dict[str, Any] | None = None) -> Replay:
    """Feed ``rows`` to a fresh ``GravacPolicy(**settings)`` with the glue's one-step lag."""
    settings = dict(settings or {})
    if settings.get("gain", "delivered") not in _REPLAYABLE_GAINS:
        raise ValueError(f"gain={settings['gain']!r} cannot be replayed from a CSV (it keeps squared norms only); "
                         f"use one of {', '.join(_REPLAYABLE_GAINS)}")
    if settings.get("search", "ladder") != "ladder":
        raise ValueError("only the ladder search (the default) is replayed: the paper search's plans probe "
                         "CFs the CSV does not record")
    policy = GravacPolicy(**settings)
    policy.expect_momentum()  # as the step driver does; the `momentum` column then caps it (older logs: no cap)
    replayed = []
    for i in range(len(rows)):
        stats = StepRecord.log_row_stats(rows[i - 2]) if i >= 2 else None
        if stats is not None:
            policy.observe(stats)
        replayed.append(policy.plan().send_cf)
    recorded = [float(r["sent_cf"]) for r in rows]
    first = next((i for i, (a, b) in enumerate(zip(recorded, replayed)) if a != b), None)
    return Replay(recorded, replayed, first)


def runs(cfs: Sequence[float]) -> str:
    """Run-length text of a CF sequence: ``8 x 100, 6 x 10, 6 x dense``."""
    parts = []
    for cf, group in itertools.groupby(cfs):
        parts.append(f"{len(list(group))} x {'dense' if cf == 1.0 else f'{cf:g}'}")
    return ", ".join(parts)


def _setting(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare word: gain=norm


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("csv", nargs="+", type=Path, help="policy CSVs (policy.rank0.csv of a gravac run)")
    parser.add_argument("--set", dest="settings", action="append", type=_setting, default=[], metavar="KEY=VALUE",
                        help="a GravacPolicy setting of the replay (repeatable; default: the defaults, as the "
                             "benchmarks run them)")
    parser.add_argument("--verbose", action="store_true", help="show the policy's decisions (its DEBUG log)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(message)s")
    settings = dict(args.settings)
    try:
        GravacPolicy(**settings)
    except (TypeError, ValueError) as exc:
        parser.error(f"--set: {exc}")
    changed = 0
    for path in args.csv:
        try:
            result = replay(read_rows(path), settings)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        if result.diverges_at is None:
            print(f"{path}: same decisions on all {len(result.recorded)} steps ({runs(result.recorded)})")
            continue
        changed += 1
        at = result.diverges_at
        print(f"{path}: decisions differ from step {at}: recorded {runs(result.recorded[:at + 1])}; "
              f"replayed {runs(result.replayed[:at + 1])}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
