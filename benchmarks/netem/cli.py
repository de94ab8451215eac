"""Command line of the emulated network: ``python -m benchmarks.netem`` or ``crossover-netem``.

Runs a command in one shaped namespace, a Horovod job over emulated hosts, a TCP throughput check
(``--measure``) or the clean-up of namespaces left by killed runs (``--cleanup``); ``--help`` lists
the options. Exit status: the command's (or the first failed rank's), 124 on timeout, 2 when the
emulated network is unavailable here, 130 on Ctrl-C, 143 on SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
from typing import Sequence

from . import helpers
from .horovod_launch import HorovodTimeout, launch_horovod
from .measure import measure_tcp_throughput
from .namespaces import (
    DEFAULT_MTU,
    EmulatedCluster,
    ShapedNamespace,
    cleanup_stale_namespaces,
    netem_unavailable_reason,
    run_shaped,
)
from .units import parse_rate

__all__ = ["main"]


def _mbit(bits: float) -> str:
    return f"{bits / 1e6:.1f} Mbit/s"


def _measure_cli(args: argparse.Namespace) -> int:
    rate = parse_rate(args.rate)
    if args.hosts is None:
        with ShapedNamespace(args.rate, args.delay, mtu=args.mtu) as ns:
            (r,) = measure_tcp_throughput([(ns.exec_prefix(), ns.exec_prefix(), "127.0.0.1")],
                                          seconds=args.seconds)
        sys.stdout.write(f"loopback, one stream: {_mbit(r)} ({100 * r / rate:.1f}% of {args.rate})\n")
        return 0
    if args.hosts < 2:
        raise SystemExit("--measure with --hosts needs at least 2 hosts")
    with EmulatedCluster(args.hosts, args.rate, args.delay, mtu=args.mtu) as cluster:
        (r,) = measure_tcp_throughput([cluster.flow(0, 1)], seconds=args.seconds)
        sys.stdout.write(f"host0 -> host1, one stream: {_mbit(r)} ({100 * r / rate:.1f}% of {args.rate})\n")
        a, b = measure_tcp_throughput([cluster.flow(0, 1), cluster.flow(1, 0)], seconds=args.seconds)
        sys.stdout.write(f"both directions at once: host0 -> host1 {_mbit(a)} ({100 * a / rate:.1f}%), "
                         f"host1 -> host0 {_mbit(b)} ({100 * b / rate:.1f}%)\n")
    return 0


PROG = "crossover-netem"


def _build_parser() -> argparse.ArgumentParser:
    import crossover

    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run a command, or a Horovod job, over an emulated network of chosen bandwidth "
                    "(Linux network namespaces shaped with tc; needs root).",
        epilog="examples:\n"
               f"  {PROG} --rate 200mbit -- python bench.py\n"
               f"  {PROG} --hosts 2 -np 1 --rate 1gbit -- python train.py\n"
               f"  {PROG} --hosts 2 --rate 200mbit --measure\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {crossover.__version__}")
    p.add_argument("--rate", default="1gbit", help="link rate in tc units (default: %(default)s)")
    p.add_argument("--delay", default=None,
                   help="added one-way delay, e.g. 1ms (needs the kernel's netem qdisc)")
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU, help="link MTU (default: %(default)s)")
    p.add_argument("--hosts", type=int, default=None,
                   help="emulate this many hosts (one namespace each, full-duplex links of --rate) and "
                        "run CMD as a Horovod job over them; without it CMD runs once in one namespace "
                        "with a shaped loopback")
    p.add_argument("-np", "--np", "--procs-per-host", dest="procs_per_host", type=int, default=1, metavar="N",
                   help="Horovod ranks per host (default: 1)")
    p.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    p.add_argument("--measure", action="store_true",
                   help="instead of CMD, measure TCP throughput over the emulated links and print it")
    p.add_argument("--seconds", type=float, default=3.0, help="duration of --measure (default: 3)")
    p.add_argument("--cleanup", action="store_true",
                   help="delete namespaces left behind by killed runs (xo-<dead pid>-...) and exit")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log setup steps (-vv: every command)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- followed by the command to run")
    return p


class _Terminated(BaseException):
    """Raised by the CLI's SIGTERM handler so that every ``finally`` (namespace deletion) runs."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``python -m benchmarks.netem``, console script ``crossover-netem``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_tcp-sink", "_tcp-source", "_rendezvous"):
        return helpers.main(argv)
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(name)s: %(message)s")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.cleanup:
        for ns in cleanup_stale_namespaces():
            sys.stdout.write(f"deleted {ns}\n")
        return 0
    reason = netem_unavailable_reason(delay=bool(args.delay))
    if reason:
        sys.stderr.write(f"{PROG}: {reason}\n")
        return 2
    if args.measure:
        return _measure_cli(args)
    if not cmd:
        _build_parser().error("no command given (put it after --)")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        if args.hosts is None:
            return run_shaped(cmd, args.rate, args.delay, timeout=args.timeout, mtu=args.mtu).returncode
        with EmulatedCluster(args.hosts, args.rate, args.delay, mtu=args.mtu) as cluster:
            results = launch_horovod(cluster, args.procs_per_host, cmd, timeout=args.timeout, echo=True)
        codes = [r.returncode for r in results]
        failed = [c for c in codes if c]
        if failed:
            sys.stderr.write(f"{PROG}: rank exit codes {codes}\n")
        return failed[0] if failed and failed[0] > 0 else (1 if failed else 0)
    except subprocess.TimeoutExpired as exc:
        if not isinstance(exc, HorovodTimeout):
            sys.stderr.write(f"{PROG}: timed out after {exc.timeout:g} s\n")
        else:
            sys.stderr.write(f"{PROG}: Horovod job timed out after {exc.timeout:g} s\n")
        return 124
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        return 143


if __name__ == "__main__":
    sys.exit(main())
