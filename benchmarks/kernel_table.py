"""The printed table and the JSON file of the kernel micro-benchmarks (bench_compressors, bench_quantize, bench_gpu).

Each of those times operations as multiples of a read pass and keeps one dict per row with at least ``name``,
``ratio`` (the row's median over the read pass) and ``target`` (None, or the largest ratio that passes); this
module holds what they print and write alike: the header, the summary line of the read passes, the check column,
the table of the rows, the verdict line and the JSON file, and the one call that makes several operations in
turn.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["calls", "check_cell", "print_header", "print_read_pass", "print_table", "verdict", "write_json"]


def print_header(*lines: str) -> None:
    """Print the command line of the run, then ``lines`` (its machine, its sizes)."""
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print("\n".join(lines))


def calls(*fns: Callable[[], object]) -> Callable[[], None]:
    """One call that makes each of ``fns`` in turn (a compress, then its decompress)."""
    def run() -> None:
        for fn in fns:
            fn()
    return run


def print_read_pass(read_ms: Sequence[float], note: str = "") -> float:
    """Print the median of the rows' read passes and their range; return the median (ms)."""
    med = statistics.median(read_ms)
    print(f"\nread pass g.sum(): median {med:.2f} ms over the rows (per-row medians from {min(read_ms):.2f} to "
          f"{max(read_ms):.2f} ms); each ratio below divides the row's median by the median of the read passes "
          f"interleaved with it{note}\n")
    return med


def check_cell(row: dict[str, Any]) -> str:
    """The check column of a row: PASS or FAIL against its target (recorded as ``row["pass"]`` unless the
    benchmark set it already), then its note."""
    check = ""
    if row["target"] is not None:
        if "pass" not in row:
            row["pass"] = row["ratio"] <= row["target"]
        check = f"{'PASS' if row['pass'] else 'FAIL'} (<= {row['target']:g}x)"
    if row.get("note"):
        check = f"{check}  {row['note']}".strip()
    return check


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]], rule: int) -> None:
    """Print the rows: the name, each (heading, key, format) column, then the check column; under the headings a
    rule ``rule`` dashes longer than the longest name."""
    w = max(len(r["name"]) for r in rows)
    print(f"{'operation':<{w}}" + "".join(f"  {h:>{int(fmt.split('.')[0])}}" for h, _, fmt in columns) + "  check")
    print("-" * (w + rule))
    for r in rows:
        print(f"{r['name']:<{w}}" + "".join(f"  {r[key]:{fmt}}" for _, key, fmt in columns) + f"  {check_cell(r)}")


def verdict(what: str, failed: Sequence[str], any_target: bool) -> bool:
    """Print the closing line of the targets in ``what``; True when there were targets and none failed."""
    ok = any_target and not failed
    print(f"\ntargets ({what}): {'PASS' if ok else 'FAIL'}" + ("" if not failed else f"; missed: {'; '.join(failed)}"))
    return ok


def write_json(path: str | None, out: dict[str, Any]) -> None:
    """Write the run's JSON file when ``--json`` named one."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path}")
