"""The compression kernels: C library vs straightforward references, C vs torch fallback, build cache."""

from __future__ import annotations

import logging
import os
import subprocess

import numpy as np
import pytest
import torch

from crossover.compression import _native
from crossover.compression import kernels as K

HAVE_C = K.kernels_available()
SIZES = [0, 1, 7, 8, 31, 33, 1000, 1025, 5003]


@pytest.fixture(params=["c", "torch"])
def impl(request):
    """Run the test once with the C kernels and once with the pure-torch fallbacks."""
    if request.param == "c" and not HAVE_C:
        pytest.skip("C kernels unavailable (no compiler?)")
    K.use_kernels(request.param == "c")
    yield request.param
    K.use_kernels(True)


def gen(seed: int):
    return torch.Generator().manual_seed(seed)


def quantized(n: int, seed: int) -> torch.Tensor:
    """Values on a 1/4 grid: many exact ties at thresholds like 1.0."""
    return torch.randint(-8, 9, (n,), generator=gen(seed)).float() / 4


def sumsq_ref(x: torch.Tensor) -> float:
    return float(np.sum(x.numpy().astype(np.float64) ** 2))


# ---------------------------------------------------------------------------------------------- ef_select

def ef_select_ref(grad, residual, thr, cap):
    acc = grad.clone() if residual is None else grad + residual
    hits = [i for i in range(acc.numel()) if abs(float(acc[i])) >= np.float32(thr)]
    sel = hits[:cap]
    new_res = None
    if residual is not None:
        new_res = acc.clone()
        new_res[sel] = 0
    vals = acc[sel]
    return sel, vals, len(hits), sumsq_ref(acc), sumsq_ref(vals), new_res


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("cap_kind", ["large", "exact", "overflow", "zero"])
def test_ef_select_matches_reference(impl, n, with_residual, cap_kind):
    grad = quantized(n, n)
    residual = quantized(n, n + 1) if with_residual else None
    thr = 1.0  # lands exactly on grid values: ties must be selected (>=)
    qualifying = int(((grad if residual is None else grad + residual).abs() >= thr).sum())
    cap = {"large": n + 5, "exact": qualifying, "overflow": qualifying // 2, "zero": 0}[cap_kind]
    sel, vals, q, ss_acc, ss_sel, new_res = ef_select_ref(grad, residual, thr, cap)
    out_idx = torch.full((cap,), -7, dtype=torch.int32)
    out_val = torch.full((cap + 3,), 99.0)
    res = None if residual is None else residual.clone()
    c, q2, s_acc, s_sel, s_grad = K.ef_select(grad, res, thr, out_idx, out_val)
    assert (c, q2) == (len(sel), q)
    assert s_grad == pytest.approx(sumsq_ref(grad), rel=1e-12, abs=1e-12)  # the raw gradient, no residual
    assert out_idx[:c].tolist() == sel
    assert torch.equal(out_val[:c], vals)
    assert (out_idx[c:] == -7).all() and (out_val[c:] == 99.0).all()  # untouched beyond the count
    assert s_acc == pytest.approx(ss_acc, rel=1e-12, abs=1e-12)
    assert s_sel == pytest.approx(ss_sel, rel=1e-12, abs=1e-12)
    if residual is not None:
        assert torch.equal(res, new_res)


def test_ef_select_random_data_and_empty_selection(impl):
    n = 100_003
    grad = torch.randn(n, generator=gen(1))
    residual = torch.randn(n, generator=gen(2)) * 0.3
    out_idx = torch.empty(n, dtype=torch.int32)
    out_val = torch.empty(n)
    res = residual.clone()
    c, q, s_acc, _, s_grad = K.ef_select(grad, res, float("inf"), out_idx, out_val)
    assert s_grad == pytest.approx(sumsq_ref(grad), rel=1e-12)
    assert (c, q) == (0, 0)
    assert torch.equal(res, grad + residual)
    assert s_acc == pytest.approx(sumsq_ref(grad + residual), rel=1e-12)
    res = residual.clone()
    thr = 2.0
    c, q, _, s_sel, _ = K.ef_select(grad, res, thr, out_idx, out_val)
    acc = grad + residual
    expect = (acc.abs() >= thr).nonzero().flatten()
    assert c == q == expect.numel() > 0
    assert torch.equal(out_idx[:c].long(), expect)
    assert torch.equal(out_val[:c], acc[expect])
    assert s_sel == pytest.approx(sumsq_ref(acc[expect]), rel=1e-12)
    assert (res[expect] == 0).all() and res.count_nonzero() == n - c


def test_ef_select_c_and_fallback_identical():
    if not HAVE_C:
        pytest.skip("C kernels unavailable")
    n = 200_001
    grad = torch.randn(n, generator=gen(3))
    residual = torch.randn(n, generator=gen(4))
    outs = []
    for use in (True, False):
        K.use_kernels(use)
        try:
            res = residual.clone()
            oi = torch.zeros(3000, dtype=torch.int32)
            ov = torch.zeros(3000)
            counts = K.ef_select(grad, res, 2.7, oi, ov)
            outs.append((counts, oi, ov, res))
        finally:
            K.use_kernels(True)
    (c1, i1, v1, r1), (c2, i2, v2, r2) = outs
    assert c1[:2] == c2[:2] and c1[1] > 3000  # capacity overflow exercised
    assert c1[2:] == pytest.approx(c2[2:], rel=1e-12)
    assert torch.equal(i1, i2) and torch.equal(v1, v2) and torch.equal(r1, r2)


def test_ef_select_validates_shapes():
    g = torch.zeros(10)
    with pytest.raises(ValueError):
        K.ef_select(g, torch.zeros(9), 1.0, torch.zeros(2, dtype=torch.int32), torch.zeros(2))
    with pytest.raises(ValueError):
        K.ef_select(g, None, 1.0, torch.zeros(4, dtype=torch.int32), torch.zeros(2))
    with pytest.raises(ValueError):
        K.ef_select(g.view(2, 5), None, 1.0, torch.zeros(2, dtype=torch.int32), torch.zeros(2))


# ------------------------------------------------------------------------------------- dense reductions

@pytest.mark.parametrize("n", SIZES)
def test_ef_accumulate_and_sumsq(impl, n):
    grad = torch.randn(n, generator=gen(5))
    residual = torch.randn(n, generator=gen(6))
    expect = grad + residual
    res = residual.clone()
    s = K.ef_accumulate(grad, res)
    assert torch.equal(res, expect)
    assert s == pytest.approx(sumsq_ref(expect), rel=1e-12, abs=1e-12)
    assert K.sumsq(grad) == pytest.approx(sumsq_ref(grad), rel=1e-12, abs=1e-12)


def test_sumsq_accumulates_in_double(impl):
    x = torch.full((1_000_003,), 0.1)
    assert K.sumsq(x) == pytest.approx(1_000_003 * float(np.float32(0.1)) ** 2, rel=1e-10)  # float32: ~1e-7


# ---------------------------------------------------------------------------------- gather / scatter

@pytest.mark.parametrize("zero_src", [False, True])
def test_gather_take(impl, zero_src):
    src = torch.randn(1001, generator=gen(7))
    idx = torch.tensor([0, 5, 5, 1000, 17, 0], dtype=torch.int32)  # duplicates
    out = torch.full((8,), 42.0)
    s = src.clone()
    ss = K.gather_take(s, idx, out, zero_src)
    expect = src[idx.long()]
    assert torch.equal(out[:6], expect)  # duplicates all get the original value
    assert (out[6:] == 42.0).all()
    assert ss == pytest.approx(sumsq_ref(expect), rel=1e-12)
    if zero_src:
        ref = src.clone()
        ref[idx.long()] = 0
        assert torch.equal(s, ref)
    else:
        assert torch.equal(s, src)
    assert K.gather_take(s, torch.zeros(0, dtype=torch.int32), out, zero_src) == 0.0


def test_gather_take_out_of_range_writes_nothing(impl):
    src = torch.randn(10)
    before = src.clone()
    out = torch.zeros(3)
    with pytest.raises(IndexError):
        K.gather_take(src, torch.tensor([1, 10, 2], dtype=torch.int32), out, True)
    assert torch.equal(src, before)


@pytest.mark.parametrize("scale", [1.0, 0.5, -3.7])
@pytest.mark.parametrize("n", [1, 33, 1000])
def test_scatter_add_with_duplicates(impl, scale, n):
    k = 3 * n  # many duplicates
    idx = torch.randint(0, n, (k,), generator=gen(n), dtype=torch.int32)
    vals = torch.randn(k, generator=gen(n + 1))
    out = torch.randn(n, generator=gen(n + 2))
    ref = out.numpy().copy()
    np.add.at(ref, idx.numpy(), np.float32(scale) * vals.numpy())  # float32, index order
    K.scatter_add(out, idx, vals, scale)
    torch.testing.assert_close(out, torch.from_numpy(ref), rtol=1e-6, atol=1e-6)
    if impl == "c":
        assert np.array_equal(out.numpy(), ref)


def test_zero_scatter_and_bad_index(impl):
    out = torch.randn(50)
    idx = torch.tensor([3, 3, 49], dtype=torch.int32)
    K.zero_scatter(out, idx, torch.tensor([1.0, 2.0, 3.0]), 2.0)
    ref = torch.zeros(50)
    ref[3], ref[49] = 6.0, 6.0
    assert torch.equal(out, ref)
    with pytest.raises(IndexError):
        K.scatter_add(out, torch.tensor([50], dtype=torch.int32), torch.ones(1))
    with pytest.raises(ValueError):
        K.scatter_add(out, idx, torch.ones(2))
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------- sampling, indices

@pytest.mark.parametrize("numel,n", [(1000, 10), (1003, 7), (5, 12), (25_000, 25), (9, 0), (401_408, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_sample_abs(impl, numel, n, with_residual):
    g = torch.randn(numel, generator=gen(8))
    r = torch.randn(numel, generator=gen(9)) if with_residual else None
    out = torch.full((n + 2,), -1.0)
    K.sample_abs(g, r, n, out)
    pos = [j * numel // n + (((j * 0x4F1BBCDD) % 2**31) * ((j + 1) * numel // n - j * numel // n) >> 31)
           for j in range(n)]  # one position per stratum at a fixed offset (kernels.sample_positions)
    expect = (g[pos] if r is None else g[pos] + r[pos]).abs()
    assert torch.equal(out[:n], expect)
    assert (out[n:] == -1.0).all()


def test_sample_spans_a_matrix_columns():
    """The sample of a 256 x 1568 gradient (4096 of 401 408 elements) reaches most of its columns: a plain stride
    (every 98th element) fell on 16 of them, and a threshold from those kept a median 1.19x k."""
    cols = {int(p) % 1568 for p in K.sample_positions(256 * 1568, 4096)}
    assert len(cols) > 1000


def random_indices_ref(numel: int, k: int, seed: int) -> np.ndarray:
    """Independent numpy uint64 implementation of the documented stratified splitmix64 scheme."""
    with np.errstate(over="ignore"):
        j = np.arange(1, k + 1, dtype=np.uint64)
        z = np.uint64(seed % 2**64) + j * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    lo = (j - np.uint64(1)) * np.uint64(numel) // np.uint64(k)
    hi = j * np.uint64(numel) // np.uint64(k)
    return (lo + (((z >> np.uint64(32)) * (hi - lo)) >> np.uint64(32))).astype(np.int64)


@pytest.mark.parametrize("numel,k,seed", [(1000, 10, 0), (1000, 1000, 5), (7, 3, -1), (10, 0, 1),
                                          (25_000_000, 250_000, 2**63 + 12345), (2**31 - 1, 1000, 99)])
def test_random_indices(impl, numel, k, seed):
    out = torch.full((k + 1,), -5, dtype=torch.int32)
    K.random_indices(numel, k, seed, out)
    got = out[:k].long().numpy()
    assert out[k] == -5
    assert np.array_equal(got, random_indices_ref(numel, k, seed))
    assert (got >= 0).all() and (got < numel).all()
    assert (np.diff(got) > 0).all()  # sorted and distinct
    if k == numel:
        assert np.array_equal(got, np.arange(numel))


def test_random_indices_deterministic_and_seed_dependent(impl):
    a, b, c = (torch.empty(500, dtype=torch.int32) for _ in range(3))
    K.random_indices(100_000, 500, 7, a)
    K.random_indices(100_000, 500, 7, b)
    K.random_indices(100_000, 500, 8, c)
    assert torch.equal(a, b)
    assert (a != c).float().mean() > 0.9
    with pytest.raises(ValueError):
        K.random_indices(10, 11, 0, torch.empty(11, dtype=torch.int32))


def test_threshold_for_density():
    sample = torch.arange(1000, dtype=torch.float32).flip(0)  # 999 .. 0
    assert K.threshold_for_density(sample, 0.01) == 990.0  # keeps the 10 largest
    assert K.threshold_for_density(-sample, 0.01) == 990.0  # magnitudes
    assert K.threshold_for_density(sample, 1.0) == 0.0
    assert K.threshold_for_density(sample, 1e-9) == 999.0  # at least one kept
    assert K.threshold_for_density(sample, 0.0) == float("inf")
    assert K.threshold_for_density(torch.zeros(0), 0.5) == float("inf")
    x = torch.randn(100_000, generator=gen(10)).abs()
    thr = K.threshold_for_density(x, 0.05)
    assert int((x >= thr).sum()) == 5000
    for s, d in ((sample, 0.01), (-sample, 0.3), (sample, 1e-9), (sample, 0.0), (torch.zeros(0), 0.5), (x, 0.05)):
        t = K.threshold_tensor(s, d)  # the same value, as a one-element float32 tensor
        assert t.shape == (1,) and t.dtype == torch.float32 and float(t) == K.threshold_for_density(s, d)


def test_ef_select_takes_a_tensor_threshold(impl):
    g, r = torch.randn(5000, generator=gen(20)), torch.randn(5000, generator=gen(21))
    outs = []
    for thr in (1.25, torch.tensor([1.25])):
        res, oi, ov = r.clone(), torch.zeros(400, dtype=torch.int32), torch.zeros(400)
        outs.append((tuple(K.ef_select(g, res, thr, oi, ov)), res, oi, ov))
    assert outs[0][0] == outs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1:], outs[1][1:]))


# ---------------------------------------------------------------------------------- dispatch switches

def test_fallback_switches(monkeypatch):
    K.use_kernels(False)
    try:
        assert not K.kernels_available()
    finally:
        K.use_kernels(True)
    monkeypatch.setenv("CROSSOVER_NO_KERNELS", "1")
    assert not K.kernels_available()
    monkeypatch.setenv("CROSSOVER_NO_KERNELS", "0")
    assert K.kernels_available() == (K._LIBRARY.get() is not None)


def test_other_dtypes_and_layouts_use_the_fallback():
    g64 = torch.randn(300, generator=gen(11), dtype=torch.float64)
    r64 = torch.randn(300, generator=gen(12), dtype=torch.float64)
    oi = torch.zeros(300, dtype=torch.int64)
    ov = torch.zeros(300, dtype=torch.float64)
    res = r64.clone()
    c, q, *_ = K.ef_select(g64, res, 1.5, oi, ov)
    acc = g64 + r64
    expect = (acc.abs() >= 1.5).nonzero().flatten()
    assert c == q == expect.numel()
    assert torch.equal(oi[:c], expect) and torch.equal(ov[:c], acc[expect])
    strided = torch.randn(600, generator=gen(13))[::2]  # not contiguous
    assert K.sumsq(strided) == pytest.approx(sumsq_ref(strided.contiguous()), rel=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    n = 100_003
    g = torch.randn(n, generator=gen(14))
    r = torch.randn(n, generator=gen(15))
    oi, ov, rc = torch.zeros(2000, dtype=torch.int32), torch.zeros(2000), r.clone()
    cpu = K.ef_select(g, rc, 2.5, oi, ov)
    oig, ovg, rg = oi.cuda().zero_(), ov.cuda().zero_(), r.cuda()
    gpu = K.ef_select(g.cuda(), rg, 2.5, oig, ovg)
    rel = 1e-9 if K.gpu_kernels_available() else 1e-5  # the torch fallback accumulates rows in float32
    assert cpu[:2] == gpu[:2] and cpu[2:] == pytest.approx(gpu[2:], rel=rel)
    assert torch.equal(oig.cpu(), oi) and torch.equal(ovg.cpu(), ov) and torch.equal(rg.cpu(), rc)
    a, b = torch.empty(999, dtype=torch.int32), torch.empty(999, dtype=torch.int32, device="cuda")
    K.random_indices(n, 999, 3, a)
    K.random_indices(n, 999, 3, b)
    assert torch.equal(a, b.cpu())
    dense = torch.zeros(n, device="cuda")
    K.scatter_add(dense, oig[:cpu[0]], ovg[:cpu[0]])
    s = torch.empty(100, device="cuda")
    K.sample_abs(dense, None, 100, s)
    assert K.threshold_for_density(s, 0.5) >= 0
    assert K.gather_take(dense, oig[:cpu[0]], torch.empty(cpu[0], device="cuda"), True) == pytest.approx(
        cpu[3], rel=1e-9)
    assert K.sumsq(dense) == 0.0


# ---------------------------------------------------------------------------------- build and cache

def test_build_cache_reuses_the_library(tmp_path, monkeypatch):
    if _native.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("CROSSOVER_CACHE", str(tmp_path))
    path = K.build_kernels()
    if path is None:
        pytest.skip("the C compiler cannot build the kernels here")
    assert path.startswith(str(tmp_path / "kernels"))
    st = os.stat(path)

    def no_compiler(*a, **kw):
        raise AssertionError("the cached library should have been reused")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert K.build_kernels() == path
    st2 = os.stat(path)
    assert (st.st_ino, st.st_mtime_ns) == (st2.st_ino, st2.st_mtime_ns)
    assert os.listdir(tmp_path / "kernels") == [os.path.basename(path)]  # no temp files left
    monkeypatch.setattr(K._LIBRARY, "cflags", K.CFLAGS + ("-g",))
    assert str(K._LIBRARY.path()) != path  # the flags are part of the name


def test_build_failure_warns_once_and_returns_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CROSSOVER_CACHE", str(tmp_path))
    monkeypatch.setattr(K._LIBRARY, "warned", False)
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger=K.__name__):
        assert K.build_kernels() is None
        monkeypatch.setattr(_native, "compiler", lambda: None)
        assert K.build_kernels() is None
    assert len([r for r in caplog.records if r.name == K.__name__]) == 1
    assert os.listdir(tmp_path / "kernels") == []  # the failed attempt left nothing behind


@pytest.mark.parametrize("n", [1, 7, 64, 1001])
def test_bitmap_pack_and_add_round_trip(impl, n):
    gen = torch.Generator().manual_seed(n)
    k = max(1, n // 3)
    idx = torch.randperm(n, generator=gen)[:k].to(torch.int32)
    idx = torch.cat([idx, idx[:1]])  # one index twice: its values add up
    val = torch.randn(idx.numel(), generator=gen)
    nbytes = -(-n // 64) * 8
    bits = torch.full((nbytes,), 0xFF, dtype=torch.uint8)
    vals = torch.full((k + 3,), 7.0)
    c = K.bitmap_pack(idx, val, n, bits, vals)
    assert c == k and bool((vals[c:] == 0).all())
    out = torch.full((n,), 1.0)
    assert K.bitmap_add(out, bits, vals, 0.5) == k
    want = torch.ones(n)
    want.index_add_(0, idx.long(), val, alpha=0.5)
    torch.testing.assert_close(out, want)


def test_bitmap_add_refuses_marks_beyond_the_tensor_or_its_values(impl):
    with pytest.raises(ValueError, match="beyond"):
        K.bitmap_add(torch.zeros(9), torch.tensor([0, 2], dtype=torch.uint8), torch.ones(4))
    with pytest.raises(ValueError, match="more elements"):
        K.bitmap_add(torch.zeros(16), torch.tensor([7, 0], dtype=torch.uint8), torch.ones(2))
    with pytest.raises((IndexError, RuntimeError)):  # C: IndexError; torch's index_add_: its own error
        K.bitmap_pack(torch.tensor([9], dtype=torch.int32), torch.ones(1), 9, torch.zeros(2, dtype=torch.uint8),
                      torch.zeros(1))
