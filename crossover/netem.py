"""Emulate a network of chosen bandwidth (and optionally delay) on one Linux machine.

This module is the one place where tests and benchmarks get a slow network on a single box. It
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

Command line (``python -m crossover.netem --help`` or ``crossover-netem``)::

    python -m crossover.netem --rate 200mbit -- CMD ...                  # one shaped namespace
    python -m crossover.netem --hosts 2 --procs-per-host 1 --rate 1gbit -- python train.py
    python -m crossover.netem --hosts 2 --rate 200mbit --measure         # TCP throughput check

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` and ``tc`` tools;
:func:`netem_unavailable_reason` says why it cannot be used here, for ``pytest.skip``.
Only the standard library is used; Horovod is imported only by the rendezvous helper process.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import itertools
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, NamedTuple, Sequence

log = logging.getLogger(__name__)

__all__ = [
    "NS_PREFIX",
    "EmulatedCluster",
    "HorovodTimeout",
    "NetemError",
    "ShapedNamespace",
    "TcpFlow",
    "cleanup_stale_namespaces",
    "launch_horovod",
    "list_namespaces",
    "main",
    "measure_tcp_throughput",
    "netem_unavailable_reason",
    "parse_rate",
    "parse_time",
    "run_shaped",
]

#: Every namespace this module creates is named ``xo-<pid>-<counter>...``.
NS_PREFIX = "xo-"
#: Default MTU of the shaped links (jumbo frames: fewer packets per byte, less CPU).
DEFAULT_MTU = 9000
#: The private /24 used for host addresses; it exists only inside the namespaces we create.
DEFAULT_SUBNET = "10.77.0"
#: Name of each host's link in an :class:`EmulatedCluster` (for ``HOROVOD_GLOO_IFACE``).
HOST_IFACE = "eth0"

_QUEUE_SECONDS = 0.05  # tbf queue length, as time at the line rate (a deep-ish switch buffer)
_MIN_BURST = 128 * 1024  # bytes; > 64 KiB so GSO/TSO super-packets pass tbf without being split
_NETEM_LIMIT = 100_000  # packets netem may hold while delaying them
_CMD_TIMEOUT = 30.0  # seconds for one ip/tc command
_ETC_NETNS = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*

_counter = itertools.count()
_counter_lock = threading.Lock()
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NetemError(RuntimeError):
    """Setting up or tearing down the emulated network failed (the message says which command)."""


# --------------------------------------------------------------------------- units


_RATE_UNITS = {
    "": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2.0**10, "mibit": 2.0**20, "gibit": 2.0**30, "tibit": 2.0**40,
    "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2.0**10, "mibps": 8 * 2.0**20, "gibps": 8 * 2.0**30, "tibps": 8 * 2.0**40,
}
_TIME_UNITS = {
    "s": 1.0, "sec": 1.0, "secs": 1.0, "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
    "us": 1e-6, "usec": 1e-6, "usecs": 1e-6, "": 1e-6,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_rate(rate: str | float) -> float:
    """Return a rate in bits per second, parsed with ``tc``'s units.

    ``"200mbit"`` -> 2e8, ``"1gbit"`` -> 1e9, ``"10mbps"`` -> 8e7 (``bps`` is *bytes* per second in
    ``tc``), a bare number is bits per second.
    """
    if isinstance(rate, (int, float)):
        value, unit = float(rate), ""
    else:
        m = _NUMBER_UNIT.match(rate)
        if not m or m.group(2).lower() not in _RATE_UNITS:
            raise ValueError(f"cannot parse rate {rate!r} (use tc units, e.g. 200mbit, 1gbit, 10mbps)")
        value, unit = float(m.group(1)), m.group(2).lower()
    bits = value * _RATE_UNITS[unit]
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is too low (at least 8kbit)")
    return bits


def parse_time(value: str | float) -> float:
    """Return a duration in seconds, parsed with ``tc``'s units (``"1ms"``, ``"250us"``, ``"0.1s"``).

    A bare string number is microseconds, as in ``tc``; a Python number is seconds.
    """
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _NUMBER_UNIT.match(value)
        if not m or m.group(2).lower() not in _TIME_UNITS:
            raise ValueError(f"cannot parse time {value!r} (use tc units, e.g. 1ms, 250us, 0.1s)")
        seconds = float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    if seconds < 0:
        raise ValueError(f"negative time {value!r}")
    return seconds


def _fmt_rate(bits: float) -> str:
    return f"{int(round(bits))}bit"


def _fmt_time(seconds: float) -> str:
    return f"{int(round(seconds * 1e6))}us"


# --------------------------------------------------------------------------- low-level helpers


def _new_name() -> str:
    with _counter_lock:
        n = next(_counter)
    return f"{NS_PREFIX}{os.getpid()}-{n}"


def _check_output(argv: Sequence[str], what: str | None = None) -> str:
    """Run one short admin command; raise :class:`NetemError` with its stderr when it fails."""
    log.debug("+ %s", " ".join(argv))
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetemError(f"{what or 'command'} failed: {' '.join(argv)}: {exc}") from exc
    if res.returncode != 0:
        raise NetemError(f"{what or 'command'} failed: {' '.join(argv)}: "
                         f"{(res.stderr or res.stdout).strip()} (exit {res.returncode})")
    return res.stdout


def _ip(ns: str | None, *args: str) -> str:
    argv = ["ip"] + (["-n", ns] if ns else []) + list(args)
    return _check_output(argv)


def _tc(ns: str, *args: str) -> str:
    return _check_output(["tc", "-n", ns, *args])


def list_namespaces(prefix: str = NS_PREFIX) -> list[str]:
    """Names of the network namespaces (``ip netns list``) that start with ``prefix``."""
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             timeout=_CMD_TIMEOUT, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process still inside ``ns`` (``ip netns del`` alone would leave them running)."""
    try:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                             timeout=_CMD_TIMEOUT, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    for tok in out.split():
        if tok.isdigit() and int(tok) != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(tok), signal.SIGKILL)


