"""``crossover-run``: launch several Horovod jobs that take turns on the devices they share.

    crossover-run job1.py job2.py
    crossover-run -np 2 -H host1:1,host2:1 job1.py --lr 0.1 -- job2.py --epochs 5

Horovod's options come once, before the first job, and apply to every job (the command line and the
jobs it names: :mod:`crossover.scheduler.plan`). Each job is launched by its own ``horovodrun`` (so each
gets its own rendezvous port) as ``python -m horovod_ext.launch SCRIPT ARGS`` with ``CROSSOVER_SCHED=1``
and its job name in the environment; on every host the first worker starts the scheduler daemon. Output
lines are prefixed with ``[name]``, and a progress line per job (steps, turns, rate, from the workers'
telemetry) is redrawn on a terminal or printed every ``--progress-every`` seconds elsewhere. At the end it
writes a Chrome-trace timeline of all jobs, prints a summary (per-job step time split into compute /
waiting for the device / waiting for communication, per-device busy fraction and overlap), and on request
a PNG of the turns (``--plot``) and TensorBoard scalars (``--tensorboard``). With ``--telemetry-dir DIR``
every run gets its own new sub-directory ``DIR/run-<date>-<time>-<pid>``; without it a temporary folder
is used and removed at exit. Every folder written to, and every report file or TensorBoard run folder that
already exists, is opened and checked before any job starts (:mod:`crossover.scheduler.outputs`); a job that
never took a turn is named in the summary, and one rank per job is said to leave nothing to overlap. See
docs/scheduler.md.

Exit status: 0 when every job succeeded; otherwise the first failed job's exit status (1 if it died
from a signal); 2 for a bad command line; 130 after Ctrl-C (every job is stopped).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Sequence

from crossover import procgroup
from crossover.scheduler import outputs, paths, telemetry
from crossover.scheduler.plan import Job, UsageError, build_parser, plan_jobs
from crossover.scheduler.progress import Console, JobProgress, TelemetryTail, format_jobs

__all__ = ["main", "build_parser", "Job", "plan_jobs", "UsageError"]

TTY_REDRAW_S = 0.5  # the terminal's progress line: redrawn twice a second
SINGLE_RANK_NOTE = ("one rank per job: nothing to overlap, since a single-rank job has no allreduce to wait on (the "
                    "jobs only take turns computing; overlap stays 0 %); give each job several ranks to hide one "
                    "job's communication behind another's compute, e.g. -np 2")
SINGLE_RANK_FOOTNOTE = "(one rank per job: no allreduce wait to hide, hence overlap 0 %; try -np 2)"


def _pump(job: Job, stream: IO[bytes], console: Console) -> None:
    prefix = f"[{job.name}] "
    for raw in iter(stream.readline, b""):
        console.line(prefix + raw.decode("utf-8", "replace").rstrip("\n"))
    stream.close()


def _stop(jobs: list[Job], grace: float) -> None:
    """SIGTERM every running job's horovodrun group (it stops its ranks), SIGKILL what is left after ``grace``."""
    procgroup.terminate_all([j.proc for j in jobs if j.proc is not None and j.proc.poll() is None], grace)


