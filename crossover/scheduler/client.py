"""Client side of the crossover scheduler: one connection from a worker to its host's daemon.

:class:`SchedulerClient` never stops a job. When the daemon is not running it starts one (a detached
``python -m crossover.scheduler.daemon``; the daemon's lock makes concurrent starts safe). When the
daemon dies, does not answer, or sends something invalid, the client logs a warning once, and its
:meth:`~SchedulerClient.acquire` returns ``False`` at once (the job runs uncoordinated); at most every
``retry_s`` seconds it tries to re-attach (starting a new daemon if none runs) and logs when it has.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from crossover.scheduler import paths
from crossover.scheduler.protocol import CLIENT_OPS, HEADER, SERVER_OPS, VERSION, Decoder, ProtocolError, encode

__all__ = ["SchedulerClient", "spawn_daemon"]

log = logging.getLogger(__name__)

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spawned: list[subprocess.Popen[bytes]] = []


def spawn_daemon(directory: str, extra_args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """Start a detached daemon for ``directory`` (its own session; output appended to ``daemon.log``).

    Safe to call when one already runs: the new process finds the lock taken and exits at once.
    The daemon reads its settings from the environment (``CROSSOVER_LEASE_S``, ``CROSSOVER_ALIGN_MS``,
    ``CROSSOVER_SCHED_IDLE_EXIT``, ``CROSSOVER_SCHED_TRACE``).
    """
    for p in list(_spawned):  # reap daemons that exited (e.g. lost the race)
        if p.poll() is not None:
            _spawned.remove(p)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if x)
    with open(os.path.join(directory, paths.LOG_NAME), "ab") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "crossover.scheduler.daemon", "--dir", directory,
                                 *extra_args], stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env,
                                cwd="/", start_new_session=True, close_fds=True)
    _spawned.append(proc)
    log.info("started a crossover scheduler daemon (pid %d) for %s", proc.pid, directory)
    return proc


@functools.lru_cache(maxsize=64)
def _quoted(dev: str) -> str:
    encode({"op": "release", "dev": dev}, CLIENT_OPS)  # validates the device name once
    return json.dumps(dev)


def _frame_acquire(req: int, dev: str, seq: int) -> bytes:
    """The acquire frame, formatted directly (the hot path: no JSON encoder call)."""
    body = f'{{"op":"acquire","id":{int(req)},"dev":{_quoted(dev)},"seq":{int(seq)}}}'.encode()
    return HEADER.pack(len(body)) + body


def _frame_release(dev: str) -> bytes:
    body = f'{{"op":"release","dev":{_quoted(dev)}}}'.encode()
    return HEADER.pack(len(body)) + body


def _forget_in_child(ref: weakref.ref[SchedulerClient]) -> None:
    client = ref()
    if client is not None:
        client._after_fork()


class SchedulerClient:
    """A worker's connection to the scheduler daemon of its host (thread-safe, never raises on I/O).

    ``job`` names the job (every worker of one job must use the same name on every host), ``member``
    this worker (e.g. ``rank3``), ``weight`` the job's share when several jobs wait.
    """

    def __init__(self, job: str, member: str, weight: float = 1.0, directory: str | None = None, *,
                 autostart: bool = True, retry_s: float = 1.0, acquire_timeout: float | None = None) -> None:
        self.job = job
        self.member = member
        self.weight = weight
        self.directory = paths.secure_dir(directory)
        self.sock_path = paths.socket_path(self.directory)
        self.autostart = autostart
        self.retry_s = retry_s
        self.acquire_timeout = acquire_timeout
        self.lease_s: float | None = None
        self.daemon_pid: int | None = None
        self._sock: socket.socket | None = None
        self._decoder = Decoder(SERVER_OPS)
        self._pending: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._next_try = 0.0
        self._warned = False
        self._attached_once = False
        self._pid = os.getpid()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))

    def _after_fork(self) -> None:
        """In a forked child (e.g. a DataLoader worker): drop the copy of the connection, never use it.

        Otherwise the parent's turn would survive the parent's death as long as the child lives.
        """
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()  # closes this process's descriptor only; the parent stays connected
            self._sock = None
        self.autostart = False

    # ------------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        """Whether a daemon connection is open (turns are coordinated)."""
        return self._sock is not None

    def connect(self, wait: float = 5.0) -> bool:
        """Connect (starting a daemon if none runs), trying for up to ``wait`` seconds."""
        with self._lock:
            if self._sock is not None:
                return True
            deadline = time.monotonic() + wait
            spawned = False
            while True:
                if self._try_connect():
                    return True
                if self.autostart and not spawned:
                    self._spawn()
                    spawned = True
                if time.monotonic() >= deadline:
                    self._lost("no scheduler daemon answers on " + self.sock_path)
                    return False
                time.sleep(0.02)

    def _spawn(self) -> None:
        if any(p.poll() is None for p in _spawned):
            return  # the daemon we started is still starting up (or serving): do not pile up more
        try:
            spawn_daemon(self.directory)
        except OSError as exc:
            log.warning("cannot start the crossover scheduler daemon: %s", exc)

    def _try_connect(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(5.0)
            sock.connect(self.sock_path)
            self._sock = sock
            self._decoder = Decoder(SERVER_OPS)
            self._pending = []
            self._send({"op": "hello", "v": VERSION, "job": self.job, "member": self.member,
                        "weight": float(self.weight), "pid": os.getpid()})
            welcome = self._recv_until(lambda m: m["op"] == "welcome", 5.0)
        except (OSError, ProtocolError, TimeoutError) as exc:
            sock.close()
            self._sock = None
            log.debug("connect to %s failed: %s", self.sock_path, exc)
            return False
        self.lease_s = float(welcome["lease"])
        self.daemon_pid = int(welcome["pid"])
        if self._warned or self._attached_once:
            log.warning("crossover scheduler: re-attached to daemon %d on %s; turns are coordinated again",
                        self.daemon_pid, self.sock_path)
        else:
            log.info("crossover scheduler: job %s member %s attached to daemon %d on %s",
                     self.job, self.member, self.daemon_pid, self.sock_path)
        self._warned = False
        self._attached_once = True
        return True

    def _maybe_reconnect(self) -> bool:
        if os.getpid() != self._pid:
            return False  # a forked child never talks to the daemon
        now = time.monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + self.retry_s
        if self._try_connect():
            return True
        if self.autostart:
            self._spawn()  # connect on a later call: never block the job waiting for it
        return False

    def _lost(self, why: str) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        self._next_try = time.monotonic() + self.retry_s
        if not self._warned:
            log.warning("crossover scheduler: %s; continuing uncoordinated (will try to re-attach every %.3g s)",
                        why, self.retry_s)
            self._warned = True

    def close(self) -> None:
        """Close the connection (the daemon then releases whatever this worker held)."""
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
                self._sock = None

    # ------------------------------------------------------------------ low level

    def _send(self, msg: dict[str, Any]) -> None:
        assert self._sock is not None
        self._sock.sendall(encode(msg))

    def _recv_until(self, match: Any, timeout: float | None) -> dict[str, Any]:
        """Read messages until ``match(msg)``; others are kept for later. Raises on error/EOF/timeout."""
        assert self._sock is not None
        for i, m in enumerate(self._pending):
            if match(m):
                return self._pending.pop(i)
        deadline = None if timeout is None else time.monotonic() + timeout
        first = True
        while True:
            want = timeout
            if timeout is not None and not first:
                assert deadline is not None
                want = deadline - time.monotonic()
                if want <= 0:
                    raise TimeoutError("no reply from the scheduler daemon")
            if self._sock.gettimeout() != want:  # unchanged in the usual case: no extra syscall
                self._sock.settimeout(want)
            first = False
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("the scheduler daemon closed the connection")
            for m in self._decoder.feed(data):
                if m["op"] == "error":
                    raise ConnectionError(f"the scheduler daemon reported: {m['msg']}")
                if match(m):
                    return m
                self._pending.append(m)

    # ------------------------------------------------------------------ requests

    def acquire(self, dev: str, seq: int) -> bool:
        """Block until this worker's job has ``dev`` for step ``seq``. False: not coordinated (no daemon)."""
        with self._lock:
            if self._sock is None and not self._maybe_reconnect():
                return False
            req = next(self._ids)
            timeout = self.acquire_timeout
            if timeout is None:
                timeout = 4.0 * (self.lease_s or 10.0) + 5.0
            try:
                self._sock.sendall(_frame_acquire(req, dev, seq))
                self._recv_until(lambda m: m["op"] == "grant" and m["id"] == req, timeout)
            except TimeoutError:
                self._lost(f"no grant for {dev} within {timeout:.3g} s")
                return False
            except (OSError, ProtocolError) as exc:
                self._lost(f"lost the daemon ({exc})")
                return False
            return True

    def release(self, dev: str) -> None:
        """Give ``dev`` back (no reply is awaited)."""
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.sendall(_frame_release(dev))
            except OSError as exc:
                self._lost(f"lost the daemon ({exc})")

    def ping(self) -> float | None:
        """Round-trip time to the daemon in seconds, or None when not connected."""
        with self._lock:
            if self._sock is None and not self._maybe_reconnect():
                return None
            req = next(self._ids)
            t0 = time.perf_counter()
            try:
                self._send({"op": "ping", "id": req})
                self._recv_until(lambda m: m["op"] == "pong" and m["id"] == req, 5.0)
            except (OSError, ProtocolError) as exc:
                self._lost(f"lost the daemon ({exc})")
                return None
            return time.perf_counter() - t0

    def status(self) -> dict[str, Any] | None:
        """The daemon's view of devices, turns and jobs, or None when not connected."""
        with self._lock:
            if self._sock is None and not self._maybe_reconnect():
                return None
            req = next(self._ids)
            try:
                self._send({"op": "status", "id": req})
                return self._recv_until(lambda m: m["op"] == "status" and m["id"] == req, 5.0)["state"]
            except (OSError, ProtocolError) as exc:
                self._lost(f"lost the daemon ({exc})")
                return None

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
