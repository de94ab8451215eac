"""CUDA tensors through the compression paths give the CPU path's results (skipped without CUDA).

Every compressor and the quantizer, with and without error feedback, through the framework-free
codecs with `SimulatedGroup` ranks in one process: the same gradients on the CPU (C kernels) and on
the GPU (the Triton kernels, then the pure-torch fallbacks) must select the same elements, send the
same values, decode to the same gradient and leave the same residuals, bit for bit; statistics
(float64 sums in another order) agree to rounding. Also the kernels one by one on edge cases, and the
scheduler's CUDA device id and synchronisation. `scripts/gpu_check.py` runs this file on a GPU machine.
"""

from __future__ import annotations

import re

import pytest
import torch
from codec_calls import quant_encode, sparse_encode

from crossover.compression import kernels as K
from crossover.compression import quantize as Q
from crossover.compression.collectives import SimulatedGroup
from crossover.compression.quant_codec import QuantCodec
from crossover.compression.sparse_codec import SparseCodec
from crossover.driver import StepRecord

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STATS_RTOL = 1e-5  # float64 sums in another order, then float32 on the wire


@pytest.fixture(params=["triton", "torch"])
def gpu_impl(request):
    """Run the test with the Triton kernels on CUDA tensors, then with the pure-torch fallbacks."""
    if request.param == "triton" and not K.gpu_kernels_available():
        pytest.skip("the Triton kernels are unavailable on this machine (see the warning logged)")
    K.use_gpu_kernels(request.param == "triton")
    yield request.param
    K.use_gpu_kernels(True)


def _grads(step: int, world: int, numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(world):
        g = torch.randn(numel, generator=gen)
        g[::97] *= 30.0  # some large entries, as real gradients have
        out.append(g)
    return out


def _bits_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal bit for bit (float32: -0.0 differs from 0.0); NaN equals NaN whatever its payload."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != torch.float32:
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a.view(torch.int32)[~na], b.view(torch.int32)[~nb])


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


# ------------------------------------------------------------------------------------- sparse codecs

SPARSE_PLANS = [(10.0, (10.0, 100.0)), (100.0, (10.0, 100.0)), (1.0, (10.0,)), (100.0, (100.0,)), (10.0, (10.0,))]


def _run_sparse(device: str, compressor: str, ef: bool, numel: int = 300_007, world: int = 2) -> list[dict]:
    grp = SimulatedGroup(world)
    codecs = [SparseCodec(compressor, error_feedback=ef, seed=7, grad_norms=True) for _ in range(world)]
    out = []
    for step, (cf, probes) in enumerate(SPARSE_PLANS, 1):
        rec = StepRecord(step=step, sent_cf=cf, probes=probes)
        grads = _grads(step, world, numel)
        enc = [sparse_encode(codecs[r], "w", grads[r].to(device), rec, 0.25, grp.rank_view(r)) for r in range(world)]
        reduced = sum(p for p, _, _ in enc) / world  # the host's Average
        for r in range(world):
            payload, ctx, sent = enc[r]
            kind, nstats = ctx.kind, ctx.nstats
            flat, stats = codecs[r].decode(reduced.clone(), ctx, grp.rank_view(r))
            out.append({"kind": kind, "sent": sent, "nstats": nstats, "payload": _cpu(payload), "out": _cpu(flat),
                        "stats": _cpu(stats), "residual": _cpu(codecs[r].memory.get("w"))})
    return out


@pytest.mark.parametrize("ef", [True, False], ids=["ef", "no-ef"])
@pytest.mark.parametrize("compressor", ["topk", "dgc", "redsync", "randomk"])
def test_sparse_codec_cuda_equals_cpu(gpu_impl, compressor, ef):
    cpu = _run_sparse("cpu", compressor, ef)
    gpu = _run_sparse("cuda", compressor, ef)
    kinds = {c["kind"] for c in cpu}
    assert "dense" in kinds and len(kinds) == 2  # the plans cover a sparse transport and the dense one
    for i, (c, g) in enumerate(zip(cpu, gpu)):
        where = f"{compressor} step/rank {i}"
        assert (c["kind"], c["sent"]) == (g["kind"], g["sent"]), where
        n = c["nstats"]
        assert _bits_equal(c["payload"][:-n], g["payload"][:-n]), where  # the values sent
        assert torch.allclose(c["payload"][-n:], g["payload"][-n:], rtol=STATS_RTOL), where
        assert _bits_equal(c["out"], g["out"]), where  # the decoded (averaged) gradient
        assert torch.allclose(c["stats"], g["stats"], rtol=STATS_RTOL), where
        assert _bits_equal(c["residual"], g["residual"]), where