def _delete_namespace(ns: str) -> None:
    """Kill what runs in ``ns`` and delete it; deleting it also destroys its veth ends. Never raises."""
    if ns not in list_namespaces(ns):
        return
    _kill_namespace_processes(ns)
    for attempt in range(3):
        res = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True,
                             timeout=_CMD_TIMEOUT, check=False)
        if res.returncode == 0 or ns not in list_namespaces(ns):
            log.debug("deleted network namespace %s", ns)
            return
        time.sleep(0.1 * (attempt + 1))
    log.warning("could not delete network namespace %s: %s", ns, res.stderr.strip())


def cleanup_stale_namespaces() -> list[str]:
    """Delete ``xo-<pid>-...`` namespaces whose creating process no longer exists; return their names.

    A run killed with SIGKILL cannot clean up after itself; this removes what it left behind.
    """
    removed = []
    for ns in list_namespaces():
        m = re.match(re.escape(NS_PREFIX) + r"(\d+)-", ns)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        _delete_namespace(ns)
        removed.append(ns)
    with contextlib.suppress(OSError):
        for name in os.listdir(_ETC_NETNS):
            m = re.match(re.escape(NS_PREFIX) + r"(\d+)-", name)
            if m and not os.path.exists(f"/proc/{m.group(1)}") and int(m.group(1)) != os.getpid():
                shutil.rmtree(os.path.join(_ETC_NETNS, name), ignore_errors=True)
    return removed


def _kill_group(proc: subprocess.Popen[Any], grace: float = 1.0) -> None:
    """Terminate ``proc``'s process group (it was started with ``start_new_session=True``)."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid  # leader already reaped: the group may still hold children
    if pgid != proc.pid:  # not a group of its own: never signal our own group
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    if proc.poll() is None:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


def _popen(argv: Sequence[str], **popen_kw: Any) -> subprocess.Popen[Any]:
    popen_kw.setdefault("start_new_session", True)
    return subprocess.Popen(list(argv), **popen_kw)


def _run_group(argv: Sequence[str], *, input: Any = None, capture_output: bool = False,
               timeout: float | None = None, check: bool = False,
               **popen_kw: Any) -> subprocess.CompletedProcess[Any]:
    """Like :func:`subprocess.run`, but the child gets its own process group, which is killed on exit."""
    if capture_output:
        if "stdout" in popen_kw or "stderr" in popen_kw:
            raise ValueError("stdout and stderr arguments may not be used with capture_output")
        popen_kw["stdout"] = popen_kw["stderr"] = subprocess.PIPE
    if input is not None:
        if "stdin" in popen_kw:
            raise ValueError("stdin and input arguments may not both be used")
        popen_kw["stdin"] = subprocess.PIPE
    proc = _popen(argv, **popen_kw)
    try:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = _drain(proc)
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
        retcode = proc.poll()
        assert retcode is not None
        if check and retcode:
            raise subprocess.CalledProcessError(retcode, proc.args, output=out, stderr=err)
        return subprocess.CompletedProcess(proc.args, retcode, out, err)
    finally:
        _kill_group(proc, grace=0.5)  # also background children left in the group
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def _drain(proc: subprocess.Popen[Any]) -> tuple[Any, Any]:
    """Collect what a killed process left in its pipes (bounded: an escaped grandchild may hold them)."""
    try:
        return proc.communicate(timeout=5.0)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return None, None


def _helper_argv(python: str, *args: str) -> list[str]:
    """argv that runs one of this module's internal helpers with ``python``, whatever the cwd."""
    code = (f"import sys; sys.path.insert(0, {_REPO_ROOT!r}); "
            "from crossover.netem import _helper_main; sys.exit(_helper_main(sys.argv[1:]))")
    return [python, "-c", code, *args]


