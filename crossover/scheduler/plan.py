"""``crossover-run``'s command line: its options, and the jobs it names, as the commands to run.

Two forms of job list:

* ``crossover-run a.py b.py`` (no ``--``): every argument ending in ``.py`` starts a new job, unless it
  directly follows an option (``--config cfg.py`` stays an argument); each job runs with the same python;
* ``crossover-run [options] a.py --lr 0.1 -- -m pkg.train --epochs 5``: jobs separated by ``--``, each
  ``SCRIPT [ARGS...]`` or ``-m MODULE [ARGS...]``, optionally preceded by a python interpreter.

Jobs are named after their scripts (``a``, ``b``; ``train-1``, ``train-2`` for one script run twice);
the name is the same on every host, which keeps the hosts' turn orders in step. Without ``-np``, each
job gets one rank per local GPU when torch sees CUDA devices, else one rank.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

import crossover
from crossover.scheduler import settings

__all__ = ["Job", "UsageError", "build_parser", "plan_jobs", "job_names", "split_bare", "default_np"]

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PYTHON_RE = re.compile(r"^python[0-9.]*$")
# a job name is a file and folder name (telemetry, --tensorboard DIR/<job>): no ".", "..", "/", NUL, leading - or .
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_NAME_RULE = "1 to 64 letters, digits, _ . -, starting with a letter, digit or _"
PROGRESS_EVERY_S = 10.0  # plain progress lines (not a terminal): often enough to see a job move, few in a log

EPILOG = """\
jobs:
  crossover-run a.py b.py: every argument ending in .py starts a job (unless it follows an option).
  With --, each job is SCRIPT [ARGS...] or -m MODULE [ARGS...] (optionally preceded by a python
  interpreter). Every job is an ordinary Horovod script; with the stock hvd.DistributedOptimizer it
  takes turns on the device with no code change (custom loops:
  `with horovod_ext.scheduling.crossover_turn(): ...`). Jobs are named after their scripts.

examples:
  crossover-run job1.py job2.py                            # -np: 1 rank per job, or 1 per local GPU
  crossover-run -np 2 -H host1:1,host2:1 job1.py --lr 0.1 -- job2.py --epochs 5
  crossover-run -np 2 -H localhost:2 --gloo train.py -- train.py --seed 1
  crossover-run --dry-run -np 4 --hostfile hosts.txt a.py -- b.py -- c.py
  crossover-run --no-crossover -np 2 a.py -- b.py      # same jobs at once, no scheduler (baseline)
  crossover-run --plot turns.png --tensorboard runs/ a.py b.py

environment of every rank (set by crossover-run):
  CROSSOVER_SCHED=1, CROSSOVER_JOB=<job name>, CROSSOVER_JOB_WEIGHT, CROSSOVER_TELEMETRY_DIR and, when
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

    def full_env(self) -> dict[str, str]:
        """The environment the job's horovodrun gets: ours plus :attr:`env`."""
        return {**os.environ, **self.env}


