"""Stochastic uniform quantizer (QSGD family) with reproducible randomness: C kernels + torch fallbacks.

Per tensor x of d elements, a ``scale`` (the caller passes it; the max-norm ``absmax(x)`` is
recommended, see below) and ``s`` levels, element i becomes the integer level ``sign(x_i) * l_i``:

    l_i = min(floor(|x_i| * s / scale + u_i), s),   u_i ~ U(0, 1)

so ``E[level_i] * scale / s = x_i`` when ``|x_i| <= scale`` (unbiased stochastic rounding), and the
decoded value is ``level * scale / s``. The variance per element is ``(scale/s)^2 f (1 - f)`` with f
the fractional part of ``|x_i| s / scale``: at most ``scale^2 / (4 s^2)``.

**Scale: max-norm.** With scale = max|x| (TernGrad's choice) the total variance is at most
``min(d scale^2 / (4 s^2), scale ||x||_1 / s) <= min(d / (4 s^2), sqrt(d) / s) ||x||^2``, because
f(1-f) <= min(1/4, |x_i| s / scale), scale <= ||x||_2 and ||x||_1 <= sqrt(d) ||x||_2: QSGD's L2-norm
bound ``q(s) ||x||^2 = min(d/s^2, sqrt(d)/s) ||x||^2`` (the one the DQ-SGD policy uses) holds, with a
factor 4 to spare in its first branch, and in practice the variance is much lower: with the L2 norm
as scale almost every element of a large tensor falls below the first level. Any scale >= max|x|
keeps the quantizer unbiased (the allreduce path needs one scale on every rank: the max over ranks);
elements above the scale saturate at +-s (biased, never out of range).

**Randomness: counter-based, reproducible.** ``u_i`` depends only on (seed, i): with
``z_q = splitmix64(seed + (q + 1) * 0x9E3779B97F4A7C15)`` (mod 2**64) for q = i // 4, the 16 bits
``r_i = (z_q >> (16 * (i % 4))) & 0xFFFF`` give ``u_i = (2 r_i + 1) * 2**-17``: the midpoints of a
2**-16 grid, exact in float32, four elements per splitmix64 output (a fused AVX2 loop makes this
cheap). Rounding against a 2**-16 grid moves the mean of a level by at most 2**-17 of a level
(``scale / (s * 131072)``), zero on average over the fractional part, and integers stay exact (0
stays 0); the float32 rounding of ``|x| * s / scale + u`` adds at most half an ulp of s + 1 (2**-17 of
a level at s = 127). Both are far below the noise (standard deviation up to half a level). The same (x, scale,
s, seed) gives the same levels with the C kernels, with the torch fallback, on CPU and on CUDA. The
caller must change the seed every step and give every rank its own seed (e.g. derived from (step,
rank, tensor index)): ranks sharing a seed would round alike, and their noise would not average out.

**Exact arithmetic (C and fallback give identical bits).** In float32, with
``mult = float32(s / scale)`` (0 when scale == 0): ``t = |x| * mult``, ``t = t + u``,
``l = t < s ? trunc(t) : s`` (NaN and inf saturate to s), level = -l where the sign bit of x is set;
1 <= s <= MAX_LEVELS.
Decoding: ``value = float32(level) * float32(weight * scale / s)``, added to ``out`` when accumulating.

**Packing.** b bits per element: one sign bit + (b - 1) magnitude bits, so ``s <= 2**(b-1) - 1``
(``levels_for_bits``) and ``b = ceil(log2(s + 1)) + 1`` (``bits_for_levels``). Codes are offset
binary ``level + s`` in [0, 2s] (one of the 2**b codes is unused). Element i occupies bits
[i*b, (i+1)*b) of the byte stream, LSB first (8 elements = b bytes, little-endian);
``packed_nbytes(d, b) = ceil(d * b / 8)`` bytes; unused bits of the last byte are 0.

**TernGrad** is the special case s = 1, b = 2 with the max-norm scale (``quantize_ternary``).
**Error feedback** is the caller's job (keep x - decoded(x) and add it to the next gradient); as a
fused option, ``residual_out=`` receives exactly that during the quantization pass (it may be x
itself: in place).

**Transports.** Allreduce: ``quantize_levels`` into int32 with a scale every rank shares, Horovod
sums the levels, then ``dequantize_levels(..., weight=1/world)``; note int32 levels are as large as
float32 on the wire (Horovod's torch allreduce has no 8-bit type). Allgather: ``quantize_pack`` into
uint8 (any per-rank scale, sent alongside), then one ``unpack_dequantize(..., accumulate=True,
weight=1/world)`` per rank's slice into a single output, without temporary buffers.

Kernels: ``_quantize.c`` is compiled on first use like ``kernels.py`` (its compiler choice and cache
directory ``$CROSSOVER_CACHE/kernels``, atomic rename; flags ``CFLAGS`` below). On x86-64 the hot
loops have AVX2 versions chosen at run time; outputs of 16 MiB or more are written with
non-temporal stores. Only 1-D contiguous CPU tensors of the right dtypes go to C; the same on CUDA
go to fused Triton kernels (``_triton.py``, bit-identical results; off with ``CROSSOVER_NO_TRITON=1``
or ``kernels.use_gpu_kernels(False)``); anything else, and every call when the library (or, on
CUDA, Triton) is unavailable, ``use_kernels(False)`` here or in ``kernels.py`` was called, or
``CROSSOVER_NO_KERNELS=1`` is set, runs the pure-torch fallback, which works chunk by chunk (tens of
MB of temporaries at most) and gives identical results. ``x`` and the
outputs must not overlap, except ``residual_out``, which may be ``x``.
"""

