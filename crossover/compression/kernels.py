"""Hot-path kernels for the compressors: a tiny C library called through ctypes, with torch fallbacks.

The C source (``_kernels.c``) is compiled on first use with the system C compiler (``$CC``, else
``cc``, else ``gcc``; ``-O3 -shared -fPIC -std=c99``, deliberately without ``-march=native`` so
the cached library runs on any machine of the same architecture; with gcc + glibc on x86-64 the dense
kernels also get an AVX2 version picked at load time) into
``$CROSSOVER_CACHE/kernels/`` (default ``~/.cache/crossover/kernels/``). The file name carries a
hash of the source, the flags and ``platform.machine()``, and the library is renamed into place
atomically, so concurrent ranks can build at the same time. ``scripts/setup.sh`` builds it ahead of
time through :func:`build_kernels`.

Only 1-D contiguous float32 CPU tensors (int32 for indices) go to C. On CUDA tensors of the same
kinds the dense passes (``ef_select``, ``ef_accumulate``, ``sumsq``) and ``sample_abs`` run fused
Triton kernels (``_triton.py``: a CUDA build of PyTorch brings Triton; they are compiled and checked
on first use, and skipped with a warning if that fails; ``use_gpu_kernels(False)`` or
``CROSSOVER_NO_TRITON=1`` turns them off); the index-sized operations use torch ops there. Anything else (other dtypes,
layouts, devices) and every call when no compiler is available, the build failed,
``use_kernels(False)`` was called or ``CROSSOVER_NO_KERNELS=1`` is set (read at each call) runs a
pure-torch fallback with the same semantics (sums of squares may differ in the last bits: the
summation order differs).
Indices must lie in ``[0, len)``: the C path raises ``IndexError`` otherwise, having written
nothing; the fallback follows torch indexing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from crossover.compression import _native, bitmap

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_kernels.c")
CFLAGS = ("-O3", "-shared", "-fPIC", "-std=c99")
_MAX_NUMEL = 2**31 - 1  # indices are int32

_gpu_enabled = True

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGNATURES = {
    "cx_sumsq": [_P, _I64, ctypes.POINTER(ctypes.c_double)],
    "cx_ef_accumulate": [_P, _P, _I64, ctypes.POINTER(ctypes.c_double)],
    "cx_ef_select": [_P, _P, _I64, ctypes.c_float, _P, _P, _I64,
                     ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double)],
    "cx_gather_take": [_P, _I64, _P, _I64, _P, ctypes.c_int, ctypes.POINTER(ctypes.c_double)],
    "cx_scatter_add": [_P, _I64, _P, _P, _I64, ctypes.c_float],
    "cx_zero_scatter": [_P, _I64, _P, _P, _I64, ctypes.c_float],
    "cx_sample_abs": [_P, _P, _I64, _I64, _P],
    "cx_random_indices": [_I64, _I64, ctypes.c_uint64, _P],
    "cx_bitmap_pack": [_P, _P, _I64, _I64, _P, _I64, _P, _P, _I64],
    "cx_bitmap_add": [_P, _I64, _P, _I64, _P, _I64, ctypes.c_float],
}


# ----------------------------------------------------------------------------------------------
# Build and load
# ----------------------------------------------------------------------------------------------

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
        return _native.library_path(_native.cache_dir(), self.stem, self.source, self.cflags)

    def build(self) -> str | None:
        """Compile the source into the cache unless already there; the library path or None (warned)."""
        try:
            target = self.path()
        except OSError as e:
            self.warn_once(f"cannot read the source {self.source}: {e}")
            return None
        return _native.compile_library(self.source, target, _native.compiler(), self.cflags, self.warn_once, self.what)

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, building it the first time."""
        if self._tried:
            return self._lib
        with self._lock:
            if not self._tried:
                path = self.build()
                if path is not None:
                    self._lib = _native.load_library(path, self._signatures, self.warn_once, self.what)
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


_LIBRARY = LazyLibrary(SOURCE, "crossover_kernels", CFLAGS, _SIGNATURES, "crossover kernels", log)