def build_parser() -> argparse.ArgumentParser:
    """The ``crossover-run`` argument parser (for the part before the first ``--``)."""
    p = argparse.ArgumentParser(
        prog="crossover-run",
        usage="crossover-run [options] [-np N] [horovodrun options] (SCRIPT.py SCRIPT.py ... | "
              "JOB [ARGS...] -- JOB [ARGS...] ...)",
        description="Run several Horovod jobs at once; on every host the workers of different jobs that share "
                    "a device take turns on it: while one job waits on its gradient allreduce, another "
                    "computes (crossover scheduling).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    h = p.add_argument_group("horovodrun options (given once, passed to every job's horovodrun)")
    p.add_argument("--version", action="version", version=f"%(prog)s {crossover.__version__}")
    h.add_argument("-np", "--num-proc", dest="np", type=_int_in(1, 1 << 20), default=None,
                   help="ranks per job (default: one per local GPU when torch sees CUDA devices, else 1)")
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
    x.add_argument("--names", help="comma-separated job names (default: the scripts' names, numbered when one "
                                   f"script runs twice); the same on every host. Each is {_NAME_RULE} (names "
                                   "become file and folder names: '.', '..', '/' and a leading '-' are refused)")
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
    x.add_argument("--plot", metavar="PNG", help="draw the turns (one lane per job: compute, communication, waiting "
                                                 "for a turn) into this PNG (needs matplotlib)")
    x.add_argument("--tensorboard", metavar="DIR", help="write per-step scalars busy, overlap, wait for a turn, ... "
                                                       "(crossover/ prefix) for TensorBoard, one sub-folder per job "
                                                       "(needs tensorboard)")
    x.add_argument("--no-summary", action="store_true", help="do not print the telemetry summary")
    x.add_argument("--no-progress", action="store_true", help="do not show the jobs' progress while they run")
    x.add_argument("--progress-every", type=settings.Setting("--progress-every", 0.1, 86400.0).arg_type(),
                   default=PROGRESS_EVERY_S, metavar="S",
                   help="when the output is not a terminal, print a progress line every S seconds (default "
                        "%(default)s; on a terminal one line is redrawn)")
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


def _check_names(text: str, n: int) -> list[str]:
    """The ``--names`` list: ``n`` distinct valid names, else :class:`UsageError` naming the culprit."""
    names = text.split(",")
    if len(names) != n:
        raise UsageError(f"--names: need {n} comma-separated names (one per job), got {len(names)}")
    for name in names:
        if not _NAME_RE.fullmatch(name):
            raise UsageError(f"--names: bad job name {name!r}: a job name is {_NAME_RULE} (it becomes a file and "
                             f"folder name, so '.', '..', path separators and a leading '-' are refused)")
    if len(set(names)) != n:
        raise UsageError(f"--names: the names must be distinct, got {text!r}")
    return names


def plan_jobs(argv: Sequence[str], parser: argparse.ArgumentParser | None = None
              ) -> tuple[argparse.Namespace, list[Job]]:
    """Parse a command line into options and jobs (commands and environments). Usage errors exit 2."""
    parser = parser or build_parser()
    segments = _split(argv)
    args = parser.parse_args(segments[0])
    if len(segments) == 1:  # no --: each .py argument starts a job
        job_tokens = split_bare(args.job)
    else:
        job_tokens = ([args.job] if args.job else []) + segments[1:]
    try:
        if not job_tokens:
            raise UsageError("no job given (put a script after the options)")
        n = len(job_tokens)
        names = _check_names(args.names, n) if args.names is not None else job_names(job_tokens)
        args.np_reason = "given"
        if args.np is None:
            args.np, args.np_reason = default_np()
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


def _is_python(tok: str) -> bool:
    return bool(_PYTHON_RE.match(os.path.basename(tok)))


def split_bare(tokens: Sequence[str]) -> list[list[str]]:
    """Jobs of a command line without ``--``: a new job at every ``.py`` argument that does not directly follow
    an option (``--config cfg.py``) or an interpreter, and at every python interpreter."""
    jobs: list[list[str]] = []
    for tok in tokens:
        cur = jobs[-1] if jobs else None
        starts = cur is None or _is_python(tok) or (
            tok.endswith(".py") and not cur[-1].startswith("-") and not (len(cur) == 1 and _is_python(cur[0])))
        if starts:
            jobs.append([tok])
        else:
            cur.append(tok)  # type: ignore[union-attr]
    return jobs


def job_names(job_tokens: Sequence[Sequence[str]]) -> list[str]:
    """Each job named after its script (``train.py`` -> ``train``) or module; a name that comes up more than once
    is numbered (``train-1``, ``train-2``). Characters other than letters, digits, ``_ . -`` become ``_`` and
    leading ``.`` and ``-`` are dropped, so that every name is a plain file name (``job`` if nothing is left)."""
    bases = []
    for tokens in job_tokens:
        toks = list(tokens[1:] if tokens and _is_python(tokens[0]) else tokens)
        if toks[:1] == ["-m"] and len(toks) > 1:
            base = toks[1]
        elif toks:
            base = os.path.splitext(os.path.basename(toks[0]))[0]
        else:
            base = "job"
        bases.append(re.sub(r"[^A-Za-z0-9_.-]", "_", base).lstrip(".-")[:56] or "job")
    counts = collections.Counter(bases)
    taken: set[str] = set()
    names = []
    for base in bases:
        n = 0
        name = base
        while name in taken or (counts[base] > 1 and n == 0):
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        names.append(name)
    return names


def default_np() -> tuple[int, str]:
    """Ranks per job when ``-np`` is not given, and why: one per local GPU when torch sees CUDA, else 1."""
    try:
        import torch
    except ImportError:
        return 1, "1 rank per job (torch is not installed, so no GPU was looked for)"
    try:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver: as if there were no GPU
        gpus = 0
    if gpus:
        return gpus, f"{gpus} rank(s) per job, one per local GPU (torch.cuda.device_count())"
    return 1, "1 rank per job (no CUDA device found)"


def _default_horovodrun(python: str) -> str:
    candidate = os.path.join(os.path.dirname(python), "horovodrun")
    return candidate if os.path.exists(candidate) else (shutil.which("horovodrun") or "horovodrun")


