"""Where ``crossover-run`` writes: its run directory and the report files named on its command line.

Every directory is opened once, at start, with :func:`crossover.scheduler.paths.open_dir` (walked from
``/`` without following a symbolic link of another user, each step checked on its descriptor), and every
file is then created relative to that descriptor with ``O_NOFOLLOW`` (:func:`~crossover.scheduler.paths.open_own_file`):
a path swapped while the jobs run changes nothing. Files are 0600 and directories 0700. What would be refused
at the end is refused at start, before any job runs: an existing report file that is a folder, a symbolic
link or not a plain file of this user with one link, a folder this process cannot write, an existing
TensorBoard run folder that is not a plain folder of this user.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import tempfile
import time
from typing import IO

from crossover.scheduler import paths

__all__ = ["RunDir", "OutputFile", "OutputDir"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _open_new_subdir(parent_fd: int, name: str, shown: str) -> int:
    """``mkdir`` ``name`` (0700) in ``parent_fd`` and open it; FileExistsError if anything has that name."""
    os.mkdir(name, 0o700, dir_fd=parent_fd)
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    if os.fstat(fd).st_uid != os.geteuid():  # pragma: no cover - we just made it
        os.close(fd)
        raise paths.SchedulerDirError(f"{shown} does not belong to this user")
    return fd


def _check_writable_dir(dir_fd: int, shown: str, what: str) -> None:
    """Refuse a folder this process may not create files in (permissions, a read-only file system)."""
    if not os.access(".", os.W_OK | os.X_OK, dir_fd=dir_fd):
        raise paths.SchedulerDirError(f"{shown} ({what}): cannot create files there (no write permission or a "
                                      f"read-only file system)")


def _check_file_target(dir_fd: int, name: str, shown: str, what: str) -> None:
    """Refuse now, before any job starts, what writing the file ``name`` of ``dir_fd`` at the end would refuse:
    a folder, a symbolic link, anything but a plain file of this user with a single link, a file or folder this
    process may not write. A missing file is fine (it is created at the end). Nothing is changed."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        _check_writable_dir(dir_fd, os.path.dirname(shown), f"folder of the {what}")
        return
    if stat.S_ISDIR(st.st_mode):
        raise paths.SchedulerDirError(f"{what} {shown} is a folder: give the path of a file in it, or another path")
    if stat.S_ISLNK(st.st_mode):
        raise paths.SchedulerDirError(f"{what} {shown} is a symbolic link; crossover never writes through one: "
                                      f"remove it or give another path")
    if not stat.S_ISREG(st.st_mode):
        raise paths.SchedulerDirError(f"{what} {shown} is not a regular file: remove it or give another path")
    try:  # owner, link count and write permission, as the final write checks them (the file is not changed)
        os.close(paths.open_own_file(name, os.O_WRONLY, dir_fd=dir_fd, shown=shown))
    except OSError as exc:
        raise paths.SchedulerDirError(f"{what} {shown}: cannot write it: {exc.strerror or exc}") from None


def _write_at(dir_fd: int, name: str, data: bytes, shown: str) -> None:
    fd = paths.open_own_file(name, _WRITE, 0o600, dir_fd=dir_fd, shown=shown)
    with open(fd, "wb") as f:
        f.write(data)


