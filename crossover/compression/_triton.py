"""Fused GPU kernels (Triton) for the compression hot paths on CUDA tensors.

`kernels.py` and `quantize.py` call these for 1-D contiguous CUDA tensors, when Triton imports (a
CUDA build of PyTorch on Linux brings it) and passed `self_test`; otherwise CUDA tensors take the
pure-torch fallbacks. Each function has the semantics of the C kernel of the same name:

* sums of squares are accumulated in float64 (per block, then over blocks), so they agree with the
  C kernels to rounding (the summation order differs);
* `ef_select` keeps the C kernel's order: qualifying elements are taken in index order until the
  output is full (one pass over the tensor that counts per block and keeps one bit per element, a
  scan of the block counts, then a writing pass that reads those bits and only the picked
  elements), so selections, values and residuals are bit-identical to the CPU path; its threshold
  may stay on the device (`threshold_for_density` on a CUDA sample), so that only the final counts
  and sums come back to the host;
* the quantizer reproduces the C arithmetic bit for bit (the same counter-based uniforms, float32
  products and sums with no fused multiply-add: kernels are launched with ``enable_fp_fusion=False``),
  so levels, packed bytes, residuals and decoded values equal the CPU's for the same seed.

Each call costs a few kernel launches and one device-to-host copy of its small results (where the
caller needs numbers): the counts and sums are read once per call, not once per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ef_accumulate", "ef_select", "sample_abs", "sumsq", "quantize", "dequantize_levels", "unpack", "self_test"]

BLOCK = 4096  # elements per program of the dense kernels
SELECT_BLOCK = 4096  # elements per program of ef_select's two kernels (a multiple of SELECT_CHUNK)
SELECT_WARPS = 4  # 16384 elements with 8 warps led a sweep once and was slower in the full benchmark (docs/gpu.md)
SELECT_CHUNK = 1024  # elements the writing pass handles at a time within its block
GROUPS = 256  # groups of 8 elements per program of the quantizer kernels (2048 elements)
_NO_FMA = {"enable_fp_fusion": False}  # separate float32 multiply and add, as the C kernels


# ----------------------------------------------------------------------------------------------
# Dense passes: sums of squares, error-feedback accumulation, threshold selection
# ----------------------------------------------------------------------------------------------

@triton.jit
def _sumsq_kernel(x_ptr, n, part_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float64)
    tl.store(part_ptr + pid, tl.sum(x * x, axis=0))


@triton.jit
def _accumulate_kernel(g_ptr, r_ptr, n, part_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    acc = tl.load(g_ptr + offs, mask=m, other=0.0) + tl.load(r_ptr + offs, mask=m, other=0.0)
    tl.store(r_ptr + offs, acc, mask=m)
    a = acc.to(tl.float64)
    tl.store(part_ptr + pid, tl.sum(a * a, axis=0))


@triton.jit
def _select_count_kernel(g_ptr, r_ptr, n, thr_ptr, cnt_ptr, bits_ptr, part_ptr, nblocks, HAS_RES: tl.constexpr,
                         BLOCK: tl.constexpr):
    """acc = g (+ r, written back to r); per block: qualifying count, sum acc^2, sum g^2, and one bit per
    element (|acc| >= thr) so that the writing pass need not read the tensor again. The block is seen
    as BLOCK // 32 words of 32 lanes (2-D: no reshape, no block-wide scan)."""
    pid = tl.program_id(0)
    words = tl.arange(0, BLOCK // 32)
    lanes = tl.arange(0, 32)
    offs = pid.to(tl.int64) * BLOCK + words[:, None] * 32 + lanes[None, :]
    m = offs < n
    thr = tl.load(thr_ptr)
    g = tl.load(g_ptr + offs, mask=m, other=0.0)
    if HAS_RES:
        acc = g + tl.load(r_ptr + offs, mask=m, other=0.0)
        tl.store(r_ptr + offs, acc, mask=m)
        gd = g.to(tl.float64)
        tl.store(part_ptr + 2 * nblocks + pid, tl.sum(tl.sum(gd * gd, axis=1), axis=0))
    else:
        acc = g
    a = acc.to(tl.float64)
    tl.store(part_ptr + pid, tl.sum(tl.sum(a * a, axis=1), axis=0))
    hits = ((tl.abs(acc) >= thr) & m).to(tl.int32)
    count = tl.sum(tl.sum(hits, axis=1), axis=0)
    tl.store(cnt_ptr + pid, count)
    tl.store(part_ptr + 3 * nblocks + pid, count.to(tl.float64))
    packed = tl.sum(hits.to(tl.uint32) << lanes.to(tl.uint32)[None, :], axis=1)  # disjoint bits
    tl.store(bits_ptr + pid.to(tl.int64) * (BLOCK // 32) + words, packed.to(tl.int32, bitcast=True))


@triton.jit
def _select_write_kernel(a_ptr, cnt_ptr, end_ptr, bits_ptr, cap, oidx_ptr, oval_ptr, part_ptr, nblocks,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Write the block's qualifying elements at their place in index order (those before `cap`),
    reading the tensor only where an element was picked: position = elements before the block + set
    bits in earlier words + set bits below this lane. The block is walked CHUNK elements at a time (few
    registers per thread: more programs in flight to hide the latency of the dependent loads)."""
    pid = tl.program_id(0)
    words = tl.arange(0, CHUNK // 32)
    lanes = tl.arange(0, 32)
    base = tl.load(end_ptr + pid) - tl.load(cnt_ptr + pid)  # exclusive scan of the counts (int32: n < 2**31)
    sq = tl.zeros((CHUNK // 32, 32), dtype=tl.float64)
    for c in tl.static_range(BLOCK // CHUNK):
        w = tl.load(bits_ptr + pid.to(tl.int64) * (BLOCK // 32) + c * (CHUNK // 32) + words)
        hits = ((w.to(tl.uint32, bitcast=True)[:, None] >> lanes.to(tl.uint32)[None, :]) & 1).to(tl.int32)
        per_word = tl.sum(hits, axis=1)
        before = tl.cumsum(per_word, axis=0) - per_word
        pos = base + before[:, None] + tl.cumsum(hits, axis=1) - 1
        sel = (hits != 0) & (pos < cap)
        offs = pid.to(tl.int64) * BLOCK + c * CHUNK + words[:, None] * 32 + lanes[None, :]
        acc = tl.load(a_ptr + offs, mask=sel, other=0.0)
        tl.store(oidx_ptr + pos, offs.to(tl.int32), mask=sel)
        tl.store(oval_ptr + pos, acc, mask=sel)
        if HAS_RES:
            tl.store(a_ptr + offs, tl.zeros_like(acc), mask=sel)
        a = acc.to(tl.float64)  # 0 where not picked
        sq += a * a
        base += tl.sum(per_word, axis=0)
    tl.store(part_ptr + nblocks + pid, tl.sum(tl.sum(sq, axis=1), axis=0))


@triton.jit
def _sample_abs_kernel(g_ptr, r_ptr, numel, n, out_ptr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = j < n
    lo = j * numel // n
    h = (j * 0x4F1BBCDD) & 0x7FFFFFFF  # kernels.sample_positions: a fixed offset in each stratum
    p = lo + ((h * ((j + 1) * numel // n - lo)) >> 31)
    v = tl.load(g_ptr + p, mask=m, other=0.0)
    if HAS_RES:
        v = v + tl.load(r_ptr + p, mask=m, other=0.0)
    tl.store(out_ptr + j, tl.abs(v), mask=m)


def _blocks(n: int) -> int:
    return max(1, triton.cdiv(n, BLOCK))


def sumsq(x: torch.Tensor) -> float:
    """Sum of squares of x (float32, 1-D, contiguous), accumulated in float64."""
    n = x.numel()
    if n == 0:
        return 0.0
    nb = _blocks(n)
    part = torch.empty(nb, dtype=torch.float64, device=x.device)
    _sumsq_kernel[(nb,)](x, n, part, BLOCK=BLOCK)
    return float(part.sum())


def ef_accumulate(g: torch.Tensor, r: torch.Tensor) -> float:
    """r += g in place; the sum of squares of the result."""
    n = g.numel()
    if n == 0:
        return 0.0
    nb = _blocks(n)
    part = torch.empty(nb, dtype=torch.float64, device=g.device)
    _accumulate_kernel[(nb,)](g, r, n, part, BLOCK=BLOCK)
    return float(part.sum())


def ef_select(g: torch.Tensor, r: torch.Tensor | None, thr: float | torch.Tensor, out_idx: torch.Tensor,
              out_val: torch.Tensor) -> tuple[int, int, float, float, float]:
    """kernels.ef_select on CUDA: (count, qualifying, sum acc^2, sum picked^2, sum g^2).

    `thr` may be a one-element float32 tensor on the device (no host round trip before the passes).
    """
    n, cap = g.numel(), out_idx.numel()
    if n == 0:
        return 0, 0, 0.0, 0.0, 0.0
    if not isinstance(thr, torch.Tensor):
        thr = torch.tensor([thr], dtype=torch.float32, device=g.device)
    block, warps = SELECT_BLOCK, SELECT_WARPS
    nb = triton.cdiv(n, block)
    cnt = torch.empty(nb, dtype=torch.int32, device=g.device)
    bits = torch.empty(nb * (block // 32), dtype=torch.int32, device=g.device)
    # per block: sum acc^2, sum picked^2, sum g^2 (written with a residual only), qualifying count (exact)
    part = torch.empty((4, nb), dtype=torch.float64, device=g.device)
    has_res = r is not None
    _select_count_kernel[(nb,)](g, r if has_res else g, n, thr, cnt, bits, part, nb, HAS_RES=has_res, BLOCK=block,
                                num_warps=warps)
    end = torch.cumsum(cnt, 0, dtype=torch.int32)  # inclusive scan (n < 2**31)
    _select_write_kernel[(nb,)](r if has_res else g, cnt, end, bits, cap, out_idx, out_val, part, nb,
                                HAS_RES=has_res, BLOCK=block, CHUNK=min(SELECT_CHUNK, block), num_warps=warps)
    acc_sq, sel_sq, g_sq, q = part.cpu().sum(dim=1).tolist()  # the one device-to-host copy
    q = int(q)
    return min(q, cap), q, acc_sq, sel_sq, g_sq if has_res else acc_sq


def sample_abs(g: torch.Tensor, r: torch.Tensor | None, n: int, out: torch.Tensor) -> None:
    """out[j] = |g[p] + r[p]| at p = kernels.sample_positions(len(g), n)[j] for j < n (kernels.sample_abs), in one
    launch."""
    if n == 0:
        return
    _sample_abs_kernel[(_blocks(n),)](g, g if r is None else r, g.numel(), n, out, HAS_RES=r is not None,
                                      BLOCK=BLOCK)


# ----------------------------------------------------------------------------------------------
# Stochastic quantizer (quantize.py's arithmetic, bit for bit)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _levels(x, i, mult, s, seed):
    """Stochastic levels of x at element indices i (quantize.py: counter-based uniforms)."""
    q = (i // 4 + 1).to(tl.uint64)
    z = q * 0x9E3779B97F4A7C15 + seed.to(tl.uint64)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    r16 = (z >> ((i % 4) * 16).to(tl.uint64)) & 0xFFFF
    u = (r16 * 2 + 1).to(tl.float32) * 7.62939453125e-06  # 2**-17: exact
    t = tl.abs(x) * mult
    t = t + u
    lev = tl.where(t < s, t.to(tl.int32), s)  # NaN and inf saturate to s
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -lev, lev)  # the sign bit, as signbit()


@triton.jit(do_not_specialize=["n", "seed", "nbytes"])  # fewer variants to compile
def _quantize_kernel(x_ptr, n, mult, s, seed, step, lev_ptr, res_ptr, pk_ptr, nbytes,
                     HAS_LEV: tl.constexpr, HAS_RES: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr):
    pid = tl.program_id(0)
    grp = pid.to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, 8)
    i = grp[:, None] * 8 + j[None, :]
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    lev = _levels(x, i, mult, s, seed)
    if HAS_LEV:
        tl.store(lev_ptr + i, lev, mask=m)
    if HAS_RES:
        tl.store(res_ptr + i, x - lev.to(tl.float32) * step, mask=m)
    if BITS > 0:  # pack: element i at bits [i*BITS, (i+1)*BITS) of the stream, LSB first
        codes = tl.where(m, lev + s, 0).to(tl.uint64)
        word = tl.sum(codes << (j * BITS).to(tl.uint64)[None, :], axis=1)  # disjoint bit fields
        byte = (word[:, None] >> (j * 8).to(tl.uint64)[None, :]) & 0xFF
        dst = grp[:, None] * BITS + j[None, :]
        tl.store(pk_ptr + dst, byte.to(tl.uint8), mask=(j[None, :] < BITS) & (dst < nbytes))


@triton.jit(do_not_specialize=["n", "nbytes"])
def _unpack_kernel(pk_ptr, n, nbytes, s, sw, out_ptr, lev_ptr, HAS_OUT: tl.constexpr, ACC: tl.constexpr,
                   HAS_LEV: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr):
    pid = tl.program_id(0)
    grp = pid.to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, 8)
    src = grp[:, None] * BITS + j[None, :]
    byte = tl.load(pk_ptr + src, mask=(j[None, :] < BITS) & (src < nbytes), other=0).to(tl.uint64)
    word = tl.sum(byte << (j * 8).to(tl.uint64)[None, :], axis=1)
    codes = (word[:, None] >> (j * BITS).to(tl.uint64)[None, :]) & ((1 << BITS) - 1)
    lev = codes.to(tl.int32) - s
    i = grp[:, None] * 8 + j[None, :]
    m = i < n
    if HAS_LEV:
        tl.store(lev_ptr + i, lev, mask=m)
    if HAS_OUT:
        v = lev.to(tl.float32) * sw
        if ACC:
            v = tl.load(out_ptr + i, mask=m, other=0.0) + v
        tl.store(out_ptr + i, v, mask=m)


@triton.jit
def _dequantize_kernel(lev_ptr, n, sw, out_ptr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(lev_ptr + offs, mask=m, other=0).to(tl.float32) * sw
    if ACC:
        v = tl.load(out_ptr + offs, mask=m, other=0.0) + v
    tl.store(out_ptr + offs, v, mask=m)


def quantize(x: torch.Tensor, mult: float, s: int, seed: int, step: float, *, levels: torch.Tensor | None = None,
             packed: torch.Tensor | None = None, bits: int = 0, residual_out: torch.Tensor | None = None) -> None:
    """Levels of x into `levels` (int32) and/or b-bit codes into `packed` (uint8); residual x - level * step.

    `mult` = float32(s / scale), `step` = float32(scale / s), `seed` < 2**64 (quantize.py's meanings).
    """
    n = x.numel()
    if n == 0:
        return
    nbytes = (n * bits + 7) // 8 if packed is not None else 0
    grid = (triton.cdiv(n, 8 * GROUPS),)
    _quantize_kernel[grid](x, n, mult, s, seed, step, x if levels is None else levels,
                           x if residual_out is None else residual_out, x if packed is None else packed, nbytes,
                           HAS_LEV=levels is not None, HAS_RES=residual_out is not None,
                           BITS=bits if packed is not None else 0, GROUPS=GROUPS, **_NO_FMA)


def unpack(packed: torch.Tensor, n: int, s: int, bits: int, sw: float, *, out: torch.Tensor | None = None,
           accumulate: bool = False, levels: torch.Tensor | None = None) -> None:
    """Decode n b-bit codes: out = (or +=) level * sw, and/or the int32 levels into `levels`."""
    if n == 0:
        return
    nbytes = (n * bits + 7) // 8
    grid = (triton.cdiv(n, 8 * GROUPS),)
    dummy = packed if out is None else out
    _unpack_kernel[grid](packed, n, nbytes, s, sw, dummy, dummy if levels is None else levels,
                         HAS_OUT=out is not None, ACC=bool(accumulate), HAS_LEV=levels is not None, BITS=bits,
                         GROUPS=GROUPS, **_NO_FMA)


def dequantize_levels(levels: torch.Tensor, sw: float, out: torch.Tensor, accumulate: bool) -> None:
    """out = (or +=) level * sw for int32 levels."""
    n = levels.numel()
    if n == 0:
        return
    _dequantize_kernel[(_blocks(n),)](levels, n, sw, out, ACC=bool(accumulate), BLOCK=BLOCK, **_NO_FMA)


# ----------------------------------------------------------------------------------------------
# First use: compile and check on a small tensor
# ----------------------------------------------------------------------------------------------

def self_test(device: torch.device | str = "cuda") -> None:
    """Compile the main kernels and check them against plain torch on a small tensor; raise if they disagree.

    Guards against a Triton release that compiles these kernels differently: the caller then keeps
    the torch fallbacks.
    """
    n = 3 * BLOCK + 77
    gen = torch.Generator().manual_seed(1234)
    g = torch.randn(n, generator=gen).to(device)
    r = torch.randn(n, generator=gen).to(device)
    acc = g + r
    thr = 1.5
    want = (acc.abs() >= thr).nonzero().flatten()
    oi = torch.empty(want.numel(), dtype=torch.int32, device=device)
    ov = torch.empty(want.numel(), dtype=torch.float32, device=device)
    rr = r.clone()
    count, qual, acc_sq, _, g_sq = ef_select(g, rr, thr, oi, ov)
    expect_res = acc.clone()
    expect_res[want] = 0
    ok = (count == qual == want.numel() and torch.equal(oi.long(), want) and torch.equal(ov, acc[want])
          and torch.equal(rr, expect_res)
          and abs(acc_sq - float(acc.double().square().sum())) <= 1e-9 * acc_sq
          and abs(g_sq - float(g.double().square().sum())) <= 1e-9 * g_sq)
    if not ok:
        raise RuntimeError("ef_select disagrees with torch")
    x = g[:1000].contiguous()
    lev = torch.empty(1000, dtype=torch.int32, device=device)
    packed = torch.empty(1000, dtype=torch.uint8, device=device)
    quantize(x, 7.0, 7, 1, 1.0 / 7.0, levels=lev, packed=packed, bits=4)
    back = torch.empty(1000, dtype=torch.int32, device=device)
    unpack(packed, 1000, 7, 4, 1.0, levels=back)
    if not torch.equal(lev, back) or int(lev.abs().max()) > 7:
        raise RuntimeError("the quantizer's pack/unpack disagree")