class _Terminated(Exception):
    """SIGTERM received: stop the jobs like Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def _on_sigint(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class _Progress:
    """The progress line(s): job states from the processes, steps and turns from the telemetry."""

    def __init__(self, jobs: list[Job], console: Console, tail: TelemetryTail | None, every: float) -> None:
        self.jobs = jobs
        self.console = console
        self.tail = tail
        self.every = TTY_REDRAW_S if console.tty else every
        self.started = time.monotonic()
        self._next = self.started + (TTY_REDRAW_S if console.tty else every)

    def tick(self, now: float, force: bool = False) -> None:
        if now < self._next and not force:
            return
        self._next = now + self.every
        seen = self.tail.poll() if self.tail is not None else {}
        states: dict[str, str | JobProgress] = {}
        for j in self.jobs:
            got = seen.get(j.name)
            if j.returncode is not None:
                states[j.name] = f"exited {j.returncode}" + (f" after {got.steps} steps" if got else "")
            elif got is not None:
                states[j.name] = got
            else:
                states[j.name] = "starting" if self.tail is not None else "running"
        elapsed = f"{now - self.started:.0f} s"
        if self.console.tty:
            self.console.status(f"[{elapsed}] {format_jobs(states)}")
        else:
            self.console.status(f"crossover-run: progress at {elapsed}: {format_jobs(states)}")


def _run(jobs: list[Job], fail_fast: bool, grace: float, progress: _Progress | None, console: Console) -> int | None:
    """Start all jobs, relay output, wait. Returns None normally, or the exit status after an interrupt."""
    pumps = []
    try:
        for j in jobs:
            j.started = time.monotonic()
            j.proc = procgroup.start(j.argv, env=j.full_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
            assert j.proc.stdout is not None
            t = threading.Thread(target=_pump, args=(j, j.proc.stdout, console), daemon=True)
            t.start()
            pumps.append(t)
        while True:
            alive = False
            for j in jobs:
                assert j.proc is not None
                if j.returncode is None:
                    code = j.proc.poll()
                    if code is None:
                        alive = True
                        continue
                    j.returncode, j.ended = code, time.monotonic()
                    console.line(f"crossover-run: {j.name} exited with {code} after {j.ended - j.started:.1f} s")
                    if code != 0 and fail_fast:
                        console.line("crossover-run: --fail-fast: stopping the other jobs")
                        _stop(jobs, grace)
            if not alive:
                break
            if progress is not None:
                progress.tick(time.monotonic())
            time.sleep(0.05)
    except (KeyboardInterrupt, _Terminated) as exc:
        console.clear()
        sys.stderr.write("crossover-run: interrupted; stopping every job\n")
        _stop(jobs, grace)
        return 130 if isinstance(exc, KeyboardInterrupt) else 143
    finally:
        for j in jobs:
            if j.proc is not None and j.returncode is None and j.proc.poll() is not None:
                j.returncode = j.proc.returncode
                j.ended = time.monotonic()
        for t in pumps:
            t.join(timeout=2.0)
    if progress is not None and not console.tty:
        progress.tick(time.monotonic(), force=True)  # the last figures, once
    console.clear()
    return None


class _Outputs:
    """Every place the run writes to, opened (and checked: folders, existing files, the TensorBoard run folders
    of ``jobs``) before any job starts; closed at exit."""

    def __init__(self, args: argparse.Namespace, jobs: list[str]) -> None:
        self.run_dir: outputs.RunDir | None = None
        self.timeline: outputs.OutputFile | None = None
        self.plot: outputs.OutputFile | None = None
        self.tensorboard: outputs.OutputDir | None = None
        try:
            if args.timeline:
                self.timeline = outputs.OutputFile(args.timeline, "--timeline")
            if args.plot:
                self.plot = outputs.OutputFile(args.plot, "--plot")
            if self.timeline is not None and self.plot is not None and self.plot.same_file(self.timeline):
                raise paths.SchedulerDirError(f"--plot and --timeline name the same file {self.plot.path}")
            if args.tensorboard:
                from crossover.scheduler import tboard

                self.tensorboard = outputs.OutputDir(args.tensorboard, "--tensorboard")
                tboard.check_runs(self.tensorboard, jobs)
            self.run_dir = outputs.RunDir.new(args.telemetry_dir)  # last: nothing to clean up after a refusal
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for out in (self.timeline, self.plot, self.tensorboard):
            if out is not None:
                out.close()
        if self.run_dir is not None:
            self.run_dir.remove()  # a temporary folder only; --telemetry-dir's run directory stays
            self.run_dir.close()


def _write_output(what: str, write: Callable[[], str | None], wrote: list[str]) -> None:
    """Write one report output and note the line that says where (if any); a failure is said, and the other
    outputs are still written (a plot that cannot be drawn must not cost the TensorBoard scalars)."""
    try:
        line = write()
    except Exception as exc:  # noqa: BLE001 - one output's failure (OSError, a plotting error) must not lose the rest
        sys.stdout.write(f"crossover-run: could not write the {what}: {exc}\n")
        return
    if line:
        wrote.append(line)


def _report(args: argparse.Namespace, out: _Outputs, names: list[str]) -> None:
    """The report of the jobs ``names`` from their telemetry: timeline, summary, plot, TensorBoard scalars."""
    run_dir = out.run_dir
    assert run_dir is not None
    streams = telemetry.load(run_dir.path, dir_fd=run_dir.fd)
    if not streams:
        sys.stdout.write(f"crossover-run: no telemetry in {run_dir.path}: no job took a turn\n")
        for name in names:
            sys.stdout.write(f"crossover-run: {name} {telemetry.NEVER_TOOK_A_TURN}\n")
        return
    trace = json.dumps(telemetry.chrome_trace(streams)).encode()
    summary = telemetry.summarize(streams, names)
    wrote: list[str] = []
    _write_output("timeline", lambda: _write_timeline(out, trace), wrote)
    if not run_dir.temporary:
        _write_output("summary", lambda: _write_run_file(run_dir, "summary.json", json.dumps(summary, indent=1)),
                      wrote)
    if not args.no_summary:
        sys.stdout.write("\n" + telemetry.format_summary(summary) + "\n")
        if args.np == 1:
            sys.stdout.write(f"{SINGLE_RANK_FOOTNOTE}\n")
    plot_file, tb_dir = out.plot, out.tensorboard
    if plot_file is not None:
        _write_output("turns plot", lambda: _write_plot(plot_file, streams), wrote)
    if tb_dir is not None:
        _write_output("TensorBoard scalars", lambda: _write_tensorboard(tb_dir, streams), wrote)
    if run_dir.temporary:
        wrote.append("telemetry removed at exit (--telemetry-dir DIR keeps it)")
    for line in wrote:
        sys.stdout.write(f"crossover-run: {line}\n")


def _write_timeline(out: _Outputs, trace: bytes) -> str | None:
    """The Chrome trace to ``--timeline``, else into a kept run directory (a temporary one: nowhere)."""
    if out.timeline is not None:
        out.timeline.write(trace)
        return f"timeline (Chrome trace) {out.timeline.path}"
    assert out.run_dir is not None
    if out.run_dir.temporary:
        return None
    return f"timeline (Chrome trace) {out.run_dir.write('timeline.json', trace)}"


def _write_run_file(run_dir: outputs.RunDir, name: str, text: str) -> None:
    run_dir.write(name, text.encode())


def _write_plot(target: outputs.OutputFile, streams: list[telemetry.Stream]) -> str:
    from crossover.scheduler import plot

    with target.open() as f:
        plot.plot_timeline(streams, f)
    return f"turns plot {target.path}"


def _write_tensorboard(target: outputs.OutputDir, streams: list[telemetry.Stream]) -> str:
    from crossover.scheduler import tboard

    tboard.write_scalars(target, streams)
    return f"TensorBoard scalars in {target.path} (tensorboard --logdir {target.path})"


def _check_extras(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--plot and --tensorboard need their package, and the scheduler's telemetry: say so before any job starts."""
    for opt, value, module, pkg in (("--plot", args.plot, "matplotlib", "matplotlib"),
                                    ("--tensorboard", args.tensorboard, "tensorboard", "tensorboard")):
        if value is None:
            continue
        if args.no_crossover:
            parser.error(f"{opt} draws from the scheduler's telemetry, which --no-crossover does not record")
        if importlib.util.find_spec(module) is None:
            parser.error(f"{opt} needs the {pkg} package: pip install {pkg}")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of ``crossover-run``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, jobs = plan_jobs(argv, parser)
    _check_extras(args, parser)
    crossover = not args.no_crossover
    if args.np_reason != "given":
        sys.stderr.write(f"crossover-run: -np not given: {args.np_reason}; pass -np N to choose\n")
    if args.dry_run:
        telemetry_dir = (os.path.join(os.path.abspath(args.telemetry_dir), "run-DATE-TIME-PID")
                         if args.telemetry_dir else "<temporary folder>")
        for j in jobs:
            if crossover:
                j.env["CROSSOVER_TELEMETRY_DIR"] = telemetry_dir
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(j.env.items()))
            sys.stdout.write(f"{j.name}: {env} {shlex.join(j.argv)}\n")
        return 0
    out: _Outputs | None = None
    if crossover:
        try:  # every folder written to is opened (and checked) now, before any job starts
            out = _Outputs(args, [j.name for j in jobs])
        except paths.SchedulerDirError as exc:
            parser.error(str(exc))
        assert out.run_dir is not None
        for j in jobs:
            j.env["CROSSOVER_TELEMETRY_DIR"] = out.run_dir.path
        sys.stdout.write(f"crossover-run: {len(jobs)} jobs ({', '.join(j.name for j in jobs)}), {args.np} rank(s) "
                         f"each; telemetry in {out.run_dir.path}\n")
        sys.stdout.flush()
        if args.np == 1:
            sys.stderr.write(f"crossover-run: note: {SINGLE_RANK_NOTE}\n")
    try:
        return _run_and_report(args, jobs, out)
    finally:
        if out is not None:
            out.close()