class RunDir:
    """This run's own new telemetry directory (0700), open for the whole run.

    :meth:`new` makes ``BASE/run-DATE-TIME-PID`` under ``--telemetry-dir BASE``, or, without one, a
    temporary ``crossover-run-XXXXXXXX`` folder that :meth:`remove` deletes at exit.
    """

    def __init__(self, fd: int, parent_fd: int, name: str, temporary: bool) -> None:
        self.fd = fd
        self._parent_fd = parent_fd
        self.name = name
        self.temporary = temporary
        self.path = paths.fd_path(fd)

    @classmethod
    def new(cls, base: str | None) -> RunDir:
        """Create the run directory (:class:`~crossover.scheduler.paths.SchedulerDirError` when ``base`` or a
        folder above it could be changed by another user)."""
        if base:
            parent = paths.open_dir(base, "--telemetry-dir", create=True)
            stamp = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            names = [stamp] + [f"{stamp}-{n}" for n in range(1, 1000)]
        else:
            parent = paths.open_dir(tempfile.gettempdir(), "temporary folder")
            names = [f"crossover-run-{secrets.token_hex(4)}" for _ in range(100)]
        try:
            for name in names:
                try:
                    fd = _open_new_subdir(parent, name, os.path.join(base or tempfile.gettempdir(), name))
                except FileExistsError:
                    continue
                return cls(fd, parent, name, temporary=not base)
            raise paths.SchedulerDirError(f"cannot create a new run directory in {base or tempfile.gettempdir()}")
        except BaseException:
            os.close(parent)
            raise

    def write(self, name: str, data: bytes) -> str:
        """Write (replace) the file ``name`` of this directory; returns its path."""
        shown = os.path.join(self.path, name)
        _write_at(self.fd, name, data, shown)
        return shown

    def remove(self) -> None:
        """Delete a temporary run directory: the plain files of ours in it, then the directory if it is empty
        and still the one we made. Anything else is left alone."""
        if not self.temporary or self.fd < 0:
            return
        for name in os.listdir(self.fd):
            with contextlib.suppress(OSError):
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                if st.st_uid == os.geteuid() and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    os.unlink(name, dir_fd=self.fd)  # a link itself is removed, never its target
        with contextlib.suppress(OSError):
            if os.stat(self.name, dir_fd=self._parent_fd, follow_symlinks=False).st_ino == os.fstat(self.fd).st_ino:
                os.rmdir(self.name, dir_fd=self._parent_fd)

    def close(self) -> None:
        """Close the descriptors (idempotent)."""
        for fd in (self.fd, self._parent_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self._parent_fd = -1


class OutputFile:
    """A report file named on the command line: its folder is opened (and checked) now, and so is the file if it
    exists (:func:`_check_file_target`); the file is written later."""

    def __init__(self, path: str, what: str) -> None:
        self.path = os.path.abspath(path)
        self.name = os.path.basename(self.path)
        if not self.name or path.endswith(os.sep):
            raise paths.SchedulerDirError(f"{what} {path}: names a folder, not a file")
        self._dir_fd = paths.open_dir(os.path.dirname(self.path), f"folder of the {what}", create=True)
        try:
            _check_file_target(self._dir_fd, self.name, self.path, what)
        except BaseException:
            self.close()
            raise

    def same_file(self, other: OutputFile) -> bool:
        """Whether both name the same file (the same name in the same folder, whatever the path said)."""
        here, there = os.fstat(self._dir_fd), os.fstat(other._dir_fd)
        return self.name == other.name and (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)

    def write(self, data: bytes) -> None:
        """Create or replace the file (never through a symbolic link, never another user's file)."""
        _write_at(self._dir_fd, self.name, data, self.path)

    def open(self) -> IO[bytes]:
        """The file, truncated, open for writing in binary."""
        return open(paths.open_own_file(self.name, _WRITE, 0o600, dir_fd=self._dir_fd, shown=self.path), "wb")

    def close(self) -> None:
        """Close the folder's descriptor (idempotent)."""
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1


class OutputDir:
    """A directory named on the command line (``--tensorboard``), created if missing and opened now."""

    def __init__(self, path: str, what: str) -> None:
        self.path = os.path.abspath(path)
        self.what = what
        self.fd = paths.open_dir(self.path, what, create=True)
        try:
            _check_writable_dir(self.fd, self.path, what)
        except BaseException:
            self.close()
            raise

    def check_subdir(self, name: str) -> None:
        """Refuse now what :meth:`subdir` would refuse later: an entry ``name`` that is not a plain directory of
        ours (a symbolic link, a file, another user's folder). A missing one is fine. Nothing is created."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        fd = self._open_subdir(name)
        try:
            _check_writable_dir(fd, os.path.join(self.path, name), f"a folder of {self.what}")
        finally:
            os.close(fd)

    def subdir(self, name: str) -> int:
        """Open (creating it 0700 if missing) the sub-directory ``name``, which must be a plain directory of ours;
        the caller closes the descriptor."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=self.fd)
        return self._open_subdir(name)

    def _open_subdir(self, name: str) -> int:
        shown = os.path.join(self.path, name)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise paths.SchedulerDirError(f"{shown} (a job's folder in {self.what}) is a symbolic link or a file, "
                                              f"not a folder; crossover never writes through a link: remove it or "
                                              f"give another {self.what}") from None
            raise paths.SchedulerDirError(f"cannot open {shown}: {exc} (a symbolic link is never followed)") from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            raise paths.SchedulerDirError(f"{shown} belongs to uid {st.st_uid} or is writable by others; remove it")
        return fd

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
