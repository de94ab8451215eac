"""Where the node-local scheduler daemon lives: a directory only this user can open.

The directory is, in order of preference:

1. ``$CROSSOVER_SCHED_DIR`` (``{host}`` is replaced by ``$HOROVOD_HOSTNAME`` or the host name,
   ``{uid}`` by the user id: one daemon per emulated host on one machine, see docs/scheduler.md);
2. ``$XDG_RUNTIME_DIR/crossover`` when ``XDG_RUNTIME_DIR`` is a directory owned by this user;
3. ``/tmp/crossover-<uid>``.

It must be a real directory (not a symlink) owned by this user with no permissions for group or
others (0700); :func:`secure_dir` creates it so, tightens a directory of ours that is too open, and
refuses one owned by someone else (:class:`SchedulerDirError`). It holds the socket
(:data:`SOCKET_NAME`), the lock the running daemon holds (:data:`LOCK_NAME`) and its log.
"""

from __future__ import annotations

import logging
import os
import socket
import stat

__all__ = ["DIR_ENV", "SOCKET_NAME", "LOCK_NAME", "LOG_NAME", "SchedulerDirError", "default_dir",
           "expand", "secure_dir", "socket_path", "host_name"]

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

    Raises :class:`SchedulerDirError` when the path is a symlink, not a directory, or owned by another
    user. A directory of ours with group/other permissions is tightened to 0700 (logged).
    """
    path = os.path.abspath(path or default_dir())
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise SchedulerDirError(f"{path} exists and is not a directory") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SchedulerDirError(f"{path} is not a plain directory (symlink or file)")
    if st.st_uid != os.geteuid():
        raise SchedulerDirError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
    if st.st_mode & 0o077:
        log.warning("scheduler directory %s had mode %o; setting 0700", path, stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)
    if len(socket_path(path).encode()) > _SUN_PATH_MAX:
        raise SchedulerDirError(f"socket path {socket_path(path)!r} is longer than a Unix socket allows "
                                f"({_SUN_PATH_MAX} bytes); choose a shorter {DIR_ENV}")
    return path


def socket_path(directory: str) -> str:
    """The daemon's socket in ``directory``."""
    return os.path.join(directory, SOCKET_NAME)
