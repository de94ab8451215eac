"""Telemetry of crossover turns: per-worker JSON-lines files, a merged Chrome trace, a summary.

Each worker (:class:`Recorder`) writes a new file ``<dir>/<job>.<member>.<pid>.jsonl``, mode 0600 (created
with ``O_EXCL | O_NOFOLLOW`` relative to the directory opened by :func:`crossover.scheduler.paths.open_dir`:
never an existing file, never through a symbolic link, never in a folder another user could swap; ``.<n>``
is added to the name if that one exists):

* one ``{"type": "meta", "job", "member", "host", "dev", "pid"}`` line first;
* ``{"type": "span", "name", "t0", "t1"}`` for every interval, ``name`` one of ``compute`` (the worker
  holds the device), ``wait_device`` (it asked for the device and waits for its turn) and
  ``wait_comm`` (it gave the device back while it waits on communication); times are wall-clock
  seconds (``time.time()``), so workers on different hosts line up as well as their clocks do;
* ``{"type": "step", "step", "t", "compute", "wait_device", "wait_comm"}`` once per training step
  (seconds spent in each state during the step).

:func:`load` reads a directory of them, :func:`chrome_trace` merges them into one Chrome trace
(``chrome://tracing`` or https://ui.perfetto.dev; one process per job, one thread per worker),
:func:`summarize` computes per-job step figures and per-device busy fraction and overlap, and
:func:`format_summary` prints that as a table.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import stat
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable

from crossover.scheduler import paths

__all__ = ["Recorder", "Stream", "load", "chrome_trace", "summarize", "format_summary", "merge_intervals",
           "intersect_length", "step_figures", "SPAN_NAMES", "NEVER_TOOK_A_TURN"]

log = logging.getLogger(__name__)

SPAN_NAMES = ("compute", "wait_device", "wait_comm")
# a job without telemetry: none of its workers ever held the device (a worker's file is made at its first turn)
NEVER_TOOK_A_TURN = "never took a turn (did it call hvd.init() and train with hvd.DistributedOptimizer?)"
Interval = tuple[float, float]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] or "_"


class Recorder:
    """Writes one worker's telemetry file: lines gathered in memory, appended at every step and on close.

    Only the process that created it writes (a forked child, e.g. a DataLoader worker, does not).
    """

    def __init__(self, directory: str, job: str, member: str, host: str, dev: str) -> None:
        base = f"{_safe(job)}.{_safe(member)}.{os.getpid()}"
        self._pid = os.getpid()
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd: int | None = None
        dfd = paths.open_dir(directory, "telemetry directory", create=True)  # SchedulerDirError if not safe
        try:
            for n in range(100):  # a new file of our own: never one that exists (planted, or an earlier session's)
                name = f"{base}.{n}.jsonl" if n else f"{base}.jsonl"
                self.path = os.path.join(directory, name)
                try:
                    self._fd = os.open(name, flags, 0o600, dir_fd=dfd)
                    break
                except FileExistsError:
                    continue
            else:
                raise FileExistsError(f"telemetry: {base}.jsonl and 99 others exist in {directory}")
        finally:
            os.close(dfd)
        self._lines: list[str] = []
        self._write({"type": "meta", "job": job, "member": member, "host": host, "dev": dev, "pid": os.getpid()})

    def _write(self, rec: dict[str, Any]) -> None:
        if self._fd is not None and os.getpid() == self._pid:
            self._lines.append(json.dumps(rec, separators=(",", ":")) + "\n")

    def span(self, name: str, t0: float, t1: float) -> None:
        """Record that the worker was in state ``name`` from ``t0`` to ``t1``."""
        if t1 > t0:
            self._write({"type": "span", "name": name, "t0": round(t0, 6), "t1": round(t1, 6)})

    def step(self, step: int, t: float, compute: float, wait_device: float, wait_comm: float) -> None:
        """Record one finished step and flush."""
        self._write({"type": "step", "step": step, "t": round(t, 6), "compute": round(compute, 6),
                     "wait_device": round(wait_device, 6), "wait_comm": round(wait_comm, 6)})
        self.flush()

    def flush(self) -> None:
        """Append the gathered lines to the file (one write)."""
        if self._fd is None or not self._lines or os.getpid() != self._pid:
            return
        data, self._lines = "".join(self._lines).encode(), []
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:  # e.g. disk full: telemetry must never stop training
            log.warning("telemetry: cannot write %s: %s; stopping telemetry", self.path, exc)
            self._close_fd()

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Flush and close (in the creating process only)."""
        if os.getpid() == self._pid:
            self.flush()
            self._close_fd()


@dataclass
class Stream:
    """One worker's telemetry."""

    job: str
    member: str
    host: str
    dev: str
    pid: int
    spans: dict[str, list[Interval]] = field(default_factory=lambda: {n: [] for n in SPAN_NAMES})
    steps: list[dict[str, float]] = field(default_factory=list)

    @property
    def device_key(self) -> str:
        return f"{self.host}/{self.dev}"


