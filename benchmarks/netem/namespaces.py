"""Network namespaces shaped with ``tc``: one shaped loopback, or a cluster of hosts behind a switch.

* :func:`run_shaped` / :class:`ShapedNamespace`: one namespace whose loopback is shaped. Every
  process inside shares one medium of ``rate`` (loopback carries both directions).
* :class:`EmulatedCluster`: one namespace per host, joined through a bridge in a "switch" namespace
  by veth pairs. Each host has its own full-duplex link: ``rate`` up and ``rate`` down (a ``tbf`` on
  both veth ends; ``netem`` adds a delay where the kernel has it). The host end is called ``eth0`` in
  every host namespace and has the address ``10.77.0.<i+1>/24``.

Processes started inside run in their own process group (:mod:`crossover.procgroup`) and are killed
with it when the namespace is closed; closing also deletes the namespaces (and so the veths), on
errors, timeouts, Ctrl-C and, as a safety net, at interpreter exit. :func:`netem_unavailable_reason`
says why this cannot work here (no root, no ``ip``/``tc``, missing qdiscs), for ``pytest.skip``.
Stdlib only (plus :mod:`crossover.procgroup`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence, TypeVar

from crossover import procgroup

from .errors import NetemError
from .measure import TcpFlow
from .units import fmt_rate, fmt_time, parse_rate, parse_time

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MTU",
    "DEFAULT_SUBNET",
    "HOST_IFACE",
    "NS_PREFIX",
    "EmulatedCluster",
    "NetemError",
    "ShapedNamespace",
    "cleanup_stale_namespaces",
    "list_namespaces",
    "netem_unavailable_reason",
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
    return ["tbf", "rate", fmt_rate(rate_bits), "burst", str(burst), "limit", str(limit)]


def _shape(ns: str, dev: str, rate_bits: float, delay_s: float | None, mtu: int) -> None:
    """Put the egress shaping on ``dev`` in ``ns``: tbf alone, or netem (delay) with a tbf child."""
    if not delay_s:
        _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *_tbf_args(rate_bits, mtu))
        return
    try:
        _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
            "delay", fmt_time(delay_s), "limit", str(_NETEM_LIMIT))
    except NetemError as exc:
        raise NetemError(f"cannot emulate a delay (does the kernel have the netem qdisc?): {exc}") from exc
    _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *_tbf_args(rate_bits, mtu))


def _qdisc_bytes(ns: str, dev: str) -> int:
    """Bytes sent so far through the root qdisc of ``dev`` in ``ns``."""
    for q in json.loads(_tc(ns, "-s", "-j", "qdisc", "show", "dev", dev) or "[]"):
        if q.get("root"):
            return int(q.get("bytes", 0))
    raise NetemError(f"no root qdisc on {dev} in {ns}")


_Owned = TypeVar("_Owned", bound="_Namespaces")


class _Namespaces:
    """Namespaces this process made and the processes started in them; :meth:`close` kills and deletes them."""

    def __init__(self) -> None:
        self._closed = False
        self._procs: list[subprocess.Popen[Any]] = []
        atexit.register(self.close)

    def _delete(self) -> None:
        """Delete the namespaces (and what else they left on disk); :meth:`close` calls it once."""
        raise NotImplementedError

    def close(self) -> None:
        """Kill processes started here and delete the namespaces. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            procgroup.terminate(proc)
        self._delete()
        atexit.unregister(self.close)

    def __enter__(self: _Owned) -> _Owned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShapedNamespace(_Namespaces):
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
        rate_bits = parse_rate(rate)
        delay_s = parse_time(delay) if delay else None
        super().__init__()
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
        return procgroup.run(self.exec_prefix() + list(cmd), **kw)

    def popen(self, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """:class:`subprocess.Popen` inside the namespace; the process group is killed by :meth:`close`."""
        proc = procgroup.start(self.exec_prefix() + list(cmd), **kw)
        self._procs.append(proc)
        return proc

    def _delete(self) -> None:
        _delete_namespace(self.name)


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


class EmulatedCluster(_Namespaces):
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
        self._created: list[str] = []
        self._etc_dirs: list[str] = []
        super().__init__()
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
        return procgroup.run(self.exec_prefix(i) + list(cmd), **kw)

    def popen(self, i: int, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """:class:`subprocess.Popen` on host ``i``; its process group is killed by :meth:`close`."""
        proc = procgroup.start(self.exec_prefix(i) + list(cmd), **kw)
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

    def _delete(self) -> None:
        for ns in reversed(self._created):
            _delete_namespace(ns)
        for d in self._etc_dirs:
            shutil.rmtree(d, ignore_errors=True)

