"""The node-local crossover scheduler daemon (one per host, started on demand).

    python -m crossover.scheduler.daemon [--dir DIR] [--lease 10] [--align-ms 2] [--idle-exit 60]

It listens on ``DIR/sched.sock`` (a Unix stream socket; ``DIR`` is 0700, see
:mod:`crossover.scheduler.paths`), never on TCP, and serves the turn-taking policy of
:mod:`crossover.scheduler.policy` to the workers of every job on this host. Only one daemon runs per
directory: it holds an exclusive ``flock`` on ``DIR/daemon.lock`` for its whole life, so several
workers that start it at once are safe (the losers exit at once), and a dead daemon's lock is gone
with it. It exits after ``--idle-exit`` seconds without any connection (0: never), on SIGTERM/SIGINT.

One event loop (``selectors``/epoll), non-blocking sockets, no threads. A connection that sends a
malformed frame, an invalid message or a request that contradicts its state gets an ``error`` reply
and is closed; so is one from another user (``SO_PEERCRED``), one that does not read its replies (more
than :data:`OUT_LIMIT` bytes queued) and one that has not said hello within ``--hello-timeout`` (5 s).
Whatever a connection held or waited for is given up when it closes, so a worker that dies releases its
device at once.

Descriptors, CPUs and log floods: ``daemon_support.py``. At most ``MAX_CLIENTS`` connections are served;
when full, a new connection takes the place of the oldest one that has not said hello yet (so idle
connections cannot lock a real worker out), else it is refused. If ``accept`` fails anyway
(``EMFILE``/``ENFILE``), the daemon stops accepting for a while (10 ms doubling to 1 s) instead of spinning.

Files: the lock and the trace are opened with :func:`crossover.scheduler.paths.open_own_file` (never
through a symbolic link, only a plain file of ours with one link), as is the log by a worker that starts
the daemon; the trace's folder is opened with :func:`crossover.scheduler.paths.open_dir` (no symbolic link
of another user on the way, no folder others may write to unless sticky).

``--trace FILE`` (or ``$CROSSOVER_SCHED_TRACE``) appends one JSON line per scheduling event (turn
start / join / leave / end, lease expiry, connect / disconnect) with the wall-clock time ``t``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import gc
import json
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import time
from typing import IO, Any, Sequence

from crossover.scheduler import paths, settings
from crossover.scheduler.daemon_support import LogLimiter, fd_limit_cap, renice, unpin
from crossover.scheduler.policy import Grant, Scheduler, StateError
from crossover.scheduler.protocol import CLIENT_OPS, HEADER, VERSION, Decoder, ProtocolError, encode

__all__ = ["Daemon", "main", "DEFAULT_LEASE_S", "DEFAULT_ALIGN_MS", "DEFAULT_IDLE_EXIT_S"]

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 10.0
DEFAULT_ALIGN_MS = 2.0
DEFAULT_IDLE_EXIT_S = 60.0
DEFAULT_NICE = -5
DEFAULT_HELLO_TIMEOUT_S = 5.0
DEFAULT_READ_TIMEOUT_S = 2.0  # a frame (<= 4 KiB) goes in one send; 2 s covers a sender descheduled on a busy host
ACCEPT_BATCH = 64  # connections accepted per wake-up at most, so that clients are served meanwhile
ACCEPT_BACKOFF_MIN_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0
OUT_LIMIT = 64 * 1024
RECV_SIZE = 65536
_UCRED = struct.Struct("3i")


class _Stop(BaseException):
    """Raised by the signal handler to leave the event loop: a BaseException, so that no handler of a client's
    message (``except Exception``) can swallow a stop that arrives while the daemon answers a client."""


class InternalError(RuntimeError):
    """The daemon's own state is inconsistent (a bug): it exits, and the workers start a fresh one."""


class _Client:
    __slots__ = ("cid", "sock", "decoder", "out", "said_hello", "peer_pid", "writing", "hello_deadline",
                 "read_deadline")

    def __init__(self, cid: int, sock: socket.socket, peer_pid: int) -> None:
        self.cid = cid
        self.sock = sock
        self.decoder = Decoder(CLIENT_OPS)
        self.out = bytearray()
        self.said_hello = False
        self.peer_pid = peer_pid
        self.writing = False
        self.hello_deadline = 0.0
        self.read_deadline = 0.0  # while part of a frame is held back: when the rest must have come