def _open_plain(path: str, flags: int, dir_fd: int | None = None) -> int:
    """Open a regular file, never through a symbolic link or on a FIFO (raises OSError otherwise)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def load(directory: str, dir_fd: int | None = None) -> list[Stream]:
    """Read every ``*.jsonl`` telemetry file in ``directory`` (or in the open directory ``dir_fd``; then
    ``directory`` only names it in messages). Ignores torn last lines; skips, with a warning, what is not a
    regular file: a symbolic link is never followed."""
    streams = []
    for name in sorted(os.listdir(directory if dir_fd is None else dir_fd)):
        if not name.endswith(".jsonl"):
            continue
        stream: Stream | None = None
        try:
            fd = (_open_plain(os.path.join(directory, name), os.O_RDONLY) if dir_fd is None
                  else _open_plain(name, os.O_RDONLY, dir_fd))
        except OSError as exc:
            log.warning("telemetry: skipping %s: %s", os.path.join(directory, name), exc)
            continue
        with open(fd, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                kind = rec.get("type")
                if kind == "meta":
                    stream = Stream(str(rec["job"]), str(rec["member"]), str(rec["host"]), str(rec["dev"]),
                                    int(rec["pid"]))
                elif stream is None:
                    continue
                elif kind == "span" and rec.get("name") in stream.spans:
                    stream.spans[rec["name"]].append((float(rec["t0"]), float(rec["t1"])))
                elif kind == "step":
                    stream.steps.append(rec)
        if stream is not None:
            streams.append(stream)
    return streams


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted union of intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def intersect_length(x: list[Interval], y: list[Interval]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _length(x: list[Interval]) -> float:
    return sum(b - a for a, b in x)


def chrome_trace(streams: list[Stream]) -> dict[str, Any]:
    """One Chrome trace (JSON object format) of all workers: a process per job, a thread per worker."""
    jobs = sorted({s.job for s in streams})
    t_min = min((a for s in streams for ivs in s.spans.values() for a, _ in ivs), default=0.0)
    events: list[dict[str, Any]] = []
    for pid, job in enumerate(jobs, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"job {job}"}})
        members = sorted((s for s in streams if s.job == job), key=lambda s: (s.member, s.pid))
        for tid, s in enumerate(members, start=1):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": f"{s.member} on {s.device_key}"}})
            for name, ivs in s.spans.items():
                for a, b in ivs:
                    events.append({"ph": "X", "name": name, "cat": "crossover", "pid": pid, "tid": tid,
                                   "ts": round((a - t_min) * 1e6, 1), "dur": round((b - a) * 1e6, 1),
                                   "args": {"device": s.device_key}})
            for st in s.steps:
                events.append({"ph": "i", "s": "t", "name": f"step {st['step']}", "pid": pid, "tid": tid,
                               "ts": round((st["t"] - t_min) * 1e6, 1)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"t0_unix": t_min, "source": "crossover scheduler telemetry"}}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize(streams: list[Stream], expected: Iterable[str] | None = None) -> dict[str, Any]:
    """Per-job step figures and per-device busy fraction, overlap and compute collisions. With ``expected`` (the
    names of the jobs that ran), ``never_took_a_turn`` lists those without any telemetry: no worker of theirs ever
    took the device (see :data:`NEVER_TOOK_A_TURN`)."""
    jobs: dict[str, Any] = {}
    for job in sorted({s.job for s in streams}):
        members = [s for s in streams if s.job == job]
        steps = [st for s in members for st in s.steps]
        n_steps = max((len(s.steps) for s in members), default=0)
        ref = max(members, key=lambda s: len(s.steps))
        times = [st["t"] for st in ref.steps]
        period = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0.0
        jobs[job] = {
            "workers": len(members), "steps": n_steps, "step_s": period,
            "steps_per_s": 1.0 / period if period > 0 else 0.0,
            "compute_s": _mean([st["compute"] for st in steps]),
            "wait_device_s": _mean([st["wait_device"] for st in steps]),
            "wait_comm_s": _mean([st["wait_comm"] for st in steps]),
        }
    devices: dict[str, Any] = {}
    for key in sorted({s.device_key for s in streams}):
        on_dev = [s for s in streams if s.device_key == key]
        all_ivs = [iv for s in on_dev for ivs in s.spans.values() for iv in ivs]
        if not all_ivs:
            continue
        span = max(b for _, b in all_ivs) - min(a for a, _ in all_ivs)
        compute_by_job = {j: merge_intervals(iv for s in on_dev if s.job == j for iv in s.spans["compute"])
                          for j in sorted({s.job for s in on_dev})}
        busy = _length(merge_intervals(iv for ivs in compute_by_job.values() for iv in ivs))
        comm_total = hidden = 0.0
        for j in compute_by_job:
            comm = merge_intervals(iv for s in on_dev if s.job == j for iv in s.spans["wait_comm"])
            others = merge_intervals(iv for k, ivs in compute_by_job.items() if k != j for iv in ivs)
            comm_total += _length(comm)
            hidden += intersect_length(comm, others)
        names = list(compute_by_job)
        collide = sum(intersect_length(compute_by_job[a], compute_by_job[b])
                      for i, a in enumerate(names) for b in names[i + 1:])
        devices[key] = {"jobs": names, "span_s": span, "busy_s": busy,
                        "busy_fraction": busy / span if span > 0 else 0.0,
                        "comm_wait_s": comm_total, "comm_hidden_s": hidden,
                        "overlap": hidden / comm_total if comm_total > 0 else 0.0,
                        "compute_collision_s": collide}
    summary: dict[str, Any] = {"jobs": jobs, "devices": devices}
    if expected is not None:
        summary["never_took_a_turn"] = [j for j in expected if j not in jobs]
    return summary


def _clip(ivs: list[Interval], ends: list[float], lo: float, hi: float) -> list[Interval]:
    """The parts of the merged, sorted intervals ``ivs`` (``ends``: their ends) inside ``[lo, hi]``."""
    out = []
    for a, b in ivs[bisect.bisect_right(ends, lo):]:
        if a >= hi:
            break
        if b > lo:
            out.append((max(a, lo), min(b, hi)))
    return out


def step_figures(streams: list[Stream]) -> dict[str, list[dict[str, float]]]:
    """Per job and step (from the job's worker with the most steps, on its device): ``step``, ``t`` (its end),
    ``step_s``, ``compute_s``, ``wait_for_turn_s``, ``comm_wait_s``, ``busy`` (share of the step during which
    some job computed on the device) and ``overlap`` (share of the job's communication wait in the step
    during which another job computed on the device; 0 without a wait)."""
    out: dict[str, list[dict[str, float]]] = {}
    for job in sorted({s.job for s in streams}):
        ref = max((s for s in streams if s.job == job), key=lambda s: (len(s.steps), s.member))
        on_dev = [s for s in streams if s.device_key == ref.device_key]
        busy = merge_intervals(iv for s in on_dev for iv in s.spans["compute"])
        others = merge_intervals(iv for s in on_dev if s.job != job for iv in s.spans["compute"])
        comm = merge_intervals(ref.spans["wait_comm"])
        ends = {id(x): [b for _, b in x] for x in (busy, others, comm)}
        first = min((a for ivs in ref.spans.values() for a, _ in ivs), default=None)
        rows = []
        prev = first
        for st in ref.steps:
            t = float(st["t"])
            lo = t - (st["compute"] + st["wait_device"] + st["wait_comm"]) if prev is None else prev
            prev = t
            length = t - lo
            if length <= 0:
                continue
            waits = _clip(comm, ends[id(comm)], lo, t)
            wait_len = _length(waits)
            rows.append({"step": int(st["step"]), "t": t, "step_s": length, "compute_s": float(st["compute"]),
                         "wait_for_turn_s": float(st["wait_device"]), "comm_wait_s": float(st["wait_comm"]),
                         "busy": min(1.0, _length(_clip(busy, ends[id(busy)], lo, t)) / length),
                         "overlap": (intersect_length(waits, _clip(others, ends[id(others)], lo, t)) / wait_len
                                     if wait_len > 0 else 0.0)})
        out[job] = rows
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as two small text tables."""
    lines = ["job            workers  steps  step ms  steps/s  compute ms  wait device ms  wait comm ms",
             "(step ms: median; steps/s: its inverse; the other columns: mean per step)"]
    for job, j in summary["jobs"].items():
        lines.append(f"{job[:14]:<14} {j['workers']:>7}  {j['steps']:>5}  {j['step_s'] * 1e3:>7.1f}  "
                     f"{j['steps_per_s']:>7.2f}  {j['compute_s'] * 1e3:>10.1f}  {j['wait_device_s'] * 1e3:>14.1f}  "
                     f"{j['wait_comm_s'] * 1e3:>12.1f}")
    for job in summary.get("never_took_a_turn", []):
        lines.append(f"{job[:14]:<14} {NEVER_TOOK_A_TURN}")
    lines.append("")
    lines.append("device                          jobs  busy   overlap  compute collisions ms")
    for key, d in summary["devices"].items():
        lines.append(f"{key[:31]:<31} {len(d['jobs']):>4}  {100 * d['busy_fraction']:>4.0f}%  "
                     f"{100 * d['overlap']:>6.0f}%  {d['compute_collision_s'] * 1e3:>20.1f}")
    lines.append("busy: share of the time the device computed for some job; overlap: share of the jobs' "
                 "communication waits during which another job computed on the device.")
    return "\n".join(lines)