# ------------------------------------------------------------------------------------- quantizer codec

def _run_quant(device: str, bits: int, ef: bool, transport: str, numel: int = 300_007, world: int = 2) -> list[dict]:
    grp = SimulatedGroup(world)
    codecs = [QuantCodec(error_feedback=ef, seed=3) for _ in range(world)]
    out = []
    for step in range(1, 4):
        grads = _grads(step, world, numel)
        enc = [quant_encode(codecs[r], "w", grads[r].to(device), bits, step, grp.rank_view(r), transport)
               for r in range(world)]
        reduced = sum(p for p, _, _ in enc) / world
        for r in range(world):
            payload, ctx, sent = enc[r]
            flat, stats = codecs[r].decode(reduced.clone(), ctx, grp.rank_view(r))
            out.append({"kind": ctx.kind, "sent": sent, "payload": _cpu(payload), "out": _cpu(flat),
                        "stats": torch.tensor(stats), "residual": _cpu(codecs[r].memory.get("w"))})
    return out


@pytest.mark.parametrize("transport", ["allgather", "allreduce"])
@pytest.mark.parametrize("ef", [True, False], ids=["ef", "no-ef"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quant_codec_cuda_equals_cpu(gpu_impl, bits, ef, transport):
    cpu = _run_quant("cpu", bits, ef, transport)
    gpu = _run_quant("cuda", bits, ef, transport)
    for i, (c, g) in enumerate(zip(cpu, gpu)):
        where = f"bits {bits} {transport} step/rank {i}"
        assert (c["kind"], c["sent"]) == (g["kind"], g["sent"]), where
        if c["kind"] == "allreduce":  # fp16 values, then the statistics
            assert torch.equal(c["payload"][:-2], g["payload"][:-2]), where
        assert _bits_equal(c["out"], g["out"]), where
        assert torch.allclose(c["stats"], g["stats"], rtol=STATS_RTOL), where
        assert _bits_equal(c["residual"], g["residual"]), where


# ------------------------------------------------------------------------------------- kernels

def _edge_values(n: int, seed: int) -> torch.Tensor:
    """Values on a 1/4 grid (ties at thresholds like 1.0) with NaN, +-inf and -0.0 sprinkled in."""
    x = torch.randint(-8, 9, (n,), generator=torch.Generator().manual_seed(seed)).float() / 4
    if n > 40:
        x[3], x[17], x[29], x[31] = float("nan"), float("inf"), float("-inf"), -0.0
    return x


SIZES = [0, 1, 7, 4095, 4096, 4097, 3 * 4096 + 5, 100_003]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_ef_select_cuda_equals_cpu(gpu_impl, n, with_residual):
    g = _edge_values(n, 1)
    r = _edge_values(n, 2) if with_residual else None
    acc = g if r is None else g + r
    qual = int((acc.abs() >= 1.0).sum())
    for cap in sorted({1, max(1, qual // 2), max(1, qual), qual + 10}):
        res = [None if r is None else r.clone(), None if r is None else r.cuda()]
        outs = [(torch.zeros(cap, dtype=torch.int32), torch.zeros(cap)),
                (torch.zeros(cap, dtype=torch.int32, device="cuda"), torch.zeros(cap, device="cuda"))]
        a = K.ef_select(g, res[0], 1.0, *outs[0])
        b = K.ef_select(g.cuda(), res[1], 1.0, *outs[1])
        assert a[:2] == b[:2] == (min(qual, cap), qual)
        assert all(x == pytest.approx(y, rel=1e-6, nan_ok=True) for x, y in zip(a[2:], b[2:]))
        assert torch.equal(outs[0][0], outs[1][0].cpu()) and _bits_equal(outs[0][1], outs[1][1].cpu())
        assert _bits_equal(res[0], _cpu(res[1]))


@pytest.mark.parametrize("n", SIZES)
def test_sums_cuda_equal_cpu(gpu_impl, n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    r = torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
    rel = 1e-9 if gpu_impl == "triton" else 1e-5  # the fallback accumulates rows in float32
    assert K.sumsq(g.cuda()) == pytest.approx(K.sumsq(g), rel=rel, abs=1e-30)
    rc, rg = r.clone(), r.cuda()
    assert K.ef_accumulate(g.cuda(), rg) == pytest.approx(K.ef_accumulate(g, rc), rel=rel, abs=1e-30)
    assert _bits_equal(rc, rg.cpu())


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 2047, 2048, 2049, 100_003])
@pytest.mark.parametrize("bits", list(range(Q.MIN_BITS, Q.MAX_BITS + 1)))
def test_quantizer_kernels_cuda_equal_cpu(gpu_impl, n, bits):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + bits)) * 3
    if n > 40:
        x[3], x[17], x[29], x[31] = float("nan"), float("inf"), float("-inf"), -0.0
    xg = x.cuda()
    s = Q.levels_for_bits(bits)
    scale = 2.5
    for seed in (1, 12345, 2**63 + 17, 2**64 - 1):  # Triton types a seed by its size: every kind of int
        lev, levg = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32, device="cuda")
        res, resg = torch.empty(n), torch.empty(n, device="cuda")
        Q.quantize_levels(x, scale, s, seed, lev, residual_out=res)
        Q.quantize_levels(xg, scale, s, seed, levg, residual_out=resg)
        assert torch.equal(lev, levg.cpu()) and _bits_equal(res, resg.cpu())
        nb = Q.packed_nbytes(n, bits)
        pk, pkg = torch.empty(nb, dtype=torch.uint8), torch.empty(nb, dtype=torch.uint8, device="cuda")
        ip, ipg = x.clone(), xg.clone()  # residual written in place
        Q.quantize_pack(ip, scale, s, bits, seed, pk, residual_out=ip)
        Q.quantize_pack(ipg, scale, s, bits, seed, pkg, residual_out=ipg)
        assert torch.equal(pk, pkg.cpu()) and _bits_equal(ip, ipg.cpu())
    dec, decg = torch.full((n,), 0.25), torch.full((n,), 0.25, device="cuda")
    Q.unpack_dequantize(pk, n, scale, s, bits, dec, True, 0.75)
    Q.unpack_dequantize(pkg, n, scale, s, bits, decg, True, 0.75)
    assert _bits_equal(dec, decg.cpu())
    ul, ulg = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32, device="cuda")
    Q.unpack_levels(pk, n, s, bits, ul)
    Q.unpack_levels(pkg, n, s, bits, ulg)
    assert torch.equal(ul, ulg.cpu()) and torch.equal(ul, lev)
    for acc in (False, True):
        dq, dqg = torch.ones(n), torch.ones(n, device="cuda")
        Q.dequantize_levels(lev, scale, s, dq, -0.5, accumulate=acc)
        Q.dequantize_levels(levg, scale, s, dqg, -0.5, accumulate=acc)
        assert _bits_equal(dq, dqg.cpu())
    assert Q.absmax(x) == pytest.approx(Q.absmax(xg), nan_ok=True)


