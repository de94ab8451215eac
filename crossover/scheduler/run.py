"""``crossover-run``: launch several Horovod jobs that take turns on the devices they share.

    crossover-run -np 2 -H host1:1,host2:1 job1.py --lr 0.1 -- job2.py --epochs 5

Horovod's options come once, before the first job, and apply to every job; jobs are separated by
``--``. Each job is launched by its own ``horovodrun`` (so each gets its own rendezvous port) as
``python -m horovod_ext.launch SCRIPT ARGS`` with ``CROSSOVER_SCHED=1`` and its job name in
the environment; on every host the first worker starts the scheduler daemon. Output lines are
prefixed with ``[jobN]``. At the end it writes a Chrome-trace timeline of all jobs and prints a
summary (per-job step time split into compute / waiting for the device / waiting for communication,
per-device busy fraction and overlap). With ``--telemetry-dir DIR`` every run gets its own new
sub-directory ``DIR/run-<date>-<time>-<pid>`` (two runs sharing ``DIR`` never mix); ``DIR`` and its
ancestors must belong to this user or root and not be writable by others unless sticky (as ``/tmp``),
and the reports are never written through a symbolic link. See docs/scheduler.md.

Exit status: 0 when every job succeeded; otherwise the first failed job's exit status (1 if it died
from a signal); 2 for a bad command line; 130 after Ctrl-C (every job is stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Sequence

from crossover import procgroup
from crossover.scheduler import outputs, paths, settings, telemetry

__all__ = ["main", "build_parser", "Job", "plan_jobs"]

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PYTHON_RE = re.compile(r"^python[0-9.]*$")

EPILOG = """\
jobs:
  A job is SCRIPT [ARGS...] or -m MODULE [ARGS...] (optionally preceded by a python interpreter);
  separate jobs with --. Every job is an ordinary Horovod script; with the stock
  hvd.DistributedOptimizer it takes turns on the device with no code change (custom loops:
  `with horovod_ext.scheduling.crossover_turn(): ...`).

examples:
  crossover-run -np 2 -H host1:1,host2:1 job1.py --lr 0.1 -- job2.py --epochs 5
  crossover-run -np 2 -H localhost:2 --gloo train.py -- train.py --seed 1
  crossover-run --dry-run -np 4 --hostfile hosts.txt a.py -- b.py -- c.py
  crossover-run --no-crossover -np 2 a.py -- b.py      # same jobs at once, no scheduler (baseline)

environment of every rank (set by crossover-run):
  CROSSOVER_SCHED=1, CROSSOVER_JOB=jobN, CROSSOVER_JOB_WEIGHT, CROSSOVER_TELEMETRY_DIR and, when
  given, CROSSOVER_LEASE_S, CROSSOVER_ALIGN_MS, CROSSOVER_DEVICE, CROSSOVER_SCHED_DIR.
"""


class UsageError(Exception):
    """A command line that cannot be run (reported like argparse errors, exit status 2)."""


@dataclass
class Job:
    """One job: its name, the user's command, and what crossover-run will execute."""

    name: str
    user_cmd: list[str]
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # variables added to the environment
    proc: subprocess.Popen[bytes] | None = None
    returncode: int | None = None
    started: float = 0.0
    ended: float = 0.0