def _run_and_report(args: argparse.Namespace, jobs: list[Job], out: _Outputs | None) -> int:
    """Run the jobs, then report from their telemetry; the exit status."""
    console = Console(sys.stdout, sys.stdout.isatty())
    tail = TelemetryTail(out.run_dir.fd) if out is not None and out.run_dir is not None else None
    progress = None if args.no_progress else _Progress(jobs, console, tail, args.progress_every)
    # Explicit handlers: a process started in the background by a non-interactive shell inherits SIGINT
    # ignored, and Python then never raises KeyboardInterrupt; `kill -INT` must still stop every job.
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    old_int = signal.signal(signal.SIGINT, _on_sigint)
    try:
        interrupted = _run(jobs, args.fail_fast, args.grace, progress, console)
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
        if tail is not None:
            tail.close()
    if interrupted is not None:
        return interrupted
    if out is not None:
        try:
            _report(args, out, [j.name for j in jobs])
        except (OSError, ValueError, KeyError, paths.SchedulerDirError) as exc:
            sys.stdout.write(f"crossover-run: could not summarize telemetry: {exc}\n")
    codes = {j.name: j.returncode for j in jobs}
    failed = [c for c in codes.values() if c]
    sys.stdout.write("crossover-run: exit codes " + ", ".join(f"{k}={v}" for k, v in codes.items()) + "\n")
    if not failed:
        return 0
    first = failed[0]
    return first if first is not None and 0 < first < 126 else 1

if __name__ == "__main__":
    sys.exit(main())