def build_kernels() -> str | None:
    """Compile the C kernels into the cache unless already there; return the library path or None."""
    return _LIBRARY.build()


def use_kernels(enabled: bool = True) -> None:
    """Turn the C kernels on or off for this process (off: every call uses the torch fallback)."""
    _LIBRARY.enabled = bool(enabled)


_lib_if_enabled = _LIBRARY.active


def kernels_available() -> bool:
    """True when the compiled C kernels are loaded and enabled (building them on first call)."""
    return _lib_if_enabled() is not None


# ----------------------------------------------------------------------------------------------
# GPU kernels (Triton), for CUDA tensors
# ----------------------------------------------------------------------------------------------

_TRUE = ("1", "on", "true", "yes")
_gpu_lock = threading.Lock()
_gpu_module = None
_gpu_tried = False


def use_gpu_kernels(enabled: bool = True) -> None:
    """Turn the Triton kernels for CUDA tensors on or off for this process (off: torch ops on CUDA)."""
    global _gpu_enabled
    _gpu_enabled = bool(enabled)


def _load_gpu():
    """The Triton kernel module, imported, compiled and checked once per process; None if that failed."""
    global _gpu_module, _gpu_tried
    if _gpu_tried:
        return _gpu_module
    with _gpu_lock:
        if not _gpu_tried:
            try:
                from crossover.compression import _triton
                _triton.self_test(torch.device("cuda", torch.cuda.current_device()))
                _gpu_module = _triton
            except Exception as e:  # ImportError (no Triton), a compiler error, a failed check
                log.warning("the Triton kernels for CUDA tensors are unavailable (%s: %s); CUDA tensors use "
                            "the pure-torch fallbacks (slower)", type(e).__name__, e)
            _gpu_tried = True
        return _gpu_module


def _gpu(*ts: torch.Tensor | None):
    """The Triton kernels when every given tensor is a contiguous CUDA tensor and they are enabled, else None."""
    if not (_gpu_enabled and _LIBRARY.on()):
        return None
    if os.environ.get("CROSSOVER_NO_TRITON", "").strip().lower() in _TRUE:
        return None
    if not all(t is None or (t.device.type == "cuda" and t.is_contiguous()) for t in ts):
        return None
    return _load_gpu()


def gpu_kernels_available() -> bool:
    """True when the Triton kernels for CUDA tensors are usable here (compiling them on first call)."""
    if not torch.cuda.is_available():
        return False
    return _gpu(torch.empty(0, device="cuda")) is not None


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

