"""Build and load the small plain-C libraries behind the kernels (shared by kernels.py and quantize.py).

A library is compiled once per (source, flags, machine) into the cache with an atomic rename, so
concurrent first uses cannot see a half-written file, and loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

Warn = Callable[[str], None]


def library_path(cache: Path, stem: str, source: Path, cflags: Sequence[str]) -> Path:
    """Cache path named after a hash of the source, the flags and the machine."""
    h = hashlib.sha256()
    h.update(source.read_bytes())
    h.update(b"\0" + " ".join(cflags).encode() + b"\0" + platform.machine().encode())
    return cache / f"{stem}-{h.hexdigest()[:16]}.so"


def compile_library(source: Path, target: Path, cc: str | None, cflags: Sequence[str], warn: Warn,
                    what: str) -> str | None:
    """Compile `source` into `target` unless it is already there; the path, or None (warned)."""
    if target.is_file():
        return str(target)
    if cc is None:
        warn(f"no C compiler found (cc/gcc; set $CC) to build the {what}")
        return None
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
        os.close(fd)
        proc = subprocess.run([cc, *cflags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            warn(f"building the {what} failed ({cc}, rc {proc.returncode}): {proc.stderr.strip()[-2000:]}")
            return None
        os.chmod(tmp, 0o755)  # mkstemp made it private; the linker may keep that mode
        os.replace(tmp, target)
        tmp = None
        return str(target)
    except (OSError, subprocess.SubprocessError) as e:
        warn(f"building the {what} failed: {e}")
        return None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def load_library(path: str, signatures: Mapping[str, list], warn: Warn, what: str) -> ctypes.CDLL | None:
    """ctypes-load `path` and declare each function's argument types (all return int)."""
    try:
        lib = ctypes.CDLL(path)
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError) as e:
        warn(f"loading the {what} from {path} failed: {e}")
        return None


def cache_dir() -> Path:
    """Directory holding compiled libraries: $CROSSOVER_CACHE/kernels or ~/.cache/crossover/kernels."""
    root = os.environ.get("CROSSOVER_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "crossover"
    return base / "kernels"


def compiler() -> str | None:
    """The C compiler: $CC, else cc, else gcc (None if none is on the PATH)."""
    for cand in (os.environ.get("CC"), "cc", "gcc"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


class LazyLibrary:
    """One C source, built into the cache and loaded on first use, once per process (thread-safe).

    ``active()`` is the library unless it failed to build or load, ``enabled`` was set False (the
    module's ``use_kernels``), the ``parent`` library is disabled, or ``$CROSSOVER_NO_KERNELS`` is set
    (read at each call); callers then take their torch fallbacks. A failure is warned once.
    """

    def __init__(self, source: Path, stem: str, cflags: Sequence[str], signatures: Mapping[str, list],
                 what: str, log: logging.Logger, parent: LazyLibrary | None = None) -> None:
        self.source, self.stem, self.cflags, self.what = source, stem, tuple(cflags), what
        self._signatures, self._log, self._parent = signatures, log, parent
        self.enabled = True
        self.warned = False
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def warn_once(self, msg: str) -> None:
        """Log `msg` as the reason for the fallback, the first time only."""
        if not self.warned:
            self.warned = True
            self._log.warning("%s; crossover runs pure-torch fallbacks instead of the %s (slower)", msg, self.what)

    def path(self) -> Path:
        """Where the library for the current source, flags and machine lives (built or not)."""
        return library_path(cache_dir(), self.stem, self.source, self.cflags)

    def build(self) -> str | None:
        """Compile the source into the cache unless already there; the library path or None (warned)."""
        try:
            target = self.path()
        except OSError as e:
            self.warn_once(f"cannot read the source {self.source}: {e}")
            return None
        return compile_library(self.source, target, compiler(), self.cflags, self.warn_once, self.what)

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, building it the first time."""
        if self._tried:
            return self._lib
        with self._lock:
            if not self._tried:
                path = self.build()
                if path is not None:
                    self._lib = load_library(path, self._signatures, self.warn_once, self.what)
                self._tried = True
            return self._lib

    def on(self) -> bool:
        """Enabled here, in the parent, and not turned off by $CROSSOVER_NO_KERNELS."""
        if not self.enabled or (self._parent is not None and not self._parent.enabled):
            return False
        return os.environ.get("CROSSOVER_NO_KERNELS", "") in ("", "0")

    def active(self) -> ctypes.CDLL | None:
        """The library when it is on and loads, else None."""
        return self.get() if self.on() else None
