"""Build and load the small plain-C libraries behind the kernels (kernels.py's `LazyLibrary`, for it and quantize.py).

A library is compiled once per (source, flags, machine) into the cache with an atomic rename, so
concurrent first uses cannot see a half-written file, and loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
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