# --------------------------------------------------------------------------- availability


def _has_caps(*bits: int) -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    eff = int(line.split()[1], 16)
                    return all(eff >> b & 1 for b in bits)
    except OSError:
        pass
    return False


@functools.cache
def netem_unavailable_reason(delay: bool = False) -> str | None:
    """Return ``None`` when namespaces can be built and shaped here, else a human-readable reason.

    Checks Linux, root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), ``ip``/``tc`` on PATH, and makes a trial
    namespace with a tbf-shaped loopback, a veth pair and a bridge. With ``delay=True`` it also checks
    that the kernel has the ``netem`` qdisc (needed for the ``delay=`` option). The answer is cached.
    Use it as ``if (r := netem_unavailable_reason()): pytest.skip(r)``.
    """
    if not sys.platform.startswith("linux"):
        return f"network emulation needs Linux network namespaces (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (install iproute2)"
    cap_net_admin, cap_sys_admin = 12, 21
    if os.geteuid() != 0 and not _has_caps(cap_net_admin, cap_sys_admin):
        return ("needs root to create network namespaces "
                "(run as root or with CAP_NET_ADMIN and CAP_SYS_ADMIN)")
    ns = _new_name() + "-probe"
    try:
        try:
            _ip(None, "netns", "add", ns)
        except NetemError as exc:
            return f"cannot create a network namespace: {exc}"
        steps: list[tuple[str, list[str]]] = [
            ("cannot bring up loopback in a namespace", ["ip", "-n", ns, "link", "set", "lo", "up"]),
            ("the kernel has no tbf qdisc (CONFIG_NET_SCH_TBF)",
             ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit",
              "burst", "256kb", "limit", "1mb"]),
            ("the kernel cannot create veth pairs (CONFIG_VETH)",
             ["ip", "-n", ns, "link", "add", "xa", "type", "veth", "peer", "name", "xb"]),
            ("the kernel cannot create bridges (CONFIG_BRIDGE)",
             ["ip", "-n", ns, "link", "add", "xbr", "type", "bridge"]),
        ]
        if delay:
            steps.append(("the kernel has no netem qdisc (CONFIG_NET_SCH_NETEM / module sch_netem), "
                          "so a delay cannot be emulated",
                          ["tc", "-n", ns, "qdisc", "add", "dev", "xa", "root", "netem", "delay", "1ms"]))
        for why, argv in steps:
            try:
                _check_output(argv)
            except NetemError as exc:
                return f"{why}: {exc}"
        return None
    finally:
        _delete_namespace(ns)


# --------------------------------------------------------------------------- shaping


def _tbf_args(rate_bits: float, mtu: int) -> list[str]:
    byte_rate = rate_bits / 8.0
    burst = max(_MIN_BURST, 2 * (mtu + 64), int(byte_rate * 0.004))  # burst MUST exceed the MTU
    limit = burst + int(byte_rate * _QUEUE_SECONDS)
    return ["tbf", "rate", _fmt_rate(rate_bits), "burst", str(burst), "limit", str(limit)]


def _shape(ns: str, dev: str, rate_bits: float, delay_s: float | None, mtu: int) -> None:
    """Put the egress shaping on ``dev`` in ``ns``: tbf alone, or netem (delay) with a tbf child."""
    if not delay_s:
        _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *_tbf_args(rate_bits, mtu))
        return
    try:
        _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
            "delay", _fmt_time(delay_s), "limit", str(_NETEM_LIMIT))
    except NetemError as exc:
        raise NetemError(f"cannot emulate a delay (does the kernel have the netem qdisc?): {exc}") from exc
    _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *_tbf_args(rate_bits, mtu))


