"""TensorBoard output of a step driver (`tensorboard=`): per-step scalars under ``crossover/``, off the hot path.

* Per step the driver hands over a few numbers (`TensorBoardLog.scalars`, `text`): one append to a deque.
* A daemon thread wakes every `FLUSH_S` seconds and writes what is queued, then flushes; `close()` (at exit,
  or the objects' `close_tensorboard()`) writes the rest.
* The target is a directory, written by the process whose rank is 0 at its first step (other ranks write
  nothing), or a writer object with ``add_scalar(tag, value, step)`` (``torch.utils.tensorboard.SummaryWriter``,
  tensorboardX), used on whatever rank the caller built it, flushed, never closed.
* A directory: this module writes the event file itself (tensorboard's protobufs and record framing), in a
  directory opened once, refused unless it is this user's; the file is created with O_EXCL | O_NOFOLLOW
  relative to that descriptor. A symbolic link at the directory path is followed only when it is this
  user's and no other user can replace it.
* An error while writing (a full disk, a writer that raises) logs one warning and ends the logging;
  training goes on.

tensorboard is imported only for a directory target (at construction: a missing package fails there).
"""

from __future__ import annotations

import atexit
import collections
import errno
import logging
import os
import socket
import stat
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["FLUSH_S", "PREFIX", "TensorBoardLog", "check_tensorboard"]

log = logging.getLogger("crossover.driver")

PREFIX = "crossover/"
FLUSH_S = 5.0  # TensorBoard reloads event files every 5 s by default: flushing more often shows nothing sooner
JOIN_S = 30.0  # at exit, how long to wait for a writer that is stuck (a hung network filesystem)
MAX_QUEUED = 200_000  # steps queued while the writer is stuck, at most (~40 MB); the oldest go first beyond

_TYPE_ERROR = ("tensorboard= must be a directory (a str or path: rank 0 writes an event file there) or a writer "
               "with add_scalar(tag, value, step), e.g. torch.utils.tensorboard.SummaryWriter(log_dir); got {!r}")


def check_tensorboard(target: Any) -> tuple[str, Any]:
    """("dir", absolute path) or ("writer", object) for a `tensorboard=` value; ValueError saying what to pass."""
    if isinstance(target, bool) or target is None:
        raise ValueError(_TYPE_ERROR.format(target))
    if isinstance(target, type):
        raise ValueError(f"tensorboard= got the class {target.__name__}, not a writer: pass an instance, e.g. "
                         f"tensorboard={target.__name__}(log_dir), or a directory")
    if isinstance(target, (str, os.PathLike)):
        path = os.fspath(target)
        if not isinstance(path, str) or not path.strip():
            raise ValueError(_TYPE_ERROR.format(target))
        _import_protos()
        path = os.path.abspath(path)
        _check_dir_path(path)
        return "dir", path
    if callable(getattr(target, "add_scalar", None)):
        return "writer", target
    hint = " (a tf.summary writer is not supported: pass its directory)" if hasattr(target, "as_default") else ""
    raise ValueError(_TYPE_ERROR.format(target) + hint)


def _import_protos() -> Any:
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError as exc:
        raise ValueError(f"tensorboard= a directory needs the tensorboard package (pip install tensorboard): "
                         f"{exc}") from None
    return event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, RecordWriter