def build_parser() -> argparse.ArgumentParser:
    """The ``crossover-run`` argument parser (for the part before the first ``--``)."""
    p = argparse.ArgumentParser(
        prog="crossover-run",
        usage="crossover-run [options] -np N [horovodrun options] JOB [ARGS...] [-- JOB [ARGS...] ...]",
        description="Run several Horovod jobs at once; on every host the workers of different jobs that share "
                    "a device take turns on it: while one job waits on its gradient allreduce, another "
                    "computes (crossover scheduling).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    h = p.add_argument_group("horovodrun options (given once, passed to every job's horovodrun)")
    h.add_argument("-np", "--num-proc", dest="np", type=_int_in(1, 1 << 20), required=True, help="ranks per job")
    h.add_argument("-H", "--hosts", help="host1:slots,host2:slots (as horovodrun)")
    h.add_argument("--hostfile", "-hostfile", dest="hostfile", help="host file (as horovodrun)")
    ctl = h.add_mutually_exclusive_group()
    ctl.add_argument("--gloo", action="store_true", help="use the Gloo controller")
    ctl.add_argument("--mpi", action="store_true", help="use MPI")
    h.add_argument("--network-interfaces", "--network-interface", dest="network_interfaces",
                   help="network interfaces to use (as horovodrun)")
    h.add_argument("-p", "--ssh-port", type=_int_in(1, 65535), help="ssh port of the remote hosts")
    h.add_argument("-i", "--ssh-identity-file", help="ssh identity file")
    h.add_argument("--start-timeout", type=_int_in(1, 86400), help="seconds to wait for all ranks to start")
    h.add_argument("--disable-cache", action="store_true", help="do not cache horovodrun's host checks")
    h.add_argument("--tcp", action="store_true", help="TCP only (as horovodrun)")
    h.add_argument("--log-level", help="Horovod log level (TRACE, DEBUG, INFO, WARNING, ERROR, FATAL)")
    h.add_argument("--cycle-time-ms", type=settings.CYCLE_TIME_MS.arg_type(),
                   help="Horovod cycle time; on CPU devices 5 keeps idle ranks from using half a core each")
    h.add_argument("--verbose", action="store_true", help="verbose horovodrun output")
    h.add_argument("--horovodrun-arg", action="append", default=[], metavar="ARG",
                   help="any other horovodrun argument, passed as is (repeat for several)")
    x = p.add_argument_group("crossover options")
    x.add_argument("--no-crossover", action="store_true",
                   help="run the jobs at the same time without the scheduler (baseline)")
    x.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    x.add_argument("--fail-fast", action="store_true", help="stop every job as soon as one fails")
    x.add_argument("--names", help="comma-separated job names (default job0,job1,...); the same on every host")
    x.add_argument("--weights", help="comma-separated job weights (default 1 each): a job of weight 2 gets "
                                     "two turns per turn of a weight-1 job when they compete")
    x.add_argument("--lease", type=settings.LEASE_S.arg_type(),
                   help="seconds a waiting job waits at most for a turn to end (daemon default 10; "
                        f"{settings.LEASE_S.range_text()})")
    x.add_argument("--align-ms", type=settings.ALIGN_MS.arg_type(),
                   help=f"ms an idle device is held for the job due next (default 2; {settings.ALIGN_MS.range_text()})")
    x.add_argument("--device", help="device id for every rank (default: CUDA device, cpuN if pinned, else cpu)")
    x.add_argument("--sched-dir", help="scheduler directory on every host ({host}, {uid} are expanded)")
    x.add_argument("--telemetry-dir", help="telemetry goes to a new sub-directory run-DATE-TIME-PID of this folder "
                                          "(default: a new temporary folder)")
    x.add_argument("--timeline", help="write the merged Chrome trace here (default: TELEMETRY_DIR/timeline.json)")
    x.add_argument("--no-summary", action="store_true", help="do not print the telemetry summary")
    x.add_argument("--grace", type=settings.GRACE_S.arg_type(), default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping jobs (default %(default)s)")
    x.add_argument("--python", default=sys.executable, help="interpreter for the jobs (default: %(default)s)")
    x.add_argument("--horovodrun", default=None, help="horovodrun executable (default: next to --python)")
    p.add_argument("job", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[lo, hi]``."""
    return lambda text: int(settings.Setting("", lo, hi, integer=True).arg_type()(text))


def _split(argv: Sequence[str]) -> list[list[str]]:
    segments: list[list[str]] = [[]]
    for tok in argv:
        if tok == "--":
            segments.append([])
        else:
            segments[-1].append(tok)
    return segments


def _horovodrun_args(a: argparse.Namespace) -> list[str]:
    out = ["-np", str(a.np)]
    for flag, value in (("-H", a.hosts), ("--hostfile", a.hostfile), ("--network-interfaces", a.network_interfaces),
                        ("-p", a.ssh_port), ("-i", a.ssh_identity_file), ("--start-timeout", a.start_timeout),
                        ("--log-level", a.log_level), ("--cycle-time-ms", a.cycle_time_ms)):
        if value is not None:
            out += [flag, str(value)]
    for flag, on in (("--gloo", a.gloo), ("--mpi", a.mpi), ("--disable-cache", a.disable_cache),
                     ("--tcp", a.tcp), ("--verbose", a.verbose)):
        if on:
            out.append(flag)
    return out + list(a.horovodrun_arg)


def _job_command(tokens: list[str], index: int, python: str, crossover: bool) -> list[str]:
    """The interpreter command for one job, checked; raises :class:`UsageError`."""
    if not tokens:
        raise UsageError(f"job {index} is empty (two -- in a row?)")
    if _PYTHON_RE.match(os.path.basename(tokens[0])):
        python, tokens = tokens[0], tokens[1:]
        if not tokens:
            raise UsageError(f"job {index}: interpreter without a script")
    wrapper = ["-m", "horovod_ext.launch"] if crossover else []
    if tokens[0] == "-m":
        if len(tokens) < 2 or tokens[1].startswith("-"):
            raise UsageError(f"job {index}: -m needs a module name")
        return [python, *wrapper, *tokens]
    if tokens[0].startswith("-"):
        raise UsageError(f"unrecognized option {tokens[0]!r} (job {index} must start with a script or -m MODULE; "
                         "crossover-run and horovodrun options go before the first job)")
    if not os.path.isfile(tokens[0]):
        raise UsageError(f"job {index}: no such script: {tokens[0]}")
    return [python, *wrapper, *tokens]


def _weights(text: str | None, n: int) -> list[float]:
    if text is None:
        return [1.0] * n
    parts = text.split(",")
    if len(parts) != n:
        raise UsageError(f"--weights: need {n} comma-separated numbers (one per job), got {text!r}")
    try:
        return [settings.WEIGHT.parse(x, "--weights") for x in parts]
    except settings.SettingError as exc:
        raise UsageError(str(exc)) from None


def plan_jobs(argv: Sequence[str], parser: argparse.ArgumentParser | None = None
              ) -> tuple[argparse.Namespace, list[Job]]:
    """Parse a command line into options and jobs (commands and environments). Usage errors exit 2."""
    parser = parser or build_parser()
    segments = _split(argv)
    args = parser.parse_args(segments[0])
    job_tokens = ([args.job] if args.job else []) + segments[1:]
    try:
        if not job_tokens:
            raise UsageError("no job given (put a script after the options)")
        if args.np < 1:
            raise UsageError("-np must be at least 1")
        n = len(job_tokens)
        names = args.names.split(",") if args.names else [f"job{i}" for i in range(n)]
        if len(names) != n or len(set(names)) != n or not all(re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", x) for x in names):
            raise UsageError(f"--names: need {n} distinct names of letters, digits, _ . -")
        weights = _weights(args.weights, n)
        crossover = not args.no_crossover
        horovodrun = args.horovodrun or _default_horovodrun(args.python)
        hvd_args = _horovodrun_args(args)
        jobs = []
        for i, (tokens, name, weight) in enumerate(zip(job_tokens, names, weights)):
            cmd = _job_command(list(tokens), i, args.python, crossover)
            env = {"PYTHONPATH": os.pathsep.join(x for x in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if x)}
            if crossover:
                env.update(CROSSOVER_SCHED="1", CROSSOVER_JOB=name, CROSSOVER_JOB_WEIGHT=f"{weight:g}")
                for var, value in (("CROSSOVER_LEASE_S", args.lease), ("CROSSOVER_ALIGN_MS", args.align_ms),
                                   ("CROSSOVER_DEVICE", args.device), ("CROSSOVER_SCHED_DIR", args.sched_dir)):
                    if value is not None:
                        env[var] = str(value)
            else:
                env["CROSSOVER_SCHED"] = "0"
            try:  # what every rank (and a daemon it starts) reads: refused now, not by each rank later
                settings.check_env({**settings.DAEMON_ENV, **settings.WORKER_ENV}, {**os.environ, **env})
            except settings.SettingError as exc:
                raise UsageError(f"{exc} (environment variable)") from None
            jobs.append(Job(name, list(tokens), [horovodrun, *hvd_args, *cmd], env))
    except UsageError as exc:
        parser.error(str(exc))
    return args, jobs


def _default_horovodrun(python: str) -> str:
    candidate = os.path.join(os.path.dirname(python), "horovodrun")
    return candidate if os.path.exists(candidate) else (shutil.which("horovodrun") or "horovodrun")


def _pump(job: Job, stream: IO[bytes], out: IO[str], lock: threading.Lock) -> None:
    prefix = f"[{job.name}] "
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            out.write(prefix + line + "\n")
            out.flush()
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


def _run(jobs: list[Job], fail_fast: bool, grace: float) -> int | None:
    """Start all jobs, relay output, wait. Returns None normally, or the exit status after an interrupt."""
    lock = threading.Lock()
    pumps = []
    try:
        for j in jobs:
            env = dict(os.environ)
            env.update(j.env)
            j.started = time.monotonic()
            j.proc = procgroup.start(j.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
            assert j.proc.stdout is not None
            t = threading.Thread(target=_pump, args=(j, j.proc.stdout, sys.stdout, lock), daemon=True)
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
                    with lock:
                        sys.stdout.write(f"crossover-run: {j.name} exited with {code} after "
                                         f"{j.ended - j.started:.1f} s\n")
                        sys.stdout.flush()
                    if code != 0 and fail_fast:
                        with lock:
                            sys.stdout.write("crossover-run: --fail-fast: stopping the other jobs\n")
                        _stop(jobs, grace)
            if not alive:
                break
            time.sleep(0.05)
    except (KeyboardInterrupt, _Terminated) as exc:
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
    return None


def _report(args: argparse.Namespace, run_dir: outputs.RunDir, timeline: outputs.OutputFile | None) -> None:
    streams = telemetry.load(run_dir.path, dir_fd=run_dir.fd)
    if not streams:
        sys.stdout.write(f"crossover-run: no telemetry in {run_dir.path}\n")
        return
    trace = json.dumps(telemetry.chrome_trace(streams)).encode()
    if timeline is not None:
        timeline.write(trace)
        timeline_path = timeline.path
    else:
        timeline_path = run_dir.write("timeline.json", trace)
    summary = telemetry.summarize(streams)
    run_dir.write("summary.json", json.dumps(summary, indent=1).encode())
    if not args.no_summary:
        sys.stdout.write("\n" + telemetry.format_summary(summary) + "\n")
    if run_dir.temporary:
        kept = f"; timeline (Chrome trace) {timeline_path}" if timeline is not None else ""
        sys.stdout.write(f"crossover-run: telemetry removed at exit (--telemetry-dir DIR keeps it){kept}\n")
    else:
        sys.stdout.write(f"crossover-run: timeline (Chrome trace) {timeline_path}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of ``crossover-run``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, jobs = plan_jobs(argv, parser)
    crossover = not args.no_crossover
    if args.dry_run:
        telemetry_dir = (os.path.join(os.path.abspath(args.telemetry_dir), "run-DATE-TIME-PID")
                         if args.telemetry_dir else "<temporary folder>")
        for j in jobs:
            if crossover:
                j.env["CROSSOVER_TELEMETRY_DIR"] = telemetry_dir
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(j.env.items()))
            sys.stdout.write(f"{j.name}: {env} {shlex.join(j.argv)}\n")
        return 0
    run_dir: outputs.RunDir | None = None
    timeline: outputs.OutputFile | None = None
    if crossover:
        try:  # every folder written to is opened (and checked) now, before any job starts
            run_dir = outputs.RunDir.new(args.telemetry_dir)
            if args.timeline:
                timeline = outputs.OutputFile(args.timeline, "--timeline")
        except paths.SchedulerDirError as exc:
            if run_dir is not None:
                run_dir.remove()
                run_dir.close()
            parser.error(str(exc))
        for j in jobs:
            j.env["CROSSOVER_TELEMETRY_DIR"] = run_dir.path
        sys.stdout.write(f"crossover-run: telemetry in {run_dir.path}\n")
        sys.stdout.flush()
    try:
        return _run_and_report(args, jobs, run_dir, timeline)
    finally:
        if timeline is not None:
            timeline.close()
        if run_dir is not None:
            run_dir.remove()  # a temporary folder only; --telemetry-dir's run directory stays
            run_dir.close()


def _run_and_report(args: argparse.Namespace, jobs: list[Job], run_dir: outputs.RunDir | None,
                    timeline: outputs.OutputFile | None) -> int:
    """Run the jobs, then report from their telemetry; the exit status."""
    # Explicit handlers: a process started in the background by a non-interactive shell inherits SIGINT
    # ignored, and Python then never raises KeyboardInterrupt; `kill -INT` must still stop every job.
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    old_int = signal.signal(signal.SIGINT, _on_sigint)
    try:
        interrupted = _run(jobs, args.fail_fast, args.grace)
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
    if interrupted is not None:
        return interrupted
    if run_dir is not None:
        try:
            _report(args, run_dir, timeline)
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