from __future__ import annotations

import ctypes
import logging
import math
import struct
from pathlib import Path

import torch

from crossover.compression import kernels as _K
from crossover.compression.wire import MAX_BITS, MIN_BITS, levels_for_bits

log = logging.getLogger(__name__)

__all__ = [
    "MAX_BITS",
    "MAX_LEVELS",
    "MIN_BITS",
    "absmax",
    "bits_for_levels",
    "build_quantize_kernels",
    "dequantize_levels",
    "levels_for_bits",
    "packed_nbytes",
    "quantize_kernels_available",
    "quantize_levels",
    "quantize_pack",
    "quantize_ternary",
    "unpack_dequantize",
    "unpack_levels",
    "use_kernels",
    "use_simd",
]

SOURCE = Path(__file__).with_name("_quantize.c")
CFLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off")

MAX_LEVELS = 2**15 - 1  #: largest s: the float32 rounding bias (half an ulp of s + 1) stays <= 2**-9 level

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_FLT_MAX = 3.4028234663852886e38
_CHUNK = 1 << 20  # fallback chunk (elements): a multiple of 8 (byte boundaries) and 4 (random quads)


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32
_F = ctypes.c_float
_SIGNATURES = {
    "cq_quantize_levels": [_P, _I64, _F, _I32, ctypes.c_uint64, _P, _P, _F],
    "cq_quantize_pack": [_P, _I64, _F, _I32, _I32, ctypes.c_uint64, _P, _P, _F],
    "cq_dequantize_levels": [_P, _I64, _F, _P, _I32],
    "cq_unpack": [_P, _I64, _I32, _I32, _F, _P, _I32, _P],
    "cq_absmax": [_P, _I64, ctypes.POINTER(ctypes.c_float)],
    "cq_use_simd": [_I32],
}


# ----------------------------------------------------------------------------------------------
# Build and load (kernels.py's use_kernels(False) turns this library off too)
# ----------------------------------------------------------------------------------------------

_LIBRARY = _K.LazyLibrary(SOURCE, "crossover_quantize", CFLAGS, _SIGNATURES, "crossover quantizer", log,
                          parent=_K._LIBRARY)


def build_quantize_kernels() -> str | None:
    """Compile ``_quantize.c`` into the cache unless already there; return the library path or None."""
    return _LIBRARY.build()


def use_kernels(enabled: bool = True) -> None:
    """Turn the quantizer C kernels on or off here (``kernels.use_kernels(False)`` also turns them off)."""
    _LIBRARY.enabled = bool(enabled)


_lib_if_enabled = _LIBRARY.active


def _gpu(*ts: torch.Tensor | None):
    """The Triton kernels when every tensor is a contiguous CUDA tensor and kernels are enabled here."""
    return _K._gpu(*ts) if _LIBRARY.enabled else None


def use_simd(enabled: bool = True) -> bool:
    """Allow or forbid the C library's AVX2 paths (tests of the portable C code); True if they are in use."""
    lib = _LIBRARY.get()
    return bool(lib.cq_use_simd(int(bool(enabled)))) if lib is not None else False


def quantize_kernels_available() -> bool:
    """True when the compiled quantizer is loaded and enabled (building it on first call)."""
    return _lib_if_enabled() is not None


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------