def _check_dir_path(path: str) -> None:
    """At construction, without creating anything: an existing path must be a directory of this user's
    (through a link only of this user's)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # created at the first step, by the rank that writes
    except OSError as exc:
        raise ValueError(f"tensorboard={path!r}: cannot read it: {exc}") from None
    if stat.S_ISLNK(st.st_mode):
        _check_link_owner(path, st)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ValueError(f"tensorboard={path!r} is a symbolic link to nothing usable ({exc})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"tensorboard={path!r} exists and is not a directory: pass a directory for the event "
                         f"files (created if missing)")
    if st.st_uid != os.geteuid():
        raise ValueError(f"tensorboard={path!r} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): "
                         f"choose a directory of your own")


def _check_link_owner(path: str, st: os.stat_result) -> None:
    if st.st_uid != os.geteuid():
        raise ValueError(f"tensorboard={path!r} is a symbolic link owned by uid {st.st_uid}, not by this user "
                         f"({os.geteuid()}): crossover never writes through another user's link; remove it or "
                         f"choose another directory")


class _EventFile:
    """Our own event file in a checked directory: `write(events)` appends serialized Event records."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh: Any = None
        self._protos = _import_protos()

    def open(self) -> None:
        dfd = _open_own_dir(self.path)
        try:
            base = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
            for n in range(1000):
                name = f"{base}.{n}.crossover"
                try:
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                                 dir_fd=dfd)
                    break
                except FileExistsError:
                    continue
            else:
                raise OSError(errno.EEXIST, f"no free event file name in {self.path}")
        finally:
            os.close(dfd)
        self._fh = os.fdopen(fd, "wb")
        event_pb2 = self._protos[0]
        self._records = self._protos[4](self._fh)
        self._records.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        self._fh.flush()

    def write(self, items: list[tuple[Any, ...]]) -> None:
        if self._fh is None:
            self.open()
        event_pb2, summary_pb2, tensor_pb2, shape_pb2, _ = self._protos
        for kind, step, wall, payload in items:
            if kind == "s":
                values = [summary_pb2.Summary.Value(tag=PREFIX + tag, simple_value=float(v))
                          for tag, v in payload if v is not None]
            else:
                tag, text = payload
                meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(
                    plugin_name="text"))
                tensor = tensor_pb2.TensorProto(dtype="DT_STRING", string_val=[text.encode()],
                                                tensor_shape=shape_pb2.TensorShapeProto(
                                                    dim=[shape_pb2.TensorShapeProto.Dim(size=1)]))
                values = [summary_pb2.Summary.Value(tag=PREFIX + tag, metadata=meta, tensor=tensor)]
            if values:
                event = event_pb2.Event(wall_time=wall, step=step, summary=summary_pb2.Summary(value=values))
                self._records.write(event.SerializeToString())
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            fh.close()


def _open_own_dir(path: str) -> int:
    """A descriptor of directory `path` (created if missing), refused unless it is this user's.

    The last component is opened relative to its parent with O_NOFOLLOW; a link there is followed only when
    it is this user's and its parent is not writable by others (unless sticky): nobody else can swap it.
    """
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=pfd)
        except FileNotFoundError:
            try:
                os.mkdir(name, 0o755, dir_fd=pfd)
            except FileExistsError:
                pass
            fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=pfd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            lst = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if not stat.S_ISLNK(lst.st_mode):
                raise OSError(errno.ENOTDIR, f"{path} is not a directory") from None
            if lst.st_uid != os.geteuid():
                raise PermissionError(f"{path} is a symbolic link owned by uid {lst.st_uid}, not by this user: "
                                      f"crossover never writes through another user's link") from None
            pst = os.fstat(pfd)
            if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
                raise PermissionError(f"{path} is a symbolic link in a directory other users can write to: "
                                      f"they could replace it; pass the real directory") from None
            fd = os.open(name, flags, dir_fd=pfd)
    finally:
        os.close(pfd)
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
    return fd