def test_unaligned_packed_slices_decode_alike(gpu_impl):
    """The allgather path decodes each rank's codes from an offset slice of the gathered bytes."""
    n, bits = 10_001, 5
    s = Q.levels_for_bits(bits)
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    pk = torch.empty(3 + Q.packed_nbytes(n, bits), dtype=torch.uint8)
    Q.quantize_pack(x, 4.0, s, bits, 9, pk[3:])
    pkg = pk.cuda()
    a, b = torch.zeros(n), torch.zeros(n, device="cuda")
    Q.unpack_dequantize(pk[3:], n, 4.0, s, bits, a)
    Q.unpack_dequantize(pkg[3:], n, 4.0, s, bits, b)
    assert _bits_equal(a, b.cpu())


# ------------------------------------------------------------------------------------- scheduler on CUDA

def test_scheduler_cuda_device_id_and_sync(monkeypatch):
    """The scheduler names a CUDA worker's device by its physical GPU and synchronises before a release."""
    from horovod_ext import scheduling

    monkeypatch.delenv("CROSSOVER_DEVICE", raising=False)
    x = torch.randn(4096, 4096, device="cuda")
    dev = scheduling.resolve_device()
    assert re.fullmatch(r"cuda-[0-9a-fA-F-]{32,36}", dev), dev
    assert dev == f"cuda-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # read only without a uuid; the uuid stays the id
    assert scheduling.resolve_device() == dev
    done = torch.cuda.Event()
    for _ in range(20):
        x = x @ x
        x /= x.norm()
    done.record()
    scheduling._cuda_sync(dev)
    assert done.query()  # everything queued before the release has run
