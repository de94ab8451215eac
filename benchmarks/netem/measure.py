"""TCP goodput over emulated links: start a receiver and a sender per flow, report bits per second.

:func:`measure_tcp_throughput` runs its flows at the same time, each end in its own helper process
(started with an argv prefix such as ``ip netns exec <ns>``, so each end can sit in a different
namespace). The helpers' code is :mod:`benchmarks.netem.helpers`; :func:`helper_argv` builds the
command line that runs it. :func:`read_first_line` waits for a helper's first output line (its port).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from typing import Any, NamedTuple, Sequence

from crossover import procgroup

from .errors import NetemError

__all__ = ["TcpFlow", "helper_argv", "measure_tcp_throughput", "read_first_line"]

_HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers.py")


def helper_argv(python: str, *args: str) -> list[str]:
    """argv that runs :mod:`benchmarks.netem.helpers` with ``python``, whatever the cwd or install.

    The helpers file is run by path (``runpy.run_path``), so the helper needs neither this checkout
    on ``sys.path`` nor an installed package, and its directory is not put on ``sys.path`` either
    (the sibling module names cannot shadow anything the helper imports).
    """
    code = f"import runpy; runpy.run_path({_HELPERS!r}, run_name='__main__')"
    return [python, "-c", code, *args]


class TcpFlow(NamedTuple):
    """One TCP stream: sender argv prefix, receiver argv prefix, receiver address as seen by sender."""

    sender: Sequence[str]
    receiver: Sequence[str]
    address: str


def read_first_line(proc: subprocess.Popen[Any], timeout: float, what: str) -> str:
    """First stdout line of a helper, or :class:`NetemError` with its stderr after ``timeout``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        procgroup.terminate(proc)
        err = proc.stderr.read() if proc.stderr is not None else ""
        raise NetemError(f"{what} did not start within {timeout:.0f} s: {str(err).strip()}")
    return str(line).strip()


def measure_tcp_throughput(flows: Sequence[TcpFlow | tuple[Sequence[str], Sequence[str], str]],
                           seconds: float = 2.0, warmup: float = 0.5,
                           python: str = sys.executable) -> list[float]:
    """Run the given TCP streams at the same time; return each one's goodput in bits/s.

    Each flow is ``(sender_prefix, receiver_prefix, address)``: a receiver is started with
    ``receiver_prefix + [python, ...]`` listening on all addresses, a sender with ``sender_prefix``
    sends zeros to ``address`` for ``warmup + seconds``. The rate is measured at the receiver over the
    data received after the first ``warmup`` seconds (tbf lets a first burst through at full speed).
    Use ``[]`` as prefix for the current namespace, ``cluster.flow(0, 1)`` for cluster hosts.
    """
    flows = [TcpFlow(*f) for f in flows]
    sinks: list[subprocess.Popen[str]] = []
    sources: list[subprocess.Popen[str]] = []
    limit = warmup + seconds + 30.0
    try:
        for f in flows:
            sinks.append(procgroup.start(list(f.receiver) + helper_argv(python, "_tcp-sink", str(warmup)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        ports = [read_first_line(p, 30.0, "TCP receiver") for p in sinks]
        for f, port in zip(flows, ports):
            sources.append(procgroup.start(list(f.sender) + helper_argv(
                python, "_tcp-source", f.address, port, str(warmup + seconds)),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        rates = []
        for src, sink in zip(sources, sinks):
            _, serr = src.communicate(timeout=limit)
            out, err = sink.communicate(timeout=limit)
            if src.returncode or sink.returncode:
                raise NetemError(f"TCP measurement failed: sender exit {src.returncode}: {serr.strip()}; "
                                 f"receiver exit {sink.returncode}: {err.strip()}")
            rates.append(float(json.loads(out.strip().splitlines()[-1])["bits_per_s"]))
        return rates
    finally:
        for p in sources + sinks:
            procgroup.terminate(p, grace=0.5)