class _UserWriter:
    """The caller's writer (add_scalar, optionally add_text and flush): used as is, never closed."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def write(self, items: list[tuple[Any, ...]]) -> None:
        w = self.writer
        for kind, step, wall, payload in items:
            if kind == "s":
                for tag, v in payload:
                    if v is not None:
                        w.add_scalar(PREFIX + tag, v, step, walltime=wall)
            elif callable(getattr(w, "add_text", None)):
                tag, text = payload
                w.add_text(PREFIX + tag, text, step, walltime=wall)
        if callable(getattr(w, "flush", None)):
            w.flush()

    def close(self) -> None:
        if callable(getattr(self.writer, "flush", None)):
            self.writer.flush()


class _Sink:
    """The queue, the writer and the thread; holds no reference to its TensorBoardLog (collected with it)."""

    def __init__(self, out: Any, what: str) -> None:
        self.out = out
        self.what = what
        self.queue: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=MAX_QUEUED)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.dead = False  # an error ended the logging, or closed
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=_flush_loop, args=(self,), name="crossover-tensorboard", daemon=True)
        self.thread.start()

    def drain(self) -> None:
        with self.lock:
            if self.dead:
                self.queue.clear()
                return
            items = []
            while self.queue:
                items.append(self.queue.popleft())
            try:
                self.out.write(items)
            except Exception as exc:  # a full disk or a broken writer must never stop training
                self.dead = True
                self.queue.clear()
                log.warning("crossover: TensorBoard logging to %s stopped: %s: %s (training goes on)", self.what,
                            type(exc).__name__, exc)
                try:
                    self.out.close()
                except Exception:
                    pass

    def finish(self) -> None:
        """The last drain and the close; run by the thread once `stop` is set."""
        self.drain()
        with self.lock:
            if not self.dead:
                self.dead = True
                try:
                    self.out.close()
                except Exception as exc:
                    log.warning("crossover: TensorBoard logging to %s: closing failed: %s", self.what, exc)

    def close(self) -> None:
        """Stop the thread, which writes what is queued and closes; wait for it (unless called on it: a
        garbage collection may run a finalizer there, and the loop then ends by itself)."""
        self.stop.set()
        t = self.thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=JOIN_S)


def _flush_loop(sink: _Sink) -> None:
    while not sink.stop.wait(FLUSH_S):
        sink.drain()
    sink.finish()


class TensorBoardLog:
    """Scalars and text for TensorBoard, queued per step and written by a background thread.

    `target`: checked by `check_tensorboard` (ValueError). `rank`: called once, at the first record, for a
    directory target (rank 0 writes). `final`: called by `close()` first (the driver logs its step in flight).
    """

    def __init__(self, target: Any, rank: Callable[[], int], final: Callable[[], None] | None = None) -> None:
        self.kind, obj = check_tensorboard(target)
        self.target = obj
        self._rank = rank
        self.final_to(final)
        self._sink: _Sink | None = None
        self._off = False  # not this rank, closed, or the sink died
        self.closed = False
        atexit.register(_close_at_exit, weakref.ref(self))

    def final_to(self, final: Callable[[], None] | None) -> None:
        """`close()` calls `final` first (held weakly when a bound method: the log does not keep its driver alive)."""
        self._final = weakref.WeakMethod(final) if hasattr(final, "__self__") else final

    # ------------------------------------------------------------------ per step (hot path: O(1))
    def scalars(self, step: int, values: tuple[tuple[str, float | None], ...]) -> None:
        """Queue `crossover/<tag>` = value (None: skipped) at `step`."""
        if self._off or not self._ready():
            return
        self._sink.queue.append(("s", step, time.time(), values))  # type: ignore[union-attr]

    def text(self, step: int, tag: str, text: str) -> None:
        """Queue a text event `crossover/<tag>` at `step` (a search began, the policy settled)."""
        if self._off or not self._ready():
            return
        self._sink.queue.append(("t", step, time.time(), (tag, text)))  # type: ignore[union-attr]

    def _ready(self) -> bool:
        sink = self._sink
        if sink is not None:
            if sink.dead:
                self._off = True
                return False
            return True
        try:
            if self.kind == "dir":
                if self._rank() != 0:
                    self._off = True
                    return False
                out: Any = _EventFile(self.target)
            else:
                out = _UserWriter(self.target)
        except Exception as exc:
            self._off = True
            log.warning("crossover: TensorBoard logging off: %s: %s (training goes on)", type(exc).__name__, exc)
            return False
        self._sink = _Sink(out, self.target if self.kind == "dir" else type(self.target).__name__)
        self._sink.start()
        weakref.finalize(self, self._sink.close).atexit = False  # collected: write what is queued
        return True

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Log the step in flight (`final`), write everything, close our event file (a caller's writer is
        flushed, not closed); later records are dropped. Idempotent."""
        if self.closed:
            return
        final = self._final() if isinstance(self._final, weakref.WeakMethod) else self._final
        if final is not None and not self._off:
            try:
                final()
            except Exception as exc:
                log.warning("crossover: TensorBoard: the last step was not logged: %s", exc)
        self.closed = self._off = True
        if self._sink is not None:
            self._sink.close()


def _close_at_exit(ref: weakref.ReferenceType[TensorBoardLog]) -> None:
    tb = ref()
    if tb is not None:
        tb.close()
