"""Where the node-local scheduler daemon lives: a directory only this user can open.

The directory is, in order of preference:

1. ``$CROSSOVER_SCHED_DIR`` (``{host}`` is replaced by ``$HOROVOD_HOSTNAME`` or the host name,
   ``{uid}`` by the user id: one daemon per emulated host on one machine, see docs/scheduler.md);
2. ``$XDG_RUNTIME_DIR/crossover`` when ``XDG_RUNTIME_DIR`` is a directory owned by this user;
3. ``/tmp/crossover-<uid>``.

It must be a real directory (not a symlink) owned by this user with no permissions for group or
others (0700), whose ancestors belong to this user or root and cannot be written by others unless
sticky (such as ``/tmp``): nobody else can replace it.
:func:`secure_dir` creates it so; an existing directory that is not ours and private is refused
(:class:`SchedulerDirError`), never tightened: it may hold entries another user planted while it was
open. It holds the socket (:data:`SOCKET_NAME`), the lock the running daemon holds (:data:`LOCK_NAME`)
and its log (:data:`LOG_NAME`); those files are opened with :func:`open_own_file`, which never follows
a symbolic link and refuses a file that is not a plain file of ours with a single link.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat

__all__ = ["DIR_ENV", "SOCKET_NAME", "LOCK_NAME", "LOG_NAME", "SchedulerDirError", "default_dir",
           "expand", "secure_dir", "socket_path", "host_name", "open_own_file", "check_parent", "check_trusted"]

log = logging.getLogger(__name__)

DIR_ENV = "CROSSOVER_SCHED_DIR"
SOCKET_NAME = "sched.sock"
LOCK_NAME = "daemon.lock"
LOG_NAME = "daemon.log"
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes with the terminating NUL


class SchedulerDirError(RuntimeError):
    """The scheduler directory is unusable: not ours, not a directory, or its socket path is too long."""


def host_name() -> str:
    """The host as Horovod names it (``$HOROVOD_HOSTNAME``), else this machine's host name."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def expand(template: str) -> str:
    """Replace ``{host}`` and ``{uid}`` in a directory template."""
    return template.replace("{host}", host_name()).replace("{uid}", str(os.geteuid()))


def default_dir() -> str:
    """The scheduler directory for this process (not created; see :func:`secure_dir`)."""
    env = os.environ.get(DIR_ENV)
    if env:
        return os.path.abspath(expand(env))
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                return os.path.join(xdg, "crossover")
        except OSError:
            pass
    return f"/tmp/crossover-{os.geteuid()}"


def secure_dir(path: str | None = None) -> str:
    """Create (mode 0700) or check the scheduler directory; return its absolute path.

    Raises :class:`SchedulerDirError` when the path is a symlink, not a directory, owned by another
    user, open to group or others (an existing directory is never chmodded: it may hold entries someone
    else planted while it was open), in a parent others may write to without the sticky bit, or when its
    socket path is too long. The message names the directory and what to do.
    """
    path = os.path.abspath(path or default_dir())
    parent = os.path.dirname(path)
    created = False
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise SchedulerDirError(f"cannot create the scheduler directory {path}: {exc}") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SchedulerDirError(f"scheduler directory {path} is not a plain directory (symlink or file); "
                                f"remove it or choose another {DIR_ENV}")
    if st.st_uid != os.geteuid():
        raise SchedulerDirError(f"scheduler directory {path} is owned by uid {st.st_uid}, not by this user "
                                f"({os.geteuid()}); choose another {DIR_ENV}")
    if created:
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(path, 0o700)  # ours, just made: only the umask can have removed bits
    elif st.st_mode & 0o077:
        raise SchedulerDirError(
            f"scheduler directory {path} exists with mode {stat.S_IMODE(st.st_mode):o}: other users can open "
            f"it, so it may hold files they planted; crossover does not change a directory it did not create. "
            f"Point {DIR_ENV} at a directory that does not exist yet (it is created with mode 700), or, if "
            f"{path} is yours alone, check what it holds and run: chmod 700 {path}")
    check_trusted(os.path.dirname(path), f"parent of the scheduler directory {path}")
    if len(socket_path(path).encode()) > _SUN_PATH_MAX:
        raise SchedulerDirError(f"socket path {socket_path(path)!r} is longer than a Unix socket allows "
                                f"({_SUN_PATH_MAX} bytes); choose a shorter {DIR_ENV}")
    return path


def check_trusted(path: str, what: str) -> None:
    """Refuse a directory that another user could change: ``path`` (resolved) and each of its ancestors must
    belong to this user or root and not be writable by group or others unless sticky (like ``/tmp``).

    Raises :class:`SchedulerDirError` naming the culprit and ``what`` it is.
    """
    cur = os.path.realpath(path)
    while True:
        try:
            st = os.stat(cur)
        except OSError as exc:
            raise SchedulerDirError(f"cannot check {cur} ({what}): {exc}") from None
        if st.st_uid not in (os.geteuid(), 0):
            raise SchedulerDirError(f"{cur} ({what}) belongs to uid {st.st_uid}, not to this user ({os.geteuid()}) "
                                    f"or root: that user could plant or replace files there; choose a directory "
                                    f"of your own")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise SchedulerDirError(f"{cur} ({what}) can be written by other users (mode "
                                    f"{stat.S_IMODE(st.st_mode):o}, no sticky bit): they could plant or replace "
                                    f"files there; choose a directory of your own")
        parent = os.path.dirname(cur)
        if parent == cur:
            return
        cur = parent


def check_parent(path: str, what: str) -> None:
    """:func:`check_trusted` for the directory holding ``path``."""
    check_trusted(os.path.dirname(os.path.abspath(path)), f"parent of the {what} {path}")


def open_own_file(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` for a file in a directory another user may once have written to; returns the descriptor.

    Never follows a symbolic link (``O_NOFOLLOW``), never blocks on a FIFO, and refuses (with
    :class:`SchedulerDirError` naming the file and what to do) anything but a plain file owned by this
    user with a single hard link. Add ``O_CREAT | O_EXCL`` for a file that must be new; ``O_TRUNC`` is
    applied only once the file passed those checks.
    """
    truncate = bool(flags & os.O_TRUNC)
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SchedulerDirError(f"{path} is a symbolic link; crossover never writes through one: "
                                    f"remove it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SchedulerDirError(f"{path} is not a regular file; remove it")
        if st.st_uid != os.geteuid():
            raise SchedulerDirError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}); "
                                    f"remove it")
        if st.st_nlink != 1:
            raise SchedulerDirError(f"{path} has {st.st_nlink} hard links (another name for some other file?); "
                                    f"remove it")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def socket_path(directory: str) -> str:
    """The daemon's socket in ``directory``."""
    return os.path.join(directory, SOCKET_NAME)
