"""Client side of the crossover scheduler: one connection from a worker to its host's daemon.

:class:`SchedulerClient` never stops a job. When the daemon is not running it starts one (a detached
``python -m crossover.scheduler.daemon``; the daemon's lock makes concurrent starts safe). When the
daemon dies, does not answer, or sends something invalid, the client logs a warning once, and its
:meth:`~SchedulerClient.acquire` returns ``False`` at once (the job runs uncoordinated). Re-attaching
happens in a background thread, never inside a training step: at most every ``retry_s`` seconds
(spaced out up to :data:`RETRY_MAX_S` while the daemon accepts but does not answer), starting a new
daemon if none runs; the client logs when it has re-attached.

A daemon that stops answering is noticed quickly: while an acquire waits for its grant, the client
pings the daemon after ``probe_s`` (1 s) without news and gives up when the pong does not come within
``reply_timeout`` (2 s); a legitimate wait (another job's turn, up to the lease) keeps being answered.

The client only talks to a daemon of its own user (or root): right after connecting, before sending
anything, it checks the listening process's uid (``SO_PEERCRED``). A socket of another user is treated
as "no daemon" (one warning; a daemon started on demand replaces the socket).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from crossover.scheduler import paths, settings
from crossover.scheduler.protocol import CLIENT_OPS, HEADER, SERVER_OPS, VERSION, Decoder, ProtocolError, encode

__all__ = ["SchedulerClient", "spawn_daemon", "ForeignDaemonError"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0  # connect + welcome: a live daemon answers in microseconds
RETRY_MAX_S = 10.0
# A daemon we started that exits with an error (it cannot start, or crashed) is started again only after a pause
# doubling from 1 s to 60 s: a broken set-up costs a few starts a minute, not one per worker per second.
SPAWN_BACKOFF_MIN_S = 1.0
SPAWN_BACKOFF_MAX_S = 60.0
_UCRED = struct.Struct("3i")
_spawn_lock = threading.Lock()
_spawn_backoff: dict[str, list[float]] = {}  # directory -> [pause, next start allowed], for all clients of a process

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spawned: dict[str, list[subprocess.Popen[bytes]]] = {}  # directory -> daemons this process started


def spawn_daemon(directory: str, extra_args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """Start a detached daemon for ``directory`` (its own session; output appended to ``daemon.log``).

    Safe to call when one already runs: the new process finds the lock taken and exits at once.
    The daemon reads its settings from the environment (``CROSSOVER_LEASE_S``, ``CROSSOVER_ALIGN_MS``,
    ``CROSSOVER_SCHED_IDLE_EXIT``, ``CROSSOVER_SCHED_TRACE``).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if x)
    # never through a planted symlink (raises SchedulerDirError, an OSError-free refusal the caller logs)
    fd = paths.open_own_file(os.path.join(directory, paths.LOG_NAME), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        with _spawn_lock:
            proc = subprocess.Popen([sys.executable, "-m", "crossover.scheduler.daemon", "--dir", directory,
                                     *extra_args], stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=env,
                                    cwd="/", start_new_session=True, close_fds=True)
            _spawned.setdefault(directory, []).append(proc)
    finally:
        os.close(fd)
    log.info("started a crossover scheduler daemon (pid %d) for %s", proc.pid, directory)
    return proc


def _log_tail(directory: str) -> str:
    """The last line of the daemon's log (why it stopped), or '' (never through a symbolic link)."""
    try:
        fd = paths.open_own_file(os.path.join(directory, paths.LOG_NAME), os.O_RDONLY)
    except (OSError, paths.SchedulerDirError):
        return ""
    with open(fd, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
        lines = [x for x in f.read().decode("utf-8", "replace").splitlines() if x.strip()]
    return lines[-1][:400] if lines else ""


def _spawn_allowed(directory: str) -> bool:
    """Whether a daemon may be started now (the caller holds ``_spawn_lock``). A daemon of ours that exited with
    an error since the last call doubles the pause before the next start, logged once with the reason."""
    ours = _spawned.setdefault(directory, [])
    backoff = _spawn_backoff.setdefault(directory, [0.0, 0.0])
    for p in list(ours):
        code = p.poll()
        if code is None:
            return False  # the daemon we started is still starting up (or serving): do not pile up more
        ours.remove(p)
        if code != 0:  # 0: it lost the race to another daemon, which serves
            delay = backoff[0] = min(SPAWN_BACKOFF_MAX_S, max(SPAWN_BACKOFF_MIN_S, 2 * backoff[0]))
            backoff[1] = time.monotonic() + delay
            tail = _log_tail(directory)
            log.warning("crossover scheduler: the daemon we started (pid %d) exited with status %d%s; not starting "
                        "another for %.3g s (running uncoordinated meanwhile)", p.pid, code,
                        f" ({tail})" if tail else f" (see {os.path.join(directory, paths.LOG_NAME)})", delay)
    return time.monotonic() >= backoff[1]


def _spawn_succeeded(directory: str) -> None:
    """A daemon answered: the next failure starts the back-off from its minimum again."""
    _spawn_backoff.pop(directory, None)


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


class ForeignDaemonError(ConnectionError):
    """The socket is served by a process of another user: not our daemon."""


class _Hung(TimeoutError):
    """The daemon accepted or holds the connection but does not answer."""


class _Channel:
    """One open connection to the daemon: socket, frame decoder, replies kept for later."""

    __slots__ = ("sock", "decoder", "pending")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = Decoder(SERVER_OPS)
        self.pending: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(encode(msg))

    def recv_until(self, match: Any, timeout: float) -> dict[str, Any]:
        """Read messages until ``match(msg)``; others are kept (unawaited pongs dropped). Raises on
        error/EOF, :class:`_Hung` on time-out."""
        for i, m in enumerate(self.pending):
            if match(m):
                return self.pending.pop(i)
        deadline = time.monotonic() + timeout
        want = timeout
        while True:
            if self.sock.gettimeout() != want:  # unchanged in the usual case: no extra syscall
                self.sock.settimeout(want)
            try:
                data = self.sock.recv(65536)
            except socket.timeout:  # TimeoutError from Python 3.10 on
                raise _Hung(f"no reply within {timeout:.3g} s") from None
            if not data:
                raise ConnectionError("the scheduler daemon closed the connection")
            for m in self.decoder.feed(data):
                if m["op"] == "error":
                    raise ConnectionError(f"the scheduler daemon reported: {m['msg']}")
                if match(m):
                    return m
                if m["op"] != "pong":
                    self.pending.append(m)
            want = deadline - time.monotonic()
            if want <= 0:
                raise _Hung(f"no reply within {timeout:.3g} s")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _peer_uid(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process that listens on the other end of a connected Unix socket."""
    pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


def _forget_in_child(ref: weakref.ref[SchedulerClient]) -> None:
    client = ref()
    if client is not None:
        client._after_fork()


class SchedulerClient:
    """A worker's connection to the scheduler daemon of its host (thread-safe, never raises on I/O).

    ``job`` names the job (every worker of one job must use the same name on every host), ``member``
    this worker (e.g. ``rank3``), ``weight`` the job's share when several jobs wait. ``acquire_timeout``
    bounds one acquire (default ``4 x lease + 5`` s); ``probe_s`` and ``reply_timeout`` set how fast a
    daemon that stopped answering is noticed (see the module docstring).
    """

    def __init__(self, job: str, member: str, weight: float = 1.0, directory: str | None = None, *,
                 autostart: bool = True, retry_s: float = 1.0, acquire_timeout: float | None = None,
                 probe_s: float = 1.0, reply_timeout: float = 2.0) -> None:
        self.job = job
        self.member = member
        self.weight = settings.WEIGHT.parse(weight, "weight")  # refused here, not at the first hello
        self.directory = paths.secure_dir(directory)
        self.sock_path = paths.socket_path(self.directory)
        self.autostart = autostart
        self.retry_s = retry_s
        self.acquire_timeout = acquire_timeout
        self.probe_s = probe_s
        self.reply_timeout = reply_timeout
        self.lease_s: float | None = None
        self.daemon_pid: int | None = None
        self._ch: _Channel | None = None
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._next_try = 0.0
        self._retry_delay = retry_s
        self._attacher: threading.Thread | None = None
        self._closed = False
        self._warned = False
        self._warned_foreign = False
        self._attached_once = False
        self._pid = os.getpid()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))

    def _after_fork(self) -> None:
        """In a forked child (e.g. a DataLoader worker): drop the copy of the connection, never use it.

        Otherwise the parent's turn would survive the parent's death as long as the child lives.
        """
        self._lock = threading.RLock()  # the parent's may have been held by a thread that is not here
        self._attacher = None
        if self._ch is not None:
            self._ch.close()  # closes this process's descriptor only; the parent stays connected
            self._ch = None
        self.autostart = False

    # ------------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        """Whether a daemon connection is open (turns are coordinated)."""
        return self._ch is not None

    def connect(self, wait: float = 5.0) -> bool:
        """Connect (starting a daemon if none runs), trying for up to ``wait`` seconds."""
        with self._lock:
            self._closed = False
            if self._ch is not None:
                return True
            deadline = time.monotonic() + wait
            spawned = False
            proc: subprocess.Popen[bytes] | None = None
            while True:
                try:
                    self._install(*self._handshake())
                    return True
                except _Hung as exc:  # a daemon holds the socket but does not answer: do not wait for it
                    self._lost(f"the daemon on {self.sock_path} does not answer ({exc})")
                    return False
                except (OSError, ProtocolError) as exc:
                    self._note_failure(exc)
                    if self.autostart and not spawned:
                        proc = self._spawn()
                        spawned = True
                    elif proc is not None and proc.poll() not in (None, 0):  # it died at start: no use waiting
                        with _spawn_lock:
                            _spawn_allowed(self.directory)  # logs why, starts the back-off
                        self._lost("the scheduler daemon could not start")
                        return False
                if time.monotonic() >= deadline:
                    self._lost("no scheduler daemon answers on " + self.sock_path)
                    return False
                time.sleep(0.02)

    def _spawn(self) -> subprocess.Popen[bytes] | None:
        """Start a daemon unless ours is still running or the back-off after a failed one is not over."""
        with _spawn_lock:
            if not _spawn_allowed(self.directory):
                return None
        try:
            return spawn_daemon(self.directory)
        except (OSError, paths.SchedulerDirError) as exc:
            log.warning("cannot start the crossover scheduler daemon: %s", exc)
            return None

    def _handshake(self) -> tuple[_Channel, dict[str, Any]]:
        """Connect, check that the daemon is of our user, say hello, read the welcome. Touches no state."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ch = _Channel(sock)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            try:
                sock.connect(self.sock_path)
            except socket.timeout:  # the listen queue is full: a daemon that does not accept
                raise _Hung("the daemon does not accept connections") from None
            pid, uid = _peer_uid(sock)
            if uid not in (os.geteuid(), 0):  # before sending anything: no job names to a stranger
                raise ForeignDaemonError(f"{self.sock_path} is served by pid {pid} of uid {uid}, not by this "
                                         f"user ({os.geteuid()})")
            ch.send({"op": "hello", "v": VERSION, "job": self.job, "member": self.member,
                     "weight": float(self.weight), "pid": os.getpid()})
            welcome = ch.recv_until(lambda m: m["op"] == "welcome", CONNECT_TIMEOUT_S)
        except BaseException:
            ch.close()
            raise
        return ch, welcome

    def _install(self, ch: _Channel, welcome: dict[str, Any]) -> None:
        """Use a fresh connection (the caller holds the lock and has none)."""
        self._ch = ch
        _spawn_succeeded(self.directory)
        self.lease_s = float(welcome["lease"])
        self.daemon_pid = int(welcome["pid"])
        self._retry_delay = self.retry_s
        if self._warned or self._attached_once:
            log.warning("crossover scheduler: re-attached to daemon %d on %s; turns are coordinated again",
                        self.daemon_pid, self.sock_path)
        else:
            log.info("crossover scheduler: job %s member %s attached to daemon %d on %s",
                     self.job, self.member, self.daemon_pid, self.sock_path)
        self._warned = False
        self._attached_once = True

    def _note_failure(self, exc: BaseException) -> None:
        if isinstance(exc, ForeignDaemonError):
            if not self._warned_foreign:
                log.warning("crossover scheduler: %s; ignoring it (no daemon of ours: running uncoordinated%s)",
                            exc, ", starting our own" if self.autostart else "")
                self._warned_foreign = True
        else:
            log.debug("connect to %s failed: %s", self.sock_path, exc)

    def _reattach_later(self) -> None:
        """Start one background attempt to re-attach when one is due; never blocks the caller."""
        if self._closed or os.getpid() != self._pid:
            return  # closed, or a forked child: never talks to the daemon
        now = time.monotonic()
        if now < self._next_try or (self._attacher is not None and self._attacher.is_alive()):
            return
        self._next_try = float("inf")  # set again when the attempt ends
        self._attacher = threading.Thread(target=self._attach_attempt, name="crossover-reattach", daemon=True)
        self._attacher.start()

    def _attach_attempt(self) -> None:
        delay = self.retry_s
        try:
            ch, welcome = self._handshake()
        except _Hung as exc:  # accepts (or queues) but does not answer: space the attempts out
            log.debug("re-attach to %s: %s", self.sock_path, exc)
            delay = self._retry_delay = min(max(RETRY_MAX_S, self.retry_s), 2 * self._retry_delay)
        except (OSError, ProtocolError) as exc:  # none (or not ours): start one, connect on a later attempt
            self._note_failure(exc)
            if self.autostart:
                self._spawn()
        else:
            with self._lock:
                if self._ch is None and not self._closed and os.getpid() == self._pid:
                    self._install(ch, welcome)
                    ch = None  # type: ignore[assignment]
            if ch is not None:
                ch.close()
        self._next_try = time.monotonic() + delay

    def _lost(self, why: str) -> None:
        if self._ch is not None:
            self._ch.close()
            self._ch = None
        self._next_try = time.monotonic() + self.retry_s
        if not self._warned:
            log.warning("crossover scheduler: %s; continuing uncoordinated (re-attaching in the background, at "
                        "most every %.3g s)", why, self.retry_s)
            self._warned = True

    def close(self) -> None:
        """Close the connection (the daemon then releases whatever this worker held); no re-attaching."""
        with self._lock:
            self._closed = True
            if self._ch is not None:
                self._ch.close()
                self._ch = None

    # ------------------------------------------------------------------ requests

    def _channel(self) -> _Channel | None:
        """The connection to the daemon (the caller holds ``_lock``), or None (re-attaching in the background)."""
        ch = self._ch
        if ch is None:
            self._reattach_later()
        return ch

    def _ask(self, op: str, reply: str) -> tuple[dict[str, Any], float] | None:
        """Send ``op``, wait up to 5 s for its ``reply``: (reply, round-trip seconds), or None when not connected."""
        with self._lock:
            ch = self._channel()
            if ch is None:
                return None
            req = next(self._ids)
            t0 = time.perf_counter()
            try:
                ch.send({"op": op, "id": req})
                m = ch.recv_until(lambda m: m["op"] == reply and m["id"] == req, 5.0)
            except (OSError, ProtocolError) as exc:
                self._lost(f"lost the daemon ({exc})")
                return None
            return m, time.perf_counter() - t0

    def _await_grant(self, ch: _Channel, req: int, timeout: float) -> None:
        """Wait for the grant of request ``req``; ping the daemon when it is silent for ``probe_s``."""
        deadline = time.monotonic() + timeout

        def is_grant(m: dict[str, Any]) -> bool:
            return m["op"] == "grant" and m["id"] == req

        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no grant within {timeout:.3g} s")
            try:
                ch.recv_until(is_grant, min(self.probe_s, left))
                return
            except _Hung:
                pass
            ping = next(self._ids)
            ch.send({"op": "ping", "id": ping})
            try:
                m = ch.recv_until(lambda m, p=ping: is_grant(m) or (m["op"] == "pong" and m["id"] == p),
                                  self.reply_timeout)
            except _Hung:
                raise _Hung(f"the daemon does not answer (no reply to a ping within {self.reply_timeout:.3g} s)"
                            ) from None
            if m["op"] == "grant":
                return

    def acquire(self, dev: str, seq: int) -> bool:
        """Block until this worker's job has ``dev`` for step ``seq``. False: not coordinated (no daemon)."""
        with self._lock:
            ch = self._channel()
            if ch is None:
                return False
            req = next(self._ids)
            timeout = self.acquire_timeout
            if timeout is None:
                timeout = 4.0 * (self.lease_s or 10.0) + 5.0
            try:
                ch.sock.sendall(_frame_acquire(req, dev, seq))
                self._await_grant(ch, req, timeout)
            except _Hung as exc:
                self._lost(str(exc))
                return False
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
            if self._ch is None:
                return
            try:
                self._ch.sock.sendall(_frame_release(dev))
            except OSError as exc:
                self._lost(f"lost the daemon ({exc})")

    def ping(self) -> float | None:
        """Round-trip time to the daemon in seconds, or None when not connected."""
        answer = self._ask("ping", "pong")
        return None if answer is None else answer[1]

    def status(self) -> dict[str, Any] | None:
        """The daemon's view of devices, turns and jobs, or None when not connected."""
        answer = self._ask("status", "status")
        return None if answer is None else answer[0]["state"]

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
