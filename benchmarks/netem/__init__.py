"""Emulate a network of chosen bandwidth (and optionally delay) on one Linux machine.

This package is the one place where tests and benchmarks get a slow network on a single box. It
builds Linux network namespaces, shapes their links with ``tc`` (a ``tbf`` token bucket for the rate,
``netem`` for an added delay when the kernel has it) and runs commands inside them. Everything is
removed again when the ``with`` block ends, also on errors, timeouts and Ctrl-C.

Two set-ups:

* :func:`run_shaped` / :class:`ShapedNamespace`: one namespace whose loopback is shaped. Every
  process inside shares one medium of ``rate`` (loopback carries both directions).
* :class:`EmulatedCluster`: one namespace per host, joined through a bridge in a "switch" namespace
  by veth pairs. Each host has its own full-duplex link: ``rate`` up and ``rate`` down. The host end
  is called ``eth0`` in every host namespace and has the address ``10.77.0.<i+1>/24``::

        host ns h0                 switch ns sw                 host ns h1
      +-----------+          +------------------------+          +-----------+
      | eth0      |  veth    |  p0 ---- br0 ---- p1   |   veth   |      eth0 |
      | 10.77.0.1 |==========|  tbf            tbf    |==========| 10.77.0.2 |
      | tbf(up)   |          | (h0 down)    (h1 down) |          |   tbf(up) |
      +-----------+          +------------------------+          +-----------+

:func:`launch_horovod` runs a Horovod job (Gloo controller) with its ranks spread over the hosts of
an :class:`EmulatedCluster`, the way ``horovodrun --gloo`` does internally but without ssh: Horovod's
own ``RendezvousServer`` runs inside host 0's namespace and every rank is started with
``ip netns exec <host ns>`` and the ``HOROVOD_*`` variables that ``horovodrun`` would set.

Command line (``python -m benchmarks.netem --help`` or ``crossover-netem``)::

    python -m benchmarks.netem --rate 200mbit -- CMD ...                  # one shaped namespace
    python -m benchmarks.netem --hosts 2 --procs-per-host 1 --rate 1gbit -- python train.py
    python -m benchmarks.netem --hosts 2 --rate 200mbit --measure         # TCP throughput check

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` and ``tc`` tools;
:func:`netem_unavailable_reason` says why it cannot be used here, for ``pytest.skip``.
It is test and benchmark tooling, not part of the ``crossover`` library. One module per job:

* :mod:`~benchmarks.netem.units` -- rates and durations in ``tc`` units;
* :mod:`~benchmarks.netem.namespaces` -- namespaces, ``tc`` shaping, :class:`EmulatedCluster`, clean-up;
* :mod:`~benchmarks.netem.measure` -- TCP throughput (the helper processes' code: :mod:`~benchmarks.netem.helpers`);
* :mod:`~benchmarks.netem.horovod_launch` -- :func:`launch_horovod` over the emulated hosts;
* :mod:`~benchmarks.netem.cli` -- the command line.

Only the standard library and :mod:`crossover.procgroup` are used; Horovod is imported only by the
rendezvous helper process.
"""

from __future__ import annotations

from .cli import main
from .errors import NetemError
from .horovod_launch import HorovodTimeout, format_rank_output, launch_horovod
from .measure import TcpFlow, measure_tcp_throughput
from .namespaces import (
    DEFAULT_MTU,
    DEFAULT_SUBNET,
    HOST_IFACE,
    NS_PREFIX,
    EmulatedCluster,
    ShapedNamespace,
    cleanup_stale_namespaces,
    list_namespaces,
    netem_unavailable_reason,
    run_shaped,
)
from .units import parse_rate, parse_time

__all__ = [
    "DEFAULT_MTU",
    "DEFAULT_SUBNET",
    "HOST_IFACE",
    "NS_PREFIX",
    "EmulatedCluster",
    "HorovodTimeout",
    "NetemError",
    "ShapedNamespace",
    "TcpFlow",
    "cleanup_stale_namespaces",
    "format_rank_output",
    "launch_horovod",
    "list_namespaces",
    "main",
    "measure_tcp_throughput",
    "netem_unavailable_reason",
    "parse_rate",
    "parse_time",
    "run_shaped",
]
