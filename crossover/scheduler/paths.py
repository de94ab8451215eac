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

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat

__all__ = ["DIR_ENV", "SOCKET_NAME", "LOCK_NAME", "LOG_NAME", "SchedulerDirError", "default_dir",
           "expand", "secure_dir", "socket_path", "host_name", "open_own_file", "check_parent", "check_trusted",
           "open_dir", "open_in_dir", "fd_path"]

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


_MAX_SYMLINKS = 40  # as the kernel's own limit on symbolic links followed in one path


def _dir_flags() -> int:
    return os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _check_dir_fd(fd: int, shown: str, what: str) -> None:
    st = os.fstat(fd)
    if st.st_uid not in (os.geteuid(), 0):
        raise SchedulerDirError(f"{shown} ({what}) belongs to uid {st.st_uid}, not to this user ({os.geteuid()}) "
                                f"or root: that user could plant or replace files there; choose a directory of "
                                f"your own")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise SchedulerDirError(f"{shown} ({what}) can be written by other users (mode {stat.S_IMODE(st.st_mode):o}, "
                                f"no sticky bit): they could plant or replace files there; choose a directory of "
                                f"your own")


def open_dir(path: str, what: str, *, create: bool = False, mode: int = 0o700) -> int:
    """Open the directory ``path`` for reading and writing files relative to it; returns its descriptor.

    The path is walked from ``/`` one component at a time, each opened with ``O_DIRECTORY | O_NOFOLLOW``
    relative to the one before and checked on its descriptor: it must belong to this user or root and not
    be writable by group or others unless sticky (like ``/tmp``). A symbolic link on the way is followed
    only when it belongs to this user or root (a link another user made in a sticky directory could be
    pointed anywhere at any time). The result cannot be swapped afterwards: files are then opened relative
    to the descriptor (``dir_fd=``). With ``create``, missing directories are made with ``mode``.
    Raises :class:`SchedulerDirError` naming the culprit and ``what`` it is.
    """
    todo = [x for x in os.path.abspath(path).split("/") if x]
    todo.reverse()  # a stack: the next component last
    fd = os.open("/", _dir_flags())
    shown, links = "/", 0
    try:
        _check_dir_fd(fd, shown, what)
        while todo:
            name = todo.pop()
            if name == ".":
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create or name == "..":
                    raise SchedulerDirError(f"{os.path.join(shown, name)} ({what}) does not exist") from None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, mode, dir_fd=fd)
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            here = os.path.normpath(os.path.join(shown, name))
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid not in (os.geteuid(), 0):
                    raise SchedulerDirError(f"{here} ({what}) is a symbolic link that belongs to uid {st.st_uid}, not "
                                            f"to this user ({os.geteuid()}) or root: that user could point it "
                                            f"anywhere at any time; use the real path or a directory of your own")
                links += 1
                if links > _MAX_SYMLINKS:
                    raise SchedulerDirError(f"{path} ({what}): too many symbolic links")
                target = os.readlink(name, dir_fd=fd)
                todo.extend(reversed([x for x in target.split("/") if x]))
                if target.startswith("/"):
                    os.close(fd)
                    fd = -1
                    fd = os.open("/", _dir_flags())
                    shown = "/"
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise SchedulerDirError(f"{here} ({what}) is not a directory")
            new = os.open(name, _dir_flags(), dir_fd=fd)
            os.close(fd)
            fd = new
            shown = here
            _check_dir_fd(fd, shown, what)
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        raise SchedulerDirError(f"cannot open {path} ({what}): {exc}") from None
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd


def fd_path(fd: int) -> str:
    """The path the kernel knows for an open directory (symbolic links resolved)."""
    return os.readlink(f"/proc/self/fd/{fd}")


def check_trusted(path: str, what: str) -> None:
    """Refuse a directory that another user could change (see :func:`open_dir`, which walks it)."""
    os.close(open_dir(path, what))


def check_parent(path: str, what: str) -> None:
    """:func:`check_trusted` for the directory holding ``path``."""
    check_trusted(os.path.dirname(os.path.abspath(path)), f"parent of the {what} {path}")


def open_in_dir(path: str, flags: int, what: str, mode: int = 0o600) -> int:
    """:func:`open_own_file` for ``path`` inside a directory opened with :func:`open_dir` (which see)."""
    dfd = open_dir(os.path.dirname(os.path.abspath(path)) or "/", f"folder of the {what}")
    try:
        return open_own_file(os.path.basename(path), flags, mode, dir_fd=dfd, shown=path)
    finally:
        os.close(dfd)


def open_own_file(path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None,
                  shown: str | None = None) -> int:
    """``os.open`` for a file in a directory another user may once have written to; returns the descriptor.

    Never follows a symbolic link (``O_NOFOLLOW``), never blocks on a FIFO, and refuses (with
    :class:`SchedulerDirError` naming the file and what to do) anything but a plain file owned by this
    user with a single hard link. Add ``O_CREAT | O_EXCL`` for a file that must be new; ``O_TRUNC`` is
    applied only once the file passed those checks. ``dir_fd``: ``path`` is relative to that directory
    (``shown`` names the file in messages).
    """
    truncate = bool(flags & os.O_TRUNC)
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as exc:
        path = shown or path
        if exc.errno == errno.ELOOP:
            raise SchedulerDirError(f"{path} is a symbolic link; crossover never writes through one: "
                                    f"remove it") from None
        raise
    path = shown or path
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