def _cpu_contig(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return t is None or (t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous())


def _f32(*ts: torch.Tensor | None) -> bool:
    return all(_cpu_contig(t, torch.float32) for t in ts)


def _all_f32(*ts: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype == torch.float32 for t in ts)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_1d(**ts: torch.Tensor | None) -> None:
    for name, t in ts.items():
        if t is not None and t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")


_SUMSQ_CHUNK = 1 << 15


def _sumsq_torch(x: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    if x.numel() <= _SUMSQ_CHUNK:
        return float(x.double().pow_(2).sum())
    if x.device.type != "cpu":
        # A float64 copy would triple the bytes moved: float32 norms of rows of _SUMSQ_CHUNK elements
        # (one read pass; each accumulated in float32 by the device's tree reduction), squared and
        # summed in float64.
        x = x.reshape(-1)
        main = x.numel() - x.numel() % _SUMSQ_CHUNK
        rows = torch.linalg.vector_norm(x[:main].view(-1, _SUMSQ_CHUNK), dim=1).double()
        tail = x[main:].double()
        return float(torch.dot(rows, rows) + torch.dot(tail, tail))
    # CPU: a fresh float64 copy of a big tensor costs ~10x the arithmetic in page faults, so convert
    # chunk by chunk into one small reused buffer.
    x = x.reshape(-1)
    buf = torch.empty(_SUMSQ_CHUNK, dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for chunk in x.split(_SUMSQ_CHUNK):
        b = buf[: chunk.numel()]
        b.copy_(chunk)
        total += torch.dot(b, b)
    return float(total)


def _raise_index(rc: int, what: str) -> None:
    if rc != 0:
        raise IndexError(f"{what}: an index is outside [0, len)")


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

class Selected(NamedTuple):
    """What `ef_select` picked and the sums of squares it read on the way (all accumulated in double)."""

    count: int  # elements written to out_idx / out_val
    qualifying: int  # elements with |acc| >= threshold (more than count when the capacity ran out)
    sumsq_acc: float  # ||grad + residual||^2
    sumsq_sel: float  # ||picked values||^2
    sumsq_grad: float  # ||grad||^2 (the raw gradient, apart from the residual)


def ef_select(grad: torch.Tensor, residual: torch.Tensor | None, threshold: float | torch.Tensor,
              out_idx: torch.Tensor, out_val: torch.Tensor) -> Selected:
    """Select |grad+residual| >= threshold into out_*, in one pass over the data (see `Selected`).

    `threshold` is a number, or a one-element tensor (`threshold_tensor`: on CUDA it stays on the device).
    """
    # acc = grad + residual (residual None: acc = grad, no error feedback). Qualifying elements are
    # taken in index order until len(out_idx) are; later ones are counted, not selected. A given
    # residual becomes acc, with 0 where selected.
    _check_1d(grad=grad, residual=residual, out_idx=out_idx, out_val=out_val)
    n, cap = grad.numel(), out_idx.numel()
    if residual is not None and residual.numel() != n:
        raise ValueError(f"residual has {residual.numel()} elements, grad {n}")
    if out_val.numel() < cap:
        raise ValueError(f"out_val ({out_val.numel()}) is shorter than out_idx ({cap})")
    if n > _MAX_NUMEL:
        raise ValueError(f"{n} elements do not fit int32 indices")
    lib = _lib_if_enabled()
    if isinstance(threshold, torch.Tensor) and threshold.device.type == "cpu":
        threshold = float(threshold.reshape(-1)[0])
    if lib is not None and _f32(grad, residual, out_val) and _cpu_contig(out_idx, torch.int32):
        threshold = float(threshold)
        counts = (ctypes.c_int64 * 2)()
        sums = (ctypes.c_double * 3)()
        lib.cx_ef_select(grad.data_ptr(), _ptr(residual), n, float(threshold), out_idx.data_ptr(),
                         out_val.data_ptr(), cap, counts, sums)
        return Selected(int(counts[0]), int(counts[1]), float(sums[0]), float(sums[1]), float(sums[2]))
    gpu = _gpu(grad, residual, out_idx, out_val)
    if gpu is not None and _all_f32(grad, residual, out_val) and out_idx.dtype == torch.int32:
        thr = threshold if not isinstance(threshold, torch.Tensor) else \
            threshold.to(device=grad.device, dtype=torch.float32).reshape(1)
        return Selected(*gpu.ef_select(grad, residual, thr, out_idx, out_val))
    if isinstance(threshold, torch.Tensor):
        threshold = threshold.to(device=grad.device, dtype=torch.float32).reshape(())
    sumsq_grad = _sumsq_torch(grad) if residual is not None else None
    acc = grad if residual is None else residual.add_(grad)
    hits = (acc.abs() >= threshold).nonzero().flatten()
    sel = hits[:cap]
    c = sel.numel()
    vals = acc[sel]
    out_idx[:c].copy_(sel)
    out_val[:c].copy_(vals)
    sumsq_acc = _sumsq_torch(acc)
    if residual is not None:
        residual[sel] = 0
    return Selected(c, hits.numel(), sumsq_acc, _sumsq_torch(vals), sumsq_acc if sumsq_grad is None else sumsq_grad)


def ef_accumulate(grad: torch.Tensor, residual: torch.Tensor) -> float:
    """residual += grad in place; return the sum of squares of the result (double accumulation)."""
    _check_1d(grad=grad, residual=residual)
    if residual.numel() != grad.numel():
        raise ValueError(f"residual has {residual.numel()} elements, grad {grad.numel()}")
    lib = _lib_if_enabled()
    if lib is not None and _f32(grad, residual):
        out = ctypes.c_double()
        lib.cx_ef_accumulate(grad.data_ptr(), residual.data_ptr(), grad.numel(), ctypes.byref(out))
        return out.value
    gpu = _gpu(grad, residual)
    if gpu is not None and _all_f32(grad, residual):
        return gpu.ef_accumulate(grad, residual)
    return _sumsq_torch(residual.add_(grad))


def sumsq(x: torch.Tensor) -> float:
    """Sum of squares of x, accumulated in double."""
    _check_1d(x=x)
    lib = _lib_if_enabled()
    if lib is not None and _f32(x):
        out = ctypes.c_double()
        lib.cx_sumsq(x.data_ptr(), x.numel(), ctypes.byref(out))
        return out.value
    gpu = _gpu(x)
    if gpu is not None and _all_f32(x):
        return gpu.sumsq(x)
    return _sumsq_torch(x)


def gather_take(src: torch.Tensor, idx: torch.Tensor, out_val: torch.Tensor, zero_src: bool) -> float:
    """out_val[j] = src[idx[j]] (then src[idx[j]] = 0 if zero_src); return the gathered sum of squares."""
    _check_1d(src=src, idx=idx, out_val=out_val)
    k = idx.numel()
    if out_val.numel() < k:
        raise ValueError(f"out_val ({out_val.numel()}) is shorter than idx ({k})")
    lib = _lib_if_enabled()
    if lib is not None and _f32(src, out_val) and _cpu_contig(idx, torch.int32):
        out = ctypes.c_double()
        rc = lib.cx_gather_take(src.data_ptr(), src.numel(), idx.data_ptr(), k, out_val.data_ptr(),
                                int(bool(zero_src)), ctypes.byref(out))
        _raise_index(rc, "gather_take")
        return out.value
    il = idx.long()
    vals = src[il]
    out_val[:k].copy_(vals)
    if zero_src:
        src.index_fill_(0, il, 0)
    return _sumsq_torch(vals)


def bitmap_pack(idx: torch.Tensor, val: torch.Tensor, numel: int, bits: torch.Tensor, vals: torch.Tensor,
                scratch: torch.Tensor | None = None) -> int:
    """A selection as a bitmap and values (the allgather's bitmap format, transport.py): ``bits`` (uint8, at least
    ``numel`` bits) marks the indices (bit j of byte i = element 8 i + j, the rest clear), ``vals[:c]`` gets the
    values in index order, a repeated index's values added up, ``vals[c:]`` zeros. ``scratch``: float32, ``numel``
    elements, any content (the C path's; allocated when None). Returns c."""
    _check_1d(idx=idx, val=val, bits=bits, vals=vals)
    if val.numel() != idx.numel() or bits.numel() * 8 < numel or vals.numel() < min(idx.numel(), numel):
        raise ValueError(f"bitmap_pack: {idx.numel()} indices, {val.numel()} values, {bits.numel()} bytes for "
                         f"{numel} elements, room for {vals.numel()} values")
    lib = _lib_if_enabled()
    if (lib is not None and _f32(val, vals) and _cpu_contig(idx, torch.int32) and _cpu_contig(bits, torch.uint8)
            and numel <= _MAX_NUMEL):
        if scratch is None or not _f32(scratch) or scratch.numel() < numel:
            scratch = torch.empty(max(numel, 1), dtype=torch.float32)
        c = lib.cx_bitmap_pack(idx.data_ptr(), val.data_ptr(), idx.numel(), numel, bits.data_ptr(), bits.numel(),
                               scratch.data_ptr(), vals.data_ptr(), vals.numel())
        _raise_index(min(c, 0), "bitmap_pack")
        vals[c:].zero_()
        return c
    il = idx.long()
    mask = torch.zeros(bits.numel() * 8, dtype=torch.bool, device=idx.device)
    mask[il] = True
    dense = torch.zeros(numel, dtype=torch.float32, device=val.device)
    dense.index_add_(0, il, val.to(torch.float32))
    got = dense[mask[:numel]]
    bits.copy_(bitmap.pack_bits(mask))
    vals[:got.numel()] = got
    vals[got.numel():].zero_()
    return got.numel()


def bitmap_add(out: torch.Tensor, bits: torch.Tensor, vals: torch.Tensor, scale: float = 1.0) -> int:
    """``out[i] += scale * vals[c]`` for the c-th set bit i of ``bits`` (index order); returns the set bits.
    Raises ValueError when a bit marks an element beyond ``out`` or the bits outnumber ``vals`` (the C path may
    have updated ``out`` in part by then)."""
    _check_1d(out=out, bits=bits, vals=vals)
    lib = _lib_if_enabled()
    if lib is not None and _f32(out, vals) and _cpu_contig(bits, torch.uint8):
        c = lib.cx_bitmap_add(out.data_ptr(), out.numel(), bits.data_ptr(), bits.numel(), vals.data_ptr(),
                              vals.numel(), float(scale))
        if c == -1:
            raise ValueError(f"bitmap_add: a bit marks an element beyond the tensor's {out.numel()}")
        if c == -2:
            raise ValueError(f"bitmap_add: the bitmap marks more elements than its {vals.numel()} values")
        return c
    marks = bitmap.unpack_bits(bits)
    if bool(marks[out.numel():].any()):
        raise ValueError(f"bitmap_add: a bit marks an element beyond the tensor's {out.numel()}")
    pos = marks[:out.numel()].nonzero().reshape(-1)
    if pos.numel() > vals.numel():
        raise ValueError(f"bitmap_add: the bitmap marks more elements than its {vals.numel()} values")
    out.index_add_(0, pos, vals[:pos.numel()].to(out.dtype), alpha=scale)
    return pos.numel()


def scatter_add(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, scale: float = 1.0) -> None:
    """out[idx[j]] += scale * vals[j] in place; duplicate indices add up."""
    _scatter(out, idx, vals, scale, zero=False)


def zero_scatter(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, scale: float = 1.0) -> None:
    """out[:] = 0 then out[idx[j]] += scale * vals[j]: sparse decompress into a reused dense buffer."""
    _scatter(out, idx, vals, scale, zero=True)


def _scatter(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, scale: float, zero: bool) -> None:
    _check_1d(out=out, idx=idx, vals=vals)
    if vals.numel() != idx.numel():
        raise ValueError(f"vals has {vals.numel()} elements, idx {idx.numel()}")
    lib = _lib_if_enabled()
    if lib is not None and _f32(out, vals) and _cpu_contig(idx, torch.int32):
        fn = lib.cx_zero_scatter if zero else lib.cx_scatter_add
        rc = fn(out.data_ptr(), out.numel(), idx.data_ptr(), vals.data_ptr(), idx.numel(), float(scale))
        _raise_index(rc, "zero_scatter" if zero else "scatter_add")
        return
    if zero:
        out.zero_()
    out.index_add_(0, idx, vals.to(out.dtype), alpha=scale)


def sample_abs(grad: torch.Tensor, residual: torch.Tensor | None, n: int, out: torch.Tensor) -> None:
    """out[j] = |grad[p] + residual[p]| for j < n (residual may be None): one p in each of n equal
    strata of grad, at a fixed pseudo-random offset (`sample_positions`)."""
    _check_1d(grad=grad, residual=residual, out=out)
    numel = grad.numel()
    if n < 0 or out.numel() < n:
        raise ValueError(f"need 0 <= n <= len(out) ({out.numel()}), got n={n}")
    if residual is not None and residual.numel() != numel:
        raise ValueError(f"residual has {residual.numel()} elements, grad {numel}")
    if n == 0:
        return
    if numel == 0 or n > _MAX_NUMEL or numel > _MAX_NUMEL:
        raise ValueError(f"cannot sample {n} positions from {numel} elements")
    lib = _lib_if_enabled()
    if lib is not None and _f32(grad, residual, out):
        lib.cx_sample_abs(grad.data_ptr(), _ptr(residual), numel, n, out.data_ptr())
        return
    gpu = _gpu(grad, residual, out)
    if gpu is not None and _all_f32(grad, residual, out):
        gpu.sample_abs(grad, residual, n, out)
        return
    pos = sample_positions(numel, n, grad.device)
    a = grad[pos] if residual is None else grad[pos] + residual[pos]
    out[:n].copy_(a.abs_())


def sample_positions(numel: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions `sample_abs` reads: in stratum j = [j * numel // n, (j + 1) * numel // n), the offset
    (h * width) >> 31 with h = j * 0x4F1BBCDD mod 2^31 (2^31 / golden ratio). A plain stride aliases with a
    matrix's rows (every 98th element of a 256 x 1568 gradient lies in 16 of its columns)."""
    j = torch.arange(n, device=device, dtype=torch.int64)
    lo = j * numel // n
    h = (j * 0x4F1BBCDD) & 0x7FFFFFFF
    return lo + ((h * ((j + 1) * numel // n - lo)) >> 31)


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _s64(x: int) -> int:
    """The int64 with the same bits as the uint64 x (torch has int64, not uint64, arithmetic)."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 tensors (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def random_indices(numel: int, k: int, seed: int, out_idx: torch.Tensor) -> None:
    """Write k sorted distinct pseudo-random indices < numel into out_idx[:k], a function of the seed only."""
    # Stratum j is [j*numel//k, (j+1)*numel//k); its index is lo + ((z >> 32) * width >> 32) with
    # z = splitmix64 finaliser of seed + (j+1) * 0x9E3779B97F4A7C15 (mod 2**64). C and the torch
    # fallback give identical indices for the same (numel, k, seed) on any device.
    _check_1d(out_idx=out_idx)
    if not 0 <= k <= numel:
        raise ValueError(f"need 0 <= k <= numel, got k={k}, numel={numel}")
    if numel > _MAX_NUMEL:
        raise ValueError(f"{numel} elements do not fit int32 indices")
    if out_idx.numel() < k:
        raise ValueError(f"out_idx ({out_idx.numel()}) is shorter than k ({k})")
    if k == 0:
        return
    lib = _lib_if_enabled()
    if lib is not None and _cpu_contig(out_idx, torch.int32):
        lib.cx_random_indices(numel, k, seed & _MASK64, out_idx.data_ptr())
        return
    j = torch.arange(1, k + 1, device=out_idx.device, dtype=torch.int64)
    z = j * _s64(_GOLDEN) + _s64(seed)
    z = (z ^ _srl(z, 30)) * _s64(_MIX1)
    z = (z ^ _srl(z, 27)) * _s64(_MIX2)
    z = z ^ _srl(z, 31)
    lo = (j - 1) * numel // k
    hi = j * numel // k
    out_idx[:k].copy_(lo + ((_srl(z, 32) * (hi - lo)) >> 32))


def threshold_tensor(sample: torch.Tensor, density: float) -> torch.Tensor:
    """`threshold_for_density` as a one-element float32 tensor on the sample's device, with no host sync.

    On CUDA the threshold then goes straight into `ef_select`'s kernels: the host does not wait for the
    order statistic before it launches the selection.
    """
    x = sample.reshape(-1)
    n = x.numel()
    if n == 0 or density <= 0:
        return torch.full((1,), float("inf"), dtype=torch.float32, device=sample.device)
    k = min(n, max(1, int(round(density * n))))
    return torch.kthvalue(x.abs(), n - k + 1).values.reshape(1).to(torch.float32)


def threshold_for_density(sample: torch.Tensor, density: float) -> float:
    """The |value| threshold keeping about density of sample (its round(density*n)-th largest)."""
    x = sample.reshape(-1)
    n = x.numel()
    if n == 0 or density <= 0:
        return float("inf")
    k = min(n, max(1, int(round(density * n))))
    return float(torch.kthvalue(x.abs(), n - k + 1).values)
