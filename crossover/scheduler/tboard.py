"""``crossover-run --tensorboard DIR``: the turns as TensorBoard scalars, one run (sub-directory) per job.

Written from the workers' telemetry once the jobs have ended (:func:`crossover.scheduler.telemetry.step_figures`),
per step: ``crossover/busy`` (share of the step during which some job computed on the device),
``crossover/overlap`` (share of the job's communication wait during which another job computed),
``crossover/wait_for_turn_s``, ``crossover/compute_s``, ``crossover/comm_wait_s`` and ``crossover/step_s``.
The event files are TensorBoard's own record format (its ``RecordWriter`` and protocol buffers), written
to a new file (``O_EXCL | O_NOFOLLOW``, 0600) in a folder opened at start
(:class:`~crossover.scheduler.outputs.OutputDir`).
tensorboard is imported only here, when ``--tensorboard`` is given.
"""

from __future__ import annotations

import os
import re
import socket
import time
from typing import Iterable

from crossover.scheduler import paths, telemetry
from crossover.scheduler.outputs import OutputDir

__all__ = ["write_scalars", "check_runs", "PREFIX", "TAGS"]

PREFIX = "crossover/"
TAGS = ("busy", "overlap", "wait_for_turn_s", "compute_s", "comm_wait_s", "step_s")


def _safe(name: str) -> str:
    """``name`` as one plain folder or file name: other characters become ``_``, and a name that starts with
    ``.`` or ``-`` (``.``, ``..``, a hidden folder, an option) gets a ``_`` in front. crossover-run refuses such
    job names; the telemetry it reads them from was written by the jobs, so they are not trusted here."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80]
    return safe if safe[:1] not in ("", ".", "-") else "_" + safe[:79]


def check_runs(out: OutputDir, jobs: Iterable[str]) -> None:
    """Refuse, before any job starts, a run folder ``out/<job>`` that :func:`write_scalars` could not use (a
    symbolic link, a file, a folder not ours); :class:`~crossover.scheduler.paths.SchedulerDirError`."""
    for job in jobs:
        out.check_subdir(_safe(job))


def write_scalars(out: OutputDir, streams: list[telemetry.Stream]) -> list[str]:
    """Write one event file per job under ``out/<job>/``; returns the files written."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    files = []
    for job, rows in telemetry.step_figures(streams).items():
        dir_fd = out.subdir(_safe(job))
        try:
            name = f"events.out.tfevents.{int(time.time()):010d}.{_safe(socket.gethostname())}.{os.getpid()}.crossover"
            shown = os.path.join(out.path, _safe(job), name)
            fd = paths.open_own_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd, shown=shown)
        finally:
            os.close(dir_fd)
        writer = RecordWriter(open(fd, "wb"))
        try:
            writer.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
            for row in rows:
                values = [summary_pb2.Summary.Value(tag=PREFIX + tag, simple_value=float(row[tag])) for tag in TAGS]
                event = event_pb2.Event(wall_time=row["t"], step=int(row["step"]),
                                        summary=summary_pb2.Summary(value=values))
                writer.write(event.SerializeToString())
        finally:
            writer.close()
        files.append(shown)
    return files