def _qdisc_bytes(ns: str, dev: str) -> int:
    """Bytes sent so far through the root qdisc of ``dev`` in ``ns``."""
    for q in json.loads(_tc(ns, "-s", "-j", "qdisc", "show", "dev", dev) or "[]"):
        if q.get("root"):
            return int(q.get("bytes", 0))
    raise NetemError(f"no root qdisc on {dev} in {ns}")


class ShapedNamespace:
    """One fresh network namespace whose loopback is shaped to ``rate`` (and ``delay`` one-way).

    Everything inside shares one medium: loopback carries both directions, so two streams in
    opposite directions share ``rate``. With ``delay``, every packet is delayed once (RTT = 2 x delay).
    Use as a context manager; :meth:`close` kills what still runs inside and deletes the namespace.
    """

    def __init__(self, rate: str = "1gbit", delay: str | None = None, *, mtu: int = DEFAULT_MTU) -> None:
        self.rate = rate
        self.delay = delay
        self.mtu = mtu
        self.name = _new_name()
        self._closed = False
        self._procs: list[subprocess.Popen[Any]] = []
        rate_bits = parse_rate(rate)
        delay_s = parse_time(delay) if delay else None
        atexit.register(self.close)
        try:
            _ip(None, "netns", "add", self.name)
            _ip(self.name, "link", "set", "lo", "mtu", str(mtu), "up")
            _shape(self.name, "lo", rate_bits, delay_s, mtu)
        except BaseException:
            self.close()
            raise
        log.info("shaped namespace %s: rate %s, delay %s, mtu %d", self.name, rate, delay, mtu)

    def exec_prefix(self) -> list[str]:
        """argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def run(self, cmd: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """:func:`subprocess.run` inside the namespace (own process group, killed on return)."""
        return _run_group(self.exec_prefix() + list(cmd), **kw)

    def popen(self, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """:class:`subprocess.Popen` inside the namespace; the process group is killed by :meth:`close`."""
        proc = _popen(self.exec_prefix() + list(cmd), **kw)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Kill processes started here and delete the namespace. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            _kill_group(proc)
        _delete_namespace(self.name)
        atexit.unregister(self.close)

    def __enter__(self) -> ShapedNamespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_shaped(cmd: Sequence[str], rate: str = "1gbit", delay: str | None = None,
               timeout: float | None = None, env: dict[str, str] | None = None, *,
               mtu: int = DEFAULT_MTU, **popen_kw: Any) -> subprocess.CompletedProcess[Any]:
    """Run ``cmd`` in a fresh namespace whose loopback is shaped to ``rate`` (mtu 9000, tbf).

    ``delay`` (e.g. ``"1ms"``) adds a netem delay to every packet (needs the netem qdisc).
    ``mtu`` is the loopback MTU. Other keyword arguments are those of :func:`subprocess.run`
    (``capture_output``, ``text``, ``check``, ``input``, ``cwd``, ...). ``env`` replaces the
    environment, as in :mod:`subprocess`. On timeout the process group is killed and
    :class:`subprocess.TimeoutExpired` is raised. The namespace is always deleted,
    also on errors and KeyboardInterrupt.
    """
    with ShapedNamespace(rate, delay, mtu=mtu) as ns:
        return ns.run(cmd, timeout=timeout, env=env, **popen_kw)


class EmulatedCluster:
    """``hosts`` namespaces joined by full-duplex links of ``rate`` each way through a bridge.

    Host ``i`` lives in namespace ``self.hosts[i]`` with interface ``eth0`` at ``self.addresses[i]``
    (``10.77.0.<i+1>/24``, which exists only inside these namespaces) and loopback up. A tbf on both
    ends of each veth gives every host ``rate`` up *and* ``rate`` down; ``delay`` (netem, on the host
    end only) adds that one-way latency between any two hosts. Traffic between ranks on the same host
    stays on that host's loopback and is not shaped, as on a real machine.

    Use as a context manager. :meth:`close` (also run at interpreter exit as a safety net) kills the
    processes started through :meth:`popen` and deletes all namespaces, which removes the veths.
    """

    def __init__(self, hosts: int, rate: str = "1gbit", delay: str | None = None, *,
                 mtu: int = DEFAULT_MTU, subnet: str = DEFAULT_SUBNET) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"hosts must be between 1 and 250, not {hosts}")
        self.rate = rate
        self.delay = delay
        self.mtu = mtu
        self.rate_bits = parse_rate(rate)
        self.delay_s = parse_time(delay) if delay else None
        base = _new_name()
        self.switch = f"{base}-sw"
        self.hosts: list[str] = [f"{base}-h{i}" for i in range(hosts)]
        self.addresses: list[str] = [f"{subnet}.{i + 1}" for i in range(hosts)]
        self.iface = HOST_IFACE
        self._closed = False
        self._procs: list[subprocess.Popen[Any]] = []
        self._created: list[str] = []
        self._etc_dirs: list[str] = []
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        log.info("emulated cluster %s: %d hosts, rate %s, delay %s", base, hosts, rate, delay)

    def _add_ns(self, ns: str) -> None:
        _ip(None, "netns", "add", ns)
        self._created.append(ns)
        _ip(ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        sw = self.switch
        self._add_ns(sw)
        _ip(sw, "link", "add", "br0", "type", "bridge")
        _ip(sw, "link", "set", "br0", "addrgenmode", "none")
        for i, ns in enumerate(self.hosts):
            port = f"p{i}"
            self._add_ns(ns)
            # The host end is created directly in the host namespace and the peer directly in the
            # switch: no interface ever appears in the root namespace, so parallel runs never clash.
            _ip(ns, "link", "add", HOST_IFACE, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", port, "mtu", str(self.mtu), "netns", sw)
            _ip(ns, "link", "set", HOST_IFACE, "addrgenmode", "none")  # IPv4 only: Gloo picks it
            _ip(sw, "link", "set", port, "addrgenmode", "none")
            _ip(sw, "link", "set", port, "master", "br0")
            _ip(ns, "addr", "add", f"{self.addresses[i]}/24", "dev", HOST_IFACE)
            _shape(ns, HOST_IFACE, self.rate_bits, self.delay_s, self.mtu)  # host upload
            _shape(sw, port, self.rate_bits, None, self.mtu)  # host download
            _ip(sw, "link", "set", port, "up")
            _ip(ns, "link", "set", HOST_IFACE, "up")
        _ip(sw, "link", "set", "br0", "up")
        for i in range(len(self.hosts)):
            self._write_hosts_file(i)

    def _write_hosts_file(self, i: int) -> None:
        """Give host ``i`` its own /etc/hosts (used by ``ip netns exec``) mapping this machine's hostname
        to the host's address, and every host's namespace name to its address.

        Horovod 0.28.1 builds the Gloo device of each process set (the global one included, which
        carries all the collectives) from the address of ``gethostname()``, not from
        ``HOROVOD_GLOO_IFACE``; without this the ranks would advertise 127.0.0.1 and fail to connect.
        """
        d = os.path.join(_ETC_NETNS, self.hosts[i])
        os.makedirs(d, exist_ok=True)
        self._etc_dirs.append(d)
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        for j, (ns, addr) in enumerate(zip(self.hosts, self.addresses)):
            lines.append(f"{addr}\t{ns}" + (f" {socket.gethostname()}" if j == i else ""))
        with open(os.path.join(d, "hosts"), "w", encoding="ascii") as f:
            f.write("\n".join(lines) + "\n")

    def exec_prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command on host ``i``: ``["ip", "netns", "exec", ns]``."""
        return ["ip", "netns", "exec", self.hosts[i]]

    def run(self, i: int, cmd: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """:func:`subprocess.run` on host ``i`` (own process group, killed on return/timeout)."""
        return _run_group(self.exec_prefix(i) + list(cmd), **kw)

    def popen(self, i: int, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """:class:`subprocess.Popen` on host ``i``; its process group is killed by :meth:`close`."""
        proc = _popen(self.exec_prefix(i) + list(cmd), **kw)
        self._procs.append(proc)
        return proc

    def link_bytes(self, i: int) -> tuple[int, int]:
        """Bytes that crossed host ``i``'s link so far: ``(sent up by host i, sent down to host i)``.

        Read from the root qdisc counters (``tc -s qdisc``), so they include packet headers.
        """
        return (_qdisc_bytes(self.hosts[i], HOST_IFACE), _qdisc_bytes(self.switch, f"p{i}"))

    def flow(self, src: int, dst: int) -> TcpFlow:
        """A :class:`TcpFlow` from host ``src`` to host ``dst``, for :func:`measure_tcp_throughput`."""
        return TcpFlow(self.exec_prefix(src), self.exec_prefix(dst), self.addresses[dst])

    def close(self) -> None:
        """Kill processes started here and delete every namespace. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            _kill_group(proc)
        for ns in reversed(self._created):
            _delete_namespace(ns)
        for d in self._etc_dirs:
            shutil.rmtree(d, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> EmulatedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- TCP throughput


class TcpFlow(NamedTuple):
    """One TCP stream: sender argv prefix, receiver argv prefix, receiver address as seen by sender."""

    sender: Sequence[str]
    receiver: Sequence[str]
    address: str


def _read_line(proc: subprocess.Popen[Any], timeout: float, what: str) -> str:
    """First stdout line of a helper, or :class:`NetemError` with its stderr after ``timeout``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        _kill_group(proc)
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
            sinks.append(_popen(list(f.receiver) + _helper_argv(python, "_tcp-sink", str(warmup)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        ports = [_read_line(p, 30.0, "TCP receiver") for p in sinks]
        for f, port in zip(flows, ports):
            sources.append(_popen(list(f.sender) + _helper_argv(
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
            _kill_group(p, grace=0.5)


def _tcp_sink(warmup: float) -> int:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(1)
    sys.stdout.write(f"{srv.getsockname()[1]}\n")
    sys.stdout.flush()
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    total = 0
    t_first = t_mark = t_last = 0.0
    bytes_at_mark = -1
    while True:
        n = conn.recv_into(buf)
        now = time.perf_counter()
        if n == 0:
            break
        if total == 0:
            t_first = now
        if bytes_at_mark < 0 and now - t_first >= warmup:
            t_mark, bytes_at_mark = now, total  # count only what arrives after the warm-up
        total += n
        t_last = now
    conn.close()
    srv.close()
    if bytes_at_mark < 0 or t_last <= t_mark:
        t_mark, bytes_at_mark = t_first, 0
    span = max(t_last - t_mark, 1e-9)
    sys.stdout.write(json.dumps({"bits_per_s": (total - bytes_at_mark) * 8 / span,
                                 "bytes": total, "seconds": span}) + "\n")
    return 0


def _tcp_source(address: str, port: int, seconds: float) -> int:
    sock = socket.create_connection((address, port), timeout=30)
    chunk = memoryview(bytes(1 << 20))
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sock.sendall(chunk)
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(60)
    while sock.recv(65536):  # wait until the receiver has everything and closes
        pass
    sock.close()
    return 0


# --------------------------------------------------------------------------- Horovod


class HorovodTimeout(subprocess.TimeoutExpired):
    """A Horovod job launched by :func:`launch_horovod` did not finish in time.

    ``results`` holds every rank's :class:`subprocess.CompletedProcess` (killed ranks have a negative
    return code); the message contains every rank's output.
    """

    def __init__(self, cmd: Sequence[str], timeout: float,
                 results: list[subprocess.CompletedProcess[str]]) -> None:
        super().__init__(list(cmd), timeout)
        self.results = results

    def __str__(self) -> str:
        return (f"Horovod job {' '.join(map(str, self.cmd))!r} timed out after {self.timeout:g} s; "
                f"all ranks killed.\n{format_rank_output(self.results)}")


def format_rank_output(results: Sequence[subprocess.CompletedProcess[str]]) -> str:
    """Every rank's return code, stdout and stderr as one readable block."""
    parts = []
    for rank, r in enumerate(results):
        parts.append(f"--- rank {rank}: exit {r.returncode} ---\n"
                     f"[stdout]\n{r.stdout or ''}\n[stderr]\n{r.stderr or ''}")
    return "\n".join(parts)


def _serve_rendezvous(plan_json: str) -> int:
    """Helper process: Horovod's RendezvousServer for ``plan`` until stdin closes."""
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousServer

    plan = [SlotInfo(**slot) for slot in json.loads(plan_json)]
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    sys.stdout.write(f"{port}\n")
    sys.stdout.flush()
    with contextlib.suppress(KeyboardInterrupt):
        sys.stdin.read()  # EOF when the launcher closes the pipe or dies
    server.stop()
    return 0


class _Tail:
    """Echo new complete lines of a growing output file with a prefix (for ``echo=True``)."""

    def __init__(self, f: IO[bytes], prefix: str, out: IO[str]) -> None:
        self.f, self.prefix, self.out, self.pos, self.partial = f, prefix, out, 0, b""

    def poll(self, final: bool = False) -> None:
        data = os.pread(self.f.fileno(), 1 << 20, self.pos)
        while data:
            self.pos += len(data)
            self.partial += data
            data = os.pread(self.f.fileno(), 1 << 20, self.pos)
        *lines, self.partial = self.partial.split(b"\n")
        if final and self.partial:
            lines, self.partial = lines + [self.partial], b""
        for line in lines:
            self.out.write(f"{self.prefix}{line.decode('utf-8', 'replace')}\n")
        if lines:
            self.out.flush()


def _read_all(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read().decode("utf-8", "replace")


def launch_horovod(cluster: EmulatedCluster, procs_per_host: int, cmd: Sequence[str],
                   env: dict[str, str] | None = None, timeout: float | None = None, *,
                   check: bool = False, echo: bool = False, python: str = sys.executable,
                   fail_grace: float = 5.0) -> list[subprocess.CompletedProcess[str]]:
    """Run a Horovod (Gloo) job with ``procs_per_host`` ranks on each host of ``cluster``.

    Ranks are numbered host by host (ranks 0..P-1 on host 0, ...), as ``horovodrun -H`` does. Horovod's
    ``RendezvousServer`` runs in a helper process (``python``) inside host 0's namespace, reachable at
    ``cluster.addresses[0]``; every rank runs ``ip netns exec <host ns> cmd...`` with the environment of
    this process, ``env`` on top, and the variables ``horovodrun --gloo`` sets: HOROVOD_RANK / SIZE /
    LOCAL_RANK / LOCAL_SIZE / CROSS_RANK / CROSS_SIZE / HOSTNAME, HOROVOD_CONTROLLER=gloo,
    HOROVOD_CPU_OPERATIONS=gloo, HOROVOD_GLOO_IFACE=eth0, HOROVOD_GLOO_RENDEZVOUS_ADDR / PORT.
    So all traffic between hosts crosses the shaped links. ``cmd[0]`` must be able to import Horovod
    (pass ``sys.executable``).

    Returns one :class:`subprocess.CompletedProcess` per rank (text stdout/stderr). When a rank fails,
    the others get ``fail_grace`` seconds, then are killed (as ``horovodrun`` does). ``check=True``
    raises :class:`subprocess.CalledProcessError` for the first failed rank, with all output in the
    message. After ``timeout`` seconds every rank is killed and :class:`HorovodTimeout` is raised with
    every rank's output. ``echo=True`` also copies rank output live to stdout/stderr as ``[rank]: ...``.
    """
    if procs_per_host < 1:
        raise ValueError("procs_per_host must be at least 1")
    n_hosts = len(cluster.hosts)
    size = n_hosts * procs_per_host
    plan = [{"hostname": cluster.hosts[h], "rank": h * procs_per_host + lr, "local_rank": lr,
             "cross_rank": h, "size": size, "local_size": procs_per_host, "cross_size": n_hosts}
            for h in range(n_hosts) for lr in range(procs_per_host)]
    cmd = list(cmd)
    start = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    files: list[tuple[IO[bytes], IO[bytes]]] = []
    tails: list[_Tail] = []
    rdv: subprocess.Popen[str] | None = None
    try:
        rdv = cluster.popen(0, _helper_argv(python, "_rendezvous", json.dumps(plan)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
        port = _read_line(rdv, 60.0, "Horovod rendezvous server")
        if not port.isdigit():
            raise NetemError(f"Horovod rendezvous server printed {port!r} instead of its port")
        base_env = dict(os.environ)
        base_env.update({
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": cluster.addresses[0],
            "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": cluster.iface,
            "NCCL_SOCKET_IFNAME": cluster.iface,
            "PYTHONUNBUFFERED": "1",
        })
        base_env.setdefault("OMP_NUM_THREADS", "1")
        base_env.update(env or {})
        for slot in plan:
            rank_env = dict(base_env)
            rank_env.update({
                "HOROVOD_HOSTNAME": str(slot["hostname"]),
                "HOROVOD_RANK": str(slot["rank"]),
                "HOROVOD_SIZE": str(size),
                "HOROVOD_LOCAL_RANK": str(slot["local_rank"]),
                "HOROVOD_LOCAL_SIZE": str(procs_per_host),
                "HOROVOD_CROSS_RANK": str(slot["cross_rank"]),
                "HOROVOD_CROSS_SIZE": str(n_hosts),
            })
            out_f, err_f = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            files.append((out_f, err_f))
            if echo:
                tails += [_Tail(out_f, f"[{slot['rank']}]: ", sys.stdout),
                          _Tail(err_f, f"[{slot['rank']}]: ", sys.stderr)]
            host = int(slot["cross_rank"])
            procs.append(cluster.popen(host, cmd, env=rank_env, stdin=subprocess.DEVNULL,
                                       stdout=out_f, stderr=err_f))
            log.debug("started rank %s on %s", slot["rank"], cluster.hosts[host])

        failed_at: float | None = None
        timed_out = False
        while True:
            codes = [p.poll() for p in procs]
            for t in tails:
                t.poll()
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is None and any(c for c in codes):
                failed_at = now
                log.info("a rank failed; stopping the others in %.0f s", fail_grace)
            if failed_at is not None and now - failed_at > fail_grace:
                for p in procs:
                    _kill_group(p)
                continue
            if timeout is not None and now - start > timeout:
                timed_out = True
                for p in procs:
                    _kill_group(p)
                break
            time.sleep(0.05)
        for t in tails:
            t.poll(final=True)
        results = [subprocess.CompletedProcess(p.args, p.wait(), _read_all(o), _read_all(e))
                   for p, (o, e) in zip(procs, files)]
        if timed_out:
            assert timeout is not None
            raise HorovodTimeout(cmd, timeout, results)
        if check:
            for r in results:
                if r.returncode:
                    raise subprocess.CalledProcessError(
                        r.returncode, r.args, output=format_rank_output(results), stderr=None)
        return results
    finally:
        for p in procs:
            _kill_group(p, grace=0.5)
        if rdv is not None:
            with contextlib.suppress(OSError):
                if rdv.stdin is not None:
                    rdv.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                rdv.wait(timeout=5)
            _kill_group(rdv, grace=0.5)
            for stream in (rdv.stdout, rdv.stderr):
                if stream is not None:
                    stream.close()
        for out_f, err_f in files:
            out_f.close()
            err_f.close()


# --------------------------------------------------------------------------- command line


def _helper_main(argv: list[str]) -> int:
    """Entry point of the helper processes this module starts inside namespaces."""
    kind, args = argv[0], argv[1:]
    if kind == "_tcp-sink":
        return _tcp_sink(float(args[0]))
    if kind == "_tcp-source":
        return _tcp_source(args[0], int(args[1]), float(args[2]))
    if kind == "_rendezvous":
        return _serve_rendezvous(args[0])
    raise SystemExit(f"unknown helper {kind!r}")


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


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m crossover.netem",
        description="Run a command, or a Horovod job, over an emulated network of chosen bandwidth "
                    "(Linux network namespaces shaped with tc; needs root).",
        epilog="examples:\n"
               "  python -m crossover.netem --rate 200mbit -- python bench.py\n"
               "  python -m crossover.netem --hosts 2 --procs-per-host 1 --rate 1gbit -- python train.py\n"
               "  python -m crossover.netem --hosts 2 --rate 200mbit --measure\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="link rate in tc units (default: %(default)s)")
    p.add_argument("--delay", default=None,
                   help="added one-way delay, e.g. 1ms (needs the kernel's netem qdisc)")
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU, help="link MTU (default: %(default)s)")
    p.add_argument("--hosts", type=int, default=None,
                   help="emulate this many hosts (one namespace each, full-duplex links of --rate) and "
                        "run CMD as a Horovod job over them; without it CMD runs once in one namespace "
                        "with a shaped loopback")
    p.add_argument("--procs-per-host", type=int, default=1, help="Horovod ranks per host (default: 1)")
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
    """Command-line entry point (``python -m crossover.netem``, console script ``crossover-netem``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_tcp-sink", "_tcp-source", "_rendezvous"):
        return _helper_main(argv)
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
        sys.stderr.write(f"crossover.netem: {reason}\n")
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
            sys.stderr.write(f"crossover.netem: rank exit codes {codes}\n")
        return failed[0] if failed and failed[0] > 0 else (1 if failed else 0)
    except subprocess.TimeoutExpired as exc:
        if not isinstance(exc, HorovodTimeout):
            sys.stderr.write(f"crossover.netem: timed out after {exc.timeout:g} s\n")
        else:
            sys.stderr.write(f"crossover.netem: Horovod job timed out after {exc.timeout:g} s\n")
        return 124
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        return 143


if __name__ == "__main__":
    sys.exit(main())
