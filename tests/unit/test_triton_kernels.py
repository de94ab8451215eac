"""The Triton kernels (crossover/compression/_triton.py) against the C kernels, on edge cases.

On a GPU machine they run compiled, on CUDA tensors. Without CUDA but with Triton installed they run
in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before the module is
imported), which checks the kernels' logic but not the compiler's arithmetic (tests/unit/test_cuda.py
does that on a GPU). Without either they are skipped.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from crossover.compression import kernels as K
from crossover.compression import quantize as Q

if torch.cuda.is_available():
    DEVICE = "cuda"
elif importlib.util.find_spec("triton") is not None:
    DEVICE = "cpu"
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    DEVICE = None

pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs CUDA (or Triton, for its interpreter)")

if DEVICE is not None:
    from crossover.compression import _triton as T


def _values(n: int, seed: int) -> torch.Tensor:
    x = torch.randint(-8, 9, (n,), generator=torch.Generator().manual_seed(seed)).float() / 4
    if n > 40:
        x[3], x[17], x[29], x[31] = float("nan"), float("inf"), float("-inf"), -0.0
    return x


def _dev(t: torch.Tensor) -> torch.Tensor:
    """A copy on the kernels' device (a copy also on the CPU, so that the reference keeps its own)."""
    return t.to(DEVICE, copy=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype != torch.float32:
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.view(torch.int32)[~na], b.view(torch.int32)[~nb])


def test_self_test_passes():
    T.self_test(DEVICE)


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 20_011])
@pytest.mark.parametrize("with_residual", [False, True])
def test_ef_select_matches_c(n, with_residual):
    g = _values(n, 1)
    r = _values(n, 2) if with_residual else None
    acc = g if r is None else g + r
    qual = int((acc.abs() >= 1.0).sum())
    for cap in sorted({1, max(1, qual // 3), max(1, qual), qual + 5}):
        r_c = None if r is None else r.clone()
        r_t = None if r is None else _dev(r)
        oi, ov = torch.zeros(cap, dtype=torch.int32), torch.zeros(cap)
        oi_t, ov_t = _dev(oi), _dev(ov)
        want = K.ef_select(g, r_c, 1.0, oi, ov)
        thr = 1.0 if cap % 2 else torch.ones(1, device=DEVICE)  # a number, or a tensor on the device
        got = T.ef_select(_dev(g), r_t, thr, oi_t, ov_t)
        assert got[:2] == tuple(want[:2])
        assert got[2:] == pytest.approx(tuple(want[2:]), rel=1e-12, nan_ok=True)
        assert _same(oi, oi_t) and _same(ov, ov_t)
        assert r is None or _same(r_c, r_t)


def test_sums_match_c():
    g = torch.randn(30_001, generator=torch.Generator().manual_seed(3))
    r = torch.randn(30_001, generator=torch.Generator().manual_seed(4))
    assert T.sumsq(_dev(g)) == pytest.approx(K.sumsq(g), rel=1e-12)
    r_t = _dev(r)
    assert T.ef_accumulate(_dev(g), r_t) == pytest.approx(K.ef_accumulate(g, r), rel=1e-12)
    assert _same(r, r_t)


@pytest.mark.parametrize("bits", list(range(Q.MIN_BITS, Q.MAX_BITS + 1)))
def test_quantizer_matches_c(bits):
    n = 10_003
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits)) * 2
    x[5], x[6], x[7] = float("nan"), -0.0, float("-inf")
    scale, s = 3.0, Q.levels_for_bits(bits)
    mult, step = Q._mult(scale, s), Q._f32(scale / s)
    seed = (1 << 64) - 12345 if bits % 2 else 77
    lev, res = torch.empty(n, dtype=torch.int32), torch.empty(n)
    pk = torch.empty(Q.packed_nbytes(n, bits), dtype=torch.uint8)
    Q.quantize_levels(x, scale, s, seed, lev, residual_out=res)
    Q.quantize_pack(x, scale, s, bits, seed, pk)
    xt = _dev(x)
    lev_t, res_t, pk_t = torch.zeros_like(xt, dtype=torch.int32), torch.zeros_like(xt), torch.zeros_like(_dev(pk))
    T.quantize(xt, mult, s, seed, step, levels=lev_t, packed=pk_t, bits=bits, residual_out=res_t)
    assert _same(lev, lev_t) and _same(pk, pk_t) and _same(res, res_t)
    sw = Q._f32(0.75 * scale / s)
    out, out_t = torch.full((n,), 0.25), torch.full((n,), 0.25, device=DEVICE)
    Q.unpack_dequantize(pk, n, scale, s, bits, out, True, 0.75)
    T.unpack(pk_t, n, s, bits, sw, out=out_t, accumulate=True)
    assert _same(out, out_t)
    back = torch.empty(n, dtype=torch.int32, device=DEVICE)
    T.unpack(pk_t, n, s, bits, 0.0, levels=back)
    assert _same(lev, back)
    d, d_t = torch.ones(n), torch.ones(n, device=DEVICE)
    Q.dequantize_levels(lev, scale, s, d, 0.75, accumulate=True)
    T.dequantize_levels(lev_t, sw, d_t, True)
    assert _same(d, d_t)


@pytest.mark.parametrize("numel,n", [(1, 1), (100, 7), (20_011, 4097), (20_011, 20_011)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_sample_abs_matches_c(numel, n, with_residual):
    g = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    r = torch.randn(numel, generator=torch.Generator().manual_seed(n)) if with_residual else None
    out = torch.empty(n)
    K.sample_abs(g, r, n, out)
    out_t = torch.full((n,), -1.0, device=DEVICE)
    T.sample_abs(_dev(g), None if r is None else _dev(r), n, out_t)
    assert _same(out, out_t)