def bits_for_levels(s: int) -> int:
    """Bits per element for s levels: ceil(log2(s + 1)) + 1 (the sign bit); 1 -> 2, 127 -> 8."""
    _check_levels(s)
    return s.bit_length() + 1


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` packed b-bit codes: ceil(numel * bits / 8)."""
    _check_bits(bits)
    if not _is_int(numel) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    return (numel * bits + 7) // 8


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_bits(bits: object) -> None:
    if not _is_int(bits) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")


def _check_levels(s: object, bits: int | None = None) -> None:
    hi = MAX_LEVELS if bits is None else (1 << (bits - 1)) - 1
    if not _is_int(s) or not 1 <= s <= hi:
        what = "" if bits is None else f" (2**(bits-1) - 1 for bits={bits})"
        raise ValueError(f"s must be an int in [1, {hi}]{what}, got {s!r}")


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be a finite number >= 0, got {scale!r}")
    return float(scale)


def _check_weight(weight: object) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(f"weight must be a finite number, got {weight!r}")
    return float(weight)


def _f32(v: float) -> float:
    """v rounded to float32 (clamped to the largest finite float32)."""
    return struct.unpack("f", struct.pack("f", max(-_FLT_MAX, min(_FLT_MAX, v))))[0]


def _mult(scale: float, s: int) -> float:
    return 0.0 if scale == 0.0 else _f32(s / scale)


def _check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, min_numel: int = 0,
                  device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.numel() < min_numel:
        raise ValueError(f"{name} has {t.numel()} elements, needs at least {min_numel}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _cpu_contig(*ts: torch.Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in ts)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _seed(seed: object) -> int:
    if not _is_int(seed):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return seed & _MASK64


# ----------------------------------------------------------------------------------------------
# Torch fallback pieces (device-agnostic; int64 arithmetic wraps like uint64)
# ----------------------------------------------------------------------------------------------

def _s64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 tensors (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _uniforms_torch(seed: int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """u_i for i in [start, start + n), start a multiple of 4: float32 on ``device``."""
    q0 = start // 4 + 1
    q = torch.arange(q0, q0 + (n + 3) // 4, device=device, dtype=torch.int64)
    z = q * _s64(_GOLDEN) + _s64(seed)
    z = (z ^ _srl(z, 30)) * _s64(_MIX1)
    z = (z ^ _srl(z, 27)) * _s64(_MIX2)
    z = z ^ _srl(z, 31)
    shifts = torch.arange(0, 64, 16, device=device, dtype=torch.int64)
    r = ((z.unsqueeze(1) >> shifts) & 0xFFFF).reshape(-1)[:n]
    return (r * 2 + 1).to(torch.float32).mul_(2.0**-17)


def _levels_torch(x: torch.Tensor, start: int, mult: float, s: int, seed: int) -> torch.Tensor:
    """int32 levels of the chunk x (elements start.. of the tensor)."""
    t = x.abs().mul_(mult).add_(_uniforms_torch(seed, start, x.numel(), x.device))
    t = torch.where(t < float(s), t, float(s))
    lev = t.to(torch.int32)
    return torch.where(torch.signbit(x), -lev, lev)


def _ef_torch(x: torch.Tensor, lev: torch.Tensor, step: float, residual: torch.Tensor) -> None:
    residual.copy_(x - lev.to(torch.float32).mul_(step))


def _pack_torch(lev: torch.Tensor, s: int, bits: int) -> torch.Tensor:
    """uint8 bytes of the packed codes of lev (ceil(len * bits / 8) of them)."""
    n = lev.numel()
    groups = (n + 7) // 8
    codes = torch.zeros(groups * 8, dtype=torch.int64, device=lev.device)  # padding: code 0
    codes[:n] = lev.to(torch.int64) + s
    shifts = torch.arange(8, device=lev.device, dtype=torch.int64) * bits
    words = (codes.view(groups, 8) << shifts).sum(dim=1)  # disjoint bit fields: sum == or
    byte_shifts = torch.arange(bits, device=lev.device, dtype=torch.int64) * 8
    packed = ((words.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return packed[: (n * bits + 7) // 8]


def _unpack_torch(packed: torch.Tensor, n: int, s: int, bits: int) -> torch.Tensor:
    """int32 levels of n packed codes."""
    groups = (n + 7) // 8
    nb = (n * bits + 7) // 8
    buf = torch.zeros(groups * bits, dtype=torch.int64, device=packed.device)
    buf[:nb] = packed[:nb].to(torch.int64)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (buf.view(groups, bits) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return (codes.reshape(-1)[:n] - s).to(torch.int32)


def _write_values(lev: torch.Tensor, sw: float, out: torch.Tensor, accumulate: bool) -> None:
    vals = lev.to(torch.float32).mul_(sw)
    if accumulate:
        out.add_(vals)
    else:
        out.copy_(vals)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def absmax(x: torch.Tensor) -> float:
    """max |x| (the max-norm scale) as a Python float; NaN if x holds a NaN, 0.0 when empty."""
    _check_tensor("x", x, torch.float32)
    if x.numel() == 0:
        return 0.0
    lib = _lib_if_enabled()
    if lib is not None and _cpu_contig(x):
        out = ctypes.c_float()
        lib.cq_absmax(x.data_ptr(), x.numel(), ctypes.byref(out))
        return float(out.value)
    return float(torch.linalg.vector_norm(x, float("inf")))


def quantize_levels(x: torch.Tensor, scale: float, s: int, seed: int, out: torch.Tensor, *,
                    residual_out: torch.Tensor | None = None) -> None:
    """Stochastic levels of x in [-s, s] into ``out[:len(x)]`` (int32; they sum across ranks that share the scale).

    ``residual_out`` (float32, may be x itself): also write x - level * float32(scale / s) there.
    """
    _check_tensor("x", x, torch.float32)
    n = x.numel()
    scale = _check_scale(scale)
    _check_levels(s)
    seed = _seed(seed)
    _check_tensor("out", out, torch.int32, n, x.device)
    if residual_out is not None:
        _check_tensor("residual_out", residual_out, torch.float32, n, x.device)
    if n == 0:
        return
    mult, step = _mult(scale, s), _f32(scale / s)
    lib = _lib_if_enabled()
    if lib is not None and _cpu_contig(x, out, residual_out):
        lib.cq_quantize_levels(x.data_ptr(), n, mult, s, seed, out.data_ptr(), _ptr(residual_out), step)
        return
    gpu = _gpu(x, out, residual_out)
    if gpu is not None:
        gpu.quantize(x, mult, s, seed, step, levels=out, residual_out=residual_out)
        return
    for i0 in range(0, n, _CHUNK):
        xc = x[i0:i0 + _CHUNK]
        lev = _levels_torch(xc, i0, mult, s, seed)
        if residual_out is not None:
            _ef_torch(xc, lev, step, residual_out[i0:i0 + xc.numel()])
        out[i0:i0 + xc.numel()].copy_(lev)


def quantize_pack(x: torch.Tensor, scale: float, s: int, bits: int, seed: int, out: torch.Tensor, *,
                  residual_out: torch.Tensor | None = None) -> int:
    """Quantize x like :func:`quantize_levels` and pack b-bit codes into ``out`` (uint8); return the bytes written.

    ``1 <= s <= 2**(bits-1) - 1``; writes ``packed_nbytes(len(x), bits)`` bytes, the same levels
    (same seed) as :func:`quantize_levels`. ``residual_out`` as there.
    """
    _check_tensor("x", x, torch.float32)
    n = x.numel()
    scale = _check_scale(scale)
    _check_bits(bits)
    _check_levels(s, bits)
    seed = _seed(seed)
    nbytes = (n * bits + 7) // 8
    _check_tensor("out", out, torch.uint8, nbytes, x.device)
    if residual_out is not None:
        _check_tensor("residual_out", residual_out, torch.float32, n, x.device)
    if n == 0:
        return 0
    mult, step = _mult(scale, s), _f32(scale / s)
    lib = _lib_if_enabled()
    if lib is not None and _cpu_contig(x, out, residual_out):
        lib.cq_quantize_pack(x.data_ptr(), n, mult, s, bits, seed, out.data_ptr(), _ptr(residual_out), step)
        return nbytes
    gpu = _gpu(x, out, residual_out)
    if gpu is not None:
        gpu.quantize(x, mult, s, seed, step, packed=out, bits=bits, residual_out=residual_out)
        return nbytes
    for i0 in range(0, n, _CHUNK):
        xc = x[i0:i0 + _CHUNK]
        lev = _levels_torch(xc, i0, mult, s, seed)
        if residual_out is not None:
            _ef_torch(xc, lev, step, residual_out[i0:i0 + xc.numel()])
        b0 = i0 // 8 * bits
        packed = _pack_torch(lev, s, bits)
        out[b0:b0 + packed.numel()].copy_(packed)
    return nbytes


def quantize_ternary(x: torch.Tensor, scale: float, seed: int, out: torch.Tensor, *,
                     residual_out: torch.Tensor | None = None) -> int:
    """TernGrad: s = 1 (levels -1, 0, +1), 2-bit codes; pass scale = absmax(x). Returns the bytes written."""
    return quantize_pack(x, scale, 1, 2, seed, out, residual_out=residual_out)


def dequantize_levels(levels: torch.Tensor, scale: float, s: int, out: torch.Tensor, weight: float = 1.0, *,
                      accumulate: bool = False) -> None:
    """out[:n] = (or +=) level * float32(weight * scale / s) for the n = len(levels) int32 levels.

    Levels summed over ranks decode to the sum of the ranks' values; weight = 1/world averages.
    """
    _check_tensor("levels", levels, torch.int32)
    n = levels.numel()
    scale = _check_scale(scale)
    _check_levels(s)
    sw = _f32(_check_weight(weight) * scale / s)
    _check_tensor("out", out, torch.float32, n, levels.device)
    if n == 0:
        return
    lib = _lib_if_enabled()
    if lib is not None and _cpu_contig(levels, out):
        lib.cq_dequantize_levels(levels.data_ptr(), n, sw, out.data_ptr(), int(bool(accumulate)))
        return
    gpu = _gpu(levels, out)
    if gpu is not None:
        gpu.dequantize_levels(levels, sw, out, accumulate)
        return
    for i0 in range(0, n, _CHUNK):
        lc = levels[i0:i0 + _CHUNK]
        _write_values(lc, sw, out[i0:i0 + lc.numel()], accumulate)


def unpack_dequantize(packed: torch.Tensor, numel: int, scale: float, s: int, bits: int, out: torch.Tensor,
                      accumulate: bool = False, weight: float = 1.0) -> None:
    """Decode ``numel`` packed codes: out[:numel] = (or +=) level * float32(weight * scale / s).

    With ``accumulate=True`` every rank's allgathered slice can be added into one output, each with
    its own scale, and ``weight=1/world`` averages.
    """
    _check_bits(bits)
    if not _is_int(numel) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    _check_tensor("packed", packed, torch.uint8, (numel * bits + 7) // 8)
    dev = packed.device
    scale = _check_scale(scale)
    _check_levels(s, bits)
    sw = _f32(_check_weight(weight) * scale / s)
    _check_tensor("out", out, torch.float32, numel, dev)
    if numel == 0:
        return
    lib = _lib_if_enabled()
    if lib is not None and _cpu_contig(packed, out):
        lib.cq_unpack(packed.data_ptr(), numel, s, bits, sw, out.data_ptr(), int(bool(accumulate)), None)
        return
    gpu = _gpu(packed, out)
    if gpu is not None:
        gpu.unpack(packed, numel, s, bits, sw, out=out, accumulate=accumulate)
        return
    for i0 in range(0, numel, _CHUNK):
        m = min(_CHUNK, numel - i0)
        b0 = i0 // 8 * bits
        lev = _unpack_torch(packed[b0:b0 + (m * bits + 7) // 8], m, s, bits)
        _write_values(lev, sw, out[i0:i0 + m], accumulate)


def unpack_levels(packed: torch.Tensor, numel: int, s: int, bits: int, out: torch.Tensor) -> None:
    """The int32 levels of ``numel`` packed codes into out[:numel] (the inverse of the packing)."""
    _check_bits(bits)
    if not _is_int(numel) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    _check_tensor("packed", packed, torch.uint8, (numel * bits + 7) // 8)
    dev = packed.device
    _check_levels(s, bits)
    _check_tensor("out", out, torch.int32, numel, dev)
    if numel == 0:
        return
    lib = _lib_if_enabled()
    if lib is not None and _cpu_contig(packed, out):
        lib.cq_unpack(packed.data_ptr(), numel, s, bits, 0.0, None, 0, out.data_ptr())
        return
    gpu = _gpu(packed, out)
    if gpu is not None:
        gpu.unpack(packed, numel, s, bits, 0.0, levels=out)
        return
    for i0 in range(0, numel, _CHUNK):
        m = min(_CHUNK, numel - i0)
        b0 = i0 // 8 * bits
        out[i0:i0 + m].copy_(_unpack_torch(packed[b0:b0 + (m * bits + 7) // 8], m, s, bits))