class Daemon:
    """One scheduler daemon serving ``directory``; :meth:`start` then :meth:`serve_forever`."""

    def __init__(self, directory: str, lease_s: float = DEFAULT_LEASE_S, align_s: float = DEFAULT_ALIGN_MS / 1e3,
                 idle_exit_s: float = DEFAULT_IDLE_EXIT_S, trace: str | None = None, *,
                 hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 max_clients: int | None = None) -> None:
        settings.IDLE_EXIT_S.parse(idle_exit_s, "idle_exit_s")
        settings.HELLO_TIMEOUT_S.parse(hello_timeout_s, "hello_timeout_s")
        settings.READ_TIMEOUT_S.parse(read_timeout_s, "read_timeout_s")
        self.directory = paths.secure_dir(directory)
        self.sock_path = paths.socket_path(self.directory)
        self.idle_exit_s = idle_exit_s
        self.trace_path = trace
        tracing = bool(trace) or log.isEnabledFor(logging.DEBUG)
        self.sched = Scheduler(lease_s, align_s, on_event=self._on_event if tracing else None)
        self._clients: dict[int, _Client] = {}
        self._next_cid = 1
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._lock_fd: int | None = None
        self._sock_ino: int | None = None
        self._trace: IO[str] | None = None
        self._idle_since = time.monotonic()
        self._uid = os.geteuid()
        self.hello_timeout_s = hello_timeout_s
        self.read_timeout_s = read_timeout_s
        self._partial: dict[int, _Client] = {}  # stopped in the middle of a frame, oldest first
        self.max_clients = fd_limit_cap(max_clients)
        self._unwelcomed: dict[int, _Client] = {}  # not said hello yet, oldest first (= earliest deadline)
        self._accept_paused_until: float | None = None
        self._accept_backoff = 0.0
        self._logs = LogLimiter(log)

    # ------------------------------------------------------------------ start / stop

    def start(self) -> bool:
        """Take the directory's lock and bind the socket. False when another daemon already runs."""
        lock_path = os.path.join(self.directory, paths.LOCK_NAME)
        fd = paths.open_own_file(lock_path, os.O_RDWR | os.O_CREAT)  # a planted symlink: refused, not followed
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        self._lock_fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.sock_path)  # a dead daemon's socket: we hold the lock, so it is stale
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            lsock.bind(self.sock_path)
        finally:
            os.umask(old_umask)
        os.chmod(self.sock_path, 0o600)
        self._sock_ino = os.stat(self.sock_path).st_ino
        lsock.listen(256)
        lsock.setblocking(False)
        self._listener = lsock
        self._sel.register(lsock, selectors.EVENT_READ, None)
        if self.trace_path:
            # line-buffered: every event is on disk before the grant it announces is sent, even if the
            # daemon is killed right after (tests and post-mortems rely on it; off unless asked for)
            tfd = paths.open_in_dir(self.trace_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "trace file")
            self._trace = os.fdopen(tfd, "a", buffering=1, encoding="utf-8")
        self._trace_event({"ev": "daemon_start", "lease_s": self.sched.lease_s, "align_s": self.sched.align_s})
        log.info("crossover scheduler daemon %d serving %s (lease %.3g s, align %.3g ms, idle exit %.3g s, "
                 "at most %d connections)", os.getpid(), self.sock_path, self.sched.lease_s,
                 self.sched.align_s * 1e3, self.idle_exit_s, self.max_clients)
        return True

    def close(self) -> None:
        """Close every connection, remove our socket file and give up the lock."""
        for c in list(self._clients.values()):
            self._close(c, None)
        if self._listener is not None:
            if self._accept_paused_until is None:
                self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                if os.stat(self.sock_path).st_ino == self._sock_ino:
                    os.unlink(self.sock_path)
        self._trace_event({"ev": "daemon_stop"})
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._logs.flush(time.monotonic(), force=True)
        self._sel.close()
        log.info("crossover scheduler daemon %d stopped", os.getpid())

    def serve_forever(self) -> None:
        """Run the event loop until SIGTERM/SIGINT or the idle time-out."""
        stopping = False

        def stop(signum: int, frame: object) -> None:
            nonlocal stopping
            if not stopping:  # once: a second signal while the loop unwinds must not escape as a traceback
                stopping = True
                raise _Stop

        old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while True:
                timeout = self._timeout()
                events = self._sel.select(timeout)
                for key, mask in events:
                    if key.data is None:
                        self._accept()
                        continue
                    c: _Client = key.data
                    if c.cid not in self._clients:
                        continue  # closed by an earlier event of this batch (evicted, errored)
                    if mask & selectors.EVENT_READ:
                        self._read(c)
                    if mask & selectors.EVENT_WRITE and c.cid in self._clients:
                        self._flush(c)
                now = time.monotonic()
                self._deliver(self.sched.tick(now))
                self._housekeeping(now)
                if (self.idle_exit_s > 0 and not self._clients
                        and time.monotonic() - self._idle_since >= self.idle_exit_s):
                    log.info("no connection for %.3g s: exiting", self.idle_exit_s)
                    return
        except _Stop:
            log.info("signal received: exiting")
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    # ------------------------------------------------------------------ event loop parts

    def _timeout(self) -> float | None:
        now = time.monotonic()
        times = []
        deadline = self.sched.next_deadline()
        if deadline is not None:
            times.append(deadline - now)
        if self.idle_exit_s > 0 and not self._clients:
            times.append(self._idle_since + self.idle_exit_s - now)
        if self._unwelcomed:
            times.append(next(iter(self._unwelcomed.values())).hello_deadline - now)
        if self._partial:
            times.append(next(iter(self._partial.values())).read_deadline - now)
        if self._accept_paused_until is not None:
            times.append(self._accept_paused_until - now)
        flush = self._logs.next_flush()
        if flush is not None:
            times.append(flush - now)
        return max(0.0, min(times)) if times else None

    def _housekeeping(self, now: float) -> None:
        """Close connections past their hello deadline, resume accepting after a pause, report left-out logs."""
        while self._unwelcomed:
            c = next(iter(self._unwelcomed.values()))
            if c.hello_deadline > now:
                break
            self._close(c, f"no hello within {self.hello_timeout_s:.3g} s")
        while self._partial:
            c = next(iter(self._partial.values()))
            if c.read_deadline > now:
                break
            self._close(c, f"stopped in the middle of a message for {self.read_timeout_s:.3g} s")
        if self._accept_paused_until is not None and now >= self._accept_paused_until and self._listener is not None:
            self._accept_paused_until = None
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._logs.flush(now)

    def _pause_accept(self, exc: OSError) -> None:
        """Out of descriptors: stop watching the listener for a while (no busy loop on a readable listener)."""
        assert self._listener is not None
        self._accept_backoff = min(ACCEPT_BACKOFF_MAX_S, max(ACCEPT_BACKOFF_MIN_S, 2 * self._accept_backoff))
        self._logs.log("accept failed", logging.WARNING,
                       "accept failed (%s) with %d connections open: not accepting for %.3g s",
                       exc, len(self._clients), self._accept_backoff)
        self._sel.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + self._accept_backoff

    def _make_room(self) -> bool:
        """Close the oldest connection that has not said hello yet, else the oldest one stopped in the middle
        of a message; False when every connection is a served worker.

        What a connection already sent is read first, so one whose hello (or the rest of whose message)
        waits in its buffer is served, not evicted (it was accepted in the same batch as the newcomer).
        """
        for waiting, why in ((self._unwelcomed, "no hello yet"), (self._partial, "stopped in the middle of a message")):
            for c in list(waiting.values()):
                self._read(c)
                if c.cid not in self._clients:
                    return True  # it had closed (or sent garbage): room made
                if c.cid in waiting:
                    self._close(c, None, f"evicted to make room: {why} and the daemon is full")
                    return True
        return False

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._make_room():
                        continue  # a descriptor is free again: take the waiting connection
                    self._pause_accept(exc)
                    return
                self._logs.log("accept failed", logging.WARNING, "accept failed: %s", exc)
                continue  # e.g. ECONNABORTED: that connection is gone, the next one may be fine
            self._accept_backoff = 0.0
            try:
                pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            except OSError:
                pid, uid = 0, -1
            if uid not in (self._uid, 0):
                self._logs.log("refused", logging.WARNING, "refused a connection from uid %d (pid %d)", uid, pid)
                sock.close()
                continue
            if len(self._clients) >= self.max_clients and not self._make_room():
                self._logs.log("refused", logging.WARNING, "refused a connection from pid %d: %d connections open",
                               pid, len(self._clients))
                with contextlib.suppress(OSError):
                    sock.send(encode({"op": "error", "msg": f"daemon full ({len(self._clients)} connections)"}))
                sock.close()
                continue
            sock.setblocking(False)
            c = _Client(self._next_cid, sock, pid)
            self._next_cid += 1
            c.hello_deadline = time.monotonic() + self.hello_timeout_s
            self._clients[c.cid] = c
            self._unwelcomed[c.cid] = c
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _read(self, c: _Client) -> None:
        try:
            data = c.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(c, None, f"receive failed: {exc}")
            return
        if not data:
            self._close(c, None)
            return
        try:
            msgs = c.decoder.feed(data)
            for msg in msgs:
                self._handle(c, msg)
                if c.cid not in self._clients:
                    return
        except (ProtocolError, StateError) as exc:
            self._close(c, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - one client's message must never stop the daemon
            self._logs.log("internal error", logging.ERROR, "unexpected error handling a message of connection "
                           "%d (pid %d): closing it", c.cid, c.peer_pid, exc_info=True)
            self._close(c, f"internal error: {type(exc).__name__}")
            self._check_state(f"an unexpected {type(exc).__name__} on connection {c.cid}")
            return
        self._note_partial(c, bool(msgs))

    def _note_partial(self, c: _Client, progressed: bool) -> None:
        """Start (or stop) the clock of a connection that holds part of a frame; a connection that completed a
        message meanwhile gets a new clock (it is making progress)."""
        if not c.decoder.pending:
            self._partial.pop(c.cid, None)
        elif c.cid not in self._partial or progressed:
            self._partial.pop(c.cid, None)  # re-inserted last: the dict stays in deadline order
            c.read_deadline = time.monotonic() + self.read_timeout_s
            self._partial[c.cid] = c

    def _check_state(self, after: str) -> None:
        """After an unexpected error: go on only if the scheduler's state is still consistent, else stop (a bug
        must not hand out wrong turns; workers start a fresh daemon)."""
        try:
            self.sched.check()
        except AssertionError as exc:
            raise InternalError(f"scheduler state inconsistent after {after}: {exc}") from exc

    def _handle(self, c: _Client, msg: dict[str, Any]) -> None:
        op = msg["op"]
        now = time.monotonic()
        if not c.said_hello:
            if op != "hello":
                raise ProtocolError(f"{op} before hello")
            self.sched.hello(c.cid, msg["job"], msg["member"], float(msg["weight"]), msg["pid"])
            c.said_hello = True
            self._unwelcomed.pop(c.cid, None)
            self._trace_event({"ev": "connect", "job": msg["job"], "member": msg["member"], "pid": msg["pid"]})
            self._send(c, {"op": "welcome", "v": VERSION, "pid": os.getpid(), "lease": self.sched.lease_s})
        elif op == "acquire":
            self._deliver(self.sched.acquire(c.cid, msg["dev"], msg["seq"], msg["id"], now))
        elif op == "release":
            self._deliver(self.sched.release(c.cid, msg["dev"], now))
        elif op == "ping":
            self._send(c, {"op": "pong", "id": msg["id"]})
        elif op == "status":
            self._send_status(c, msg["id"], now)
        else:
            raise ProtocolError(f"{op} sent twice" if op == "hello" else f"unexpected op {op}")

    def _send_status(self, c: _Client, req_id: int, now: float) -> None:
        state = self.sched.snapshot(now)
        state["daemon_pid"] = os.getpid()
        try:
            frame = encode({"op": "status", "id": req_id, "state": state})
        except ProtocolError:
            frame = encode({"op": "status", "id": req_id,
                            "state": {"truncated": True, "daemon_pid": os.getpid(),
                                      "connections": state["connections"], "devices": sorted(state["devices"])[:20]}})
        self._write(c, frame)

    def _deliver(self, grants: list[Grant]) -> None:
        for g in grants:
            c = self._clients.get(g.conn)
            if c is not None:  # formatted directly: the hot path (dev was validated on the way in)
                body = (f'{{"op":"grant","id":{g.req_id},"dev":{json.dumps(g.dev)},"turn":{g.turn},'
                        f'"waited_us":{max(0, int(g.waited * 1e6))}}}').encode()
                self._write(c, HEADER.pack(len(body)) + body)

    def _send(self, c: _Client, msg: dict[str, Any]) -> None:
        self._write(c, encode(msg))

    def _write(self, c: _Client, frame: bytes) -> None:
        if c.out:
            c.out += frame
        else:
            try:
                n = c.sock.send(frame)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                self._close(c, None, f"send failed: {exc}")
                return
            if n == len(frame):
                return
            c.out += frame[n:]
        if len(c.out) > OUT_LIMIT:
            self._close(c, None, "client does not read its replies")
            return
        if not c.writing:
            c.writing = True
            self._sel.modify(c.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, c)

    def _flush(self, c: _Client) -> None:
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(c, None, f"send failed: {exc}")
            return
        del c.out[:n]
        if not c.out and c.writing:
            c.writing = False
            self._sel.modify(c.sock, selectors.EVENT_READ, c)

    def _close(self, c: _Client, error: str | None, why: str | None = None) -> None:
        """Close one connection (after an ``error`` reply when ``error`` is given); drop its state."""
        if self._clients.pop(c.cid, None) is None:
            return
        self._unwelcomed.pop(c.cid, None)
        self._partial.pop(c.cid, None)
        if error is not None:
            self._logs.log("closing connection", logging.WARNING, "closing connection %d (pid %d): %s",
                           c.cid, c.peer_pid, error)
            with contextlib.suppress(OSError, ProtocolError):
                c.sock.send(encode({"op": "error", "msg": error[:900] or "error"}))
        elif why:
            self._logs.log("closing connection", logging.INFO, "closing connection %d (pid %d): %s",
                           c.cid, c.peer_pid, why)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(c.sock)
        c.sock.close()
        if c.said_hello:
            self._trace_event({"ev": "disconnect", "conn": c.cid, "pid": c.peer_pid})
        self._deliver(self.sched.drop(c.cid, time.monotonic()))
        if not self._clients:
            self._idle_since = time.monotonic()

    def _on_event(self, rec: dict[str, Any]) -> None:
        if rec["ev"] in ("start", "end"):
            log.debug("%s %s job=%s seq=%s turn=%s", rec["ev"], rec["dev"], rec["job"], rec.get("seq"), rec.get("turn"))
        self._trace_event(rec)

    def _trace_event(self, rec: dict[str, Any]) -> None:
        if self._trace is None:
            return
        rec = dict(rec)
        rec.pop("now", None)
        rec["t"] = time.time()
        rec["daemon"] = os.getpid()
        self._trace.write(json.dumps(rec, separators=(",", ":")) + "\n")


# option -> (environment variable, default): the command line wins, then the variable, then the default
_ENV_DEFAULTS = {"lease": ("CROSSOVER_LEASE_S", DEFAULT_LEASE_S), "align_ms": ("CROSSOVER_ALIGN_MS", DEFAULT_ALIGN_MS),
                 "idle_exit": ("CROSSOVER_SCHED_IDLE_EXIT", DEFAULT_IDLE_EXIT_S),
                 "nice": ("CROSSOVER_SCHED_NICE", DEFAULT_NICE)}


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m crossover.scheduler.daemon",
        description="Node-local crossover scheduler daemon: lets the Horovod jobs on this host take turns "
                    "on each device. Workers start it on demand; you rarely need to run it by hand.")
    p.add_argument("--dir", default=None,
                   help=f"directory of the socket (default: ${paths.DIR_ENV}, $XDG_RUNTIME_DIR/crossover or "
                        "/tmp/crossover-UID)")
    p.add_argument("--lease", type=settings.LEASE_S.arg_type(), default=None,
                   help=f"longest a waiter waits for a turn to end, in seconds (env CROSSOVER_LEASE_S; "
                        f"default {DEFAULT_LEASE_S:g}; {settings.LEASE_S.range_text()})")
    p.add_argument("--align-ms", type=settings.ALIGN_MS.arg_type(), default=None,
                   help=f"how long an idle device is held for the job that should go next, in ms "
                        f"(env CROSSOVER_ALIGN_MS; default {DEFAULT_ALIGN_MS:g}; 0 turns it off; "
                        f"{settings.ALIGN_MS.range_text()})")
    p.add_argument("--idle-exit", type=settings.IDLE_EXIT_S.arg_type(), default=None,
                   help=f"exit after this many seconds without connections (env CROSSOVER_SCHED_IDLE_EXIT; "
                        f"default {DEFAULT_IDLE_EXIT_S:g}; 0: never)")
    p.add_argument("--trace", default=None,
                   help="append scheduling events as JSON lines to this file (env CROSSOVER_SCHED_TRACE); its "
                        "folder and the folders above must be this user's or root's and not writable by others "
                        "unless sticky")
    p.add_argument("--nice", type=settings.NICE.arg_type(), default=None,
                   help=f"add this to the daemon's nice value if allowed (env CROSSOVER_SCHED_NICE; default "
                        f"{DEFAULT_NICE}: answer waiting workers quickly on a busy host; 0 keeps it)")
    p.add_argument("--keep-affinity", action="store_true",
                   default=os.environ.get("CROSSOVER_SCHED_KEEP_AFFINITY") == "1",
                   help="keep the CPU affinity the daemon was started with (env CROSSOVER_SCHED_KEEP_AFFINITY=1); "
                        "by default it runs on every CPU this process may use, whatever the worker that started "
                        "it was pinned to. Keeping it puts the daemon of a pinned core's workers on that core: "
                        "a wake-up on the same core costs ~20 us here, across cores ~80 us")
    p.add_argument("--unpin", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    p.add_argument("--hello-timeout", type=settings.HELLO_TIMEOUT_S.arg_type(), default=DEFAULT_HELLO_TIMEOUT_S,
                   help="close a connection that has not said hello within this many seconds (default %(default)s)")
    p.add_argument("--read-timeout", type=settings.READ_TIMEOUT_S.arg_type(), default=DEFAULT_READ_TIMEOUT_S,
                   help="close a connection that stops in the middle of a message for this many seconds "
                        "(default %(default)s)")
    p.add_argument("--max-clients", type=int, default=None, help=argparse.SUPPRESS)  # tests: beyond the fd limit
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v: info (default), -vv: every turn")
    return p


def _settings_from_env(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the options not given on the command line from their environment variables (usage error if bad)."""
    for dest, (var, default) in _ENV_DEFAULTS.items():
        if getattr(args, dest) is None:
            try:
                value = settings.from_env(var, settings.DAEMON_ENV[var], default)
            except settings.SettingError as exc:
                parser.error(f"{exc} (environment variable)")
            setattr(args, dest, int(value) if dest == "nice" else value)
    if args.trace is None:
        args.trace = os.environ.get("CROSSOVER_SCHED_TRACE") or None
    if args.max_clients is not None and args.max_clients < 1:
        parser.error("--max-clients must be at least 1")


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: run one daemon in the foreground (exit 0 if another one already serves)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    _settings_from_env(parser, args)
    logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s")
    if not args.keep_affinity:
        unpin()
    if args.nice:
        renice(args.nice)
    try:
        daemon = Daemon(args.dir or paths.default_dir(), args.lease, args.align_ms / 1e3, args.idle_exit, args.trace,
                        hello_timeout_s=args.hello_timeout, read_timeout_s=args.read_timeout,
                        max_clients=args.max_clients)
        started = daemon.start()
    except (paths.SchedulerDirError, OSError) as exc:
        log.error("cannot serve: %s", exc)
        return 2
    if not started:
        log.info("another daemon already serves %s; exiting", daemon.directory)
        return 0
    gc.freeze()
    try:
        daemon.serve_forever()
    except InternalError as exc:
        log.error("%s; exiting so that a fresh daemon takes over", exc)
        return 70
    finally:
        daemon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
