"""The stochastic quantizer: unbiasedness, packing round trips, C kernels vs torch fallback, edge cases."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from crossover.compression import kernels as K
from crossover.compression import quantize as Q

HAVE_C = Q.quantize_kernels_available()
HAVE_SIMD = Q.use_simd(True)
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 1023, 1024, 1025, 1056, 5003]
ALL_BITS = list(range(Q.MIN_BITS, Q.MAX_BITS + 1))


@pytest.fixture(params=["c", "c-portable", "torch"])
def impl(request):
    """Run the test with the C kernels (their AVX2 paths where the CPU has them), the portable C
    code only, and the pure-torch fallbacks."""
    if request.param != "torch" and not HAVE_C:
        pytest.skip("C quantizer unavailable (no compiler?)")
    if request.param == "c-portable" and not HAVE_SIMD:
        pytest.skip("the C kernels have no SIMD path on this machine: 'c' already runs the portable code")
    Q.use_kernels(request.param != "torch")
    Q.use_simd(request.param != "c-portable")
    yield request.param
    Q.use_kernels(True)
    Q.use_simd(True)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample(n: int, seed: int) -> torch.Tensor:
    """Gradient-like values: normal, with exact zeros, a few large ones and tiny ones."""
    x = torch.randn(n, generator=gen(seed))
    if n >= 8:
        x[::7] = 0.0
        x[3::11] *= 20.0
        x[5::13] *= 1e-6
    return x


def levels_of(x, scale, s, seed):
    out = torch.empty(x.numel(), dtype=torch.int32)
    Q.quantize_levels(x, scale, s, seed, out)
    return out


def with_impl(use_c: bool, fn):
    Q.use_kernels(use_c)
    try:
        return fn()
    finally:
        Q.use_kernels(True)


# ---------------------------------------------------------------------------------------------- parameters

def test_bits_levels_mapping():
    assert [Q.levels_for_bits(b) for b in ALL_BITS] == [1, 3, 7, 15, 31, 63, 127]
    for b in ALL_BITS:
        assert Q.bits_for_levels(Q.levels_for_bits(b)) == b
        assert Q.bits_for_levels(Q.levels_for_bits(b)) == math.ceil(math.log2(Q.levels_for_bits(b) + 1)) + 1
    assert Q.bits_for_levels(4) == 4  # 4 levels need 3 magnitude bits
    assert Q.packed_nbytes(0, 3) == 0 and Q.packed_nbytes(1, 3) == 1 and Q.packed_nbytes(8, 3) == 3
    assert Q.packed_nbytes(25_000_003, 5) == math.ceil(25_000_003 * 5 / 8)


@pytest.mark.parametrize("call, match", [
    (lambda x, o, p: Q.quantize_levels(x, -1.0, 3, 0, o), "scale"),
    (lambda x, o, p: Q.quantize_levels(x, float("nan"), 3, 0, o), "scale"),
    (lambda x, o, p: Q.quantize_levels(x, 1.0, 0, 0, o), "s must"),
    (lambda x, o, p: Q.quantize_levels(x, 1.0, 3, 1.5, o), "seed"),
    (lambda x, o, p: Q.quantize_levels(x, 1.0, 3, 0, o[:5]), "out has"),
    (lambda x, o, p: Q.quantize_levels(x.view(4, 4), 1.0, 3, 0, o), "1-D"),
    (lambda x, o, p: Q.quantize_pack(x, 1.0, 3, 1, 0, p), "bits"),
    (lambda x, o, p: Q.quantize_pack(x, 1.0, 3, 9, 0, p), "bits"),
    (lambda x, o, p: Q.quantize_pack(x, 1.0, 4, 3, 0, p), r"s must be an int in \[1, 3\]"),
    (lambda x, o, p: Q.quantize_pack(x, 1.0, 1, 2, 0, p[:3]), "packed|out has"),
    (lambda x, o, p: Q.unpack_dequantize(p, 16, 1.0, 1, 2, torch.empty(16), False, float("inf")), "weight"),
    (lambda x, o, p: Q.unpack_levels(p, 16, 1, 2, torch.empty(16, dtype=torch.int32)[:8]), "out has"),
    (lambda x, o, p: Q.dequantize_levels(o, 1.0, 3, torch.empty(3)), "out has"),
])
def test_validation_messages(call, match):
    x = torch.zeros(16)
    o = torch.zeros(16, dtype=torch.int32)
    p = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        call(x, o, p)


def test_wrong_dtypes_raise_type_error():
    with pytest.raises(TypeError, match="out must be torch.int32"):
        Q.quantize_levels(torch.zeros(4), 1.0, 1, 0, torch.zeros(4))
    with pytest.raises(TypeError, match="x must be torch.float32"):
        Q.quantize_levels(torch.zeros(4, dtype=torch.float64), 1.0, 1, 0, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="out must be torch.uint8"):
        Q.quantize_pack(torch.zeros(4), 1.0, 1, 2, 0, torch.zeros(4, dtype=torch.int8))


# ---------------------------------------------------------------------------------------------- unbiasedness

@pytest.mark.parametrize("s", [1, 7, 127])
def test_mean_of_many_quantizations_converges(s):
    """E[decode(Q(x))] = x, checked with a bound derived from the spread of one draw.

    One decoded element takes one of two adjacent values scale/s apart (floor or ceil of its level),
    so by Hoeffding the mean of N independent draws satisfies
        P(|mean - x| >= c * scale / (2 s sqrt(N))) <= 2 exp(-c^2 / 2),
    the same scale as the variance bound (variance <= scale^2 / (4 s^2) per draw). With c = 6 that
    is <= 3.1e-8 per element, <= 1.3e-4 for all 4096 elements together (union bound). On top we
    allow the deterministic bias of the 16-bit random grid (<= 2^-17 of a level) and of float32
    rounding (<= 2^-23 * scale): 1e-5 * scale / s + 1e-6 * scale in all.
    The mean over all elements of the error is checked too: it averages N * d independent draws.
    """
    d, n_draws, c = 4096, 400, 6.0
    x = sample(d, 1)
    scale = Q.absmax(x)
    lev = torch.empty(d, dtype=torch.int32)
    acc = torch.zeros(d, dtype=torch.float64)
    dec = torch.empty(d)
    for seed in range(n_draws):
        Q.quantize_levels(x, scale, s, 1000 + seed, lev)
        Q.dequantize_levels(lev, scale, s, dec)
        acc += dec.double()
    mean = acc / n_draws
    err = (mean - x.double()).abs()
    slack = 1e-5 * scale / s + 1e-6 * scale
    bound = c * scale / (2 * s * math.sqrt(n_draws)) + slack
    assert float(err.max()) <= bound, (float(err.max()), bound)
    overall = float((mean - x.double()).mean().abs())
    assert overall <= c * scale / (2 * s * math.sqrt(n_draws * d)) + slack
    # exact zeros and exact multiples of scale/s never move
    zeros = x == 0
    assert bool((mean[zeros] == 0).all())


def test_variance_within_qsgd_bound():
    """E||Q(x) - x||^2 <= min(d/(4 s^2), sqrt(d)/s) ||x||^2 for the max-norm scale (module docstring)."""
    d = 2048
    x = sample(d, 2)
    scale = Q.absmax(x)
    dec = torch.empty(d)
    for s in (1, 3, 31):
        sq = 0.0
        draws = 50
        for seed in range(draws):
            lev = levels_of(x, scale, s, seed)
            Q.dequantize_levels(lev, scale, s, dec)
            sq += float(((dec.double() - x.double()) ** 2).sum())
        bound = min(d / (4 * s * s), math.sqrt(d) / s) * float((x.double() ** 2).sum())
        assert sq / draws <= bound


# ---------------------------------------------------------------------------------------------- packing

def pack_reference(levels: list[int], s: int, bits: int) -> bytes:
    """The documented format, bit by bit: code = level + s, element i at stream bits [i*b, (i+1)*b)."""
    nbytes = (len(levels) * bits + 7) // 8
    out = bytearray(nbytes)
    for i, lev in enumerate(levels):
        code = lev + s
        for k in range(bits):
            if code >> k & 1:
                pos = i * bits + k
                out[pos // 8] |= 1 << (pos % 8)
    return bytes(out)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_packed_layout_matches_reference(impl, bits):
    s = Q.levels_for_bits(bits)
    for n in (1, 5, 8, 13, 40, 77):
        x = sample(n, n + bits)
        scale = Q.absmax(x) or 1.0
        lev = levels_of(x, scale, s, 7)
        packed = torch.zeros(Q.packed_nbytes(n, bits), dtype=torch.uint8)
        assert Q.quantize_pack(x, scale, s, bits, 7, packed) == packed.numel()
        assert bytes(packed.tolist()) == pack_reference(lev.tolist(), s, bits)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_round_trip_and_no_overrun(impl, bits):
    """Packed codes decode to exactly the levels of quantize_levels (same seed); nothing past ceil(n b / 8)."""
    for n, s in itertools.product(SIZES + [70_001], sorted({1, Q.levels_for_bits(bits)})):
        x = sample(n, bits * 1000 + n)
        scale = Q.absmax(x)
        lev = levels_of(x, scale, s, 42)
        nbytes = Q.packed_nbytes(n, bits)
        buf = torch.full((nbytes + 40,), 0xAB, dtype=torch.uint8)
        assert Q.quantize_pack(x, scale, s, bits, 42, buf) == nbytes
        assert bool((buf[nbytes:] == 0xAB).all()), "wrote past the packed bytes"
        used = (n * bits) % 8  # bits of the last byte that hold codes (0: all 8)
        if used:
            assert int(buf[nbytes - 1]) >> used == 0, "padding bits of the last byte must be 0"
        back = torch.full((n + 5,), -999, dtype=torch.int32)
        Q.unpack_levels(buf[:nbytes], n, s, bits, back)
        assert torch.equal(back[:n], lev)
        assert bool((back[n:] == -999).all())
        assert int(lev.abs().max()) <= s if n else True


@pytest.mark.parametrize("bits", ALL_BITS)
def test_unpack_dequantize_accumulates_weighted(impl, bits):
    """The allgather path: each rank's slice decoded and added with its own scale and a weight."""
    s, n = Q.levels_for_bits(bits), 3001
    xs = [sample(n, r) * (r + 1) for r in range(3)]
    out = torch.full((n,), 0.5)
    expect = torch.full((n,), 0.5)
    for r, x in enumerate(xs):
        scale = Q.absmax(x)
        packed = torch.empty(Q.packed_nbytes(n, bits), dtype=torch.uint8)
        Q.quantize_pack(x, scale, s, bits, r, packed)
        Q.unpack_dequantize(packed, n, scale, s, bits, out, True, 1 / 3)
        sw = float(torch.tensor(scale / s / 3, dtype=torch.float32))
        expect += levels_of(x, scale, s, r).float() * sw
    assert torch.equal(out, expect)
    Q.unpack_dequantize(packed, n, scale, s, bits, out, False, 1.0)
    lev = levels_of(xs[-1], scale, s, 2)
    assert torch.equal(out, lev.float() * float(torch.tensor(scale / s, dtype=torch.float32)))


# ---------------------------------------------------------------------------------------------- C vs fallback

def _all_outputs(x: torch.Tensor, scale: float, s: int, bits: int, seed: int) -> dict[str, torch.Tensor]:
    n = x.numel()
    lev = torch.empty(n, dtype=torch.int32)
    Q.quantize_levels(x, scale, s, seed, lev)
    res = x.clone()
    lev2 = torch.empty(n, dtype=torch.int32)
    Q.quantize_levels(res, scale, s, seed, lev2, residual_out=res)  # in place
    packed = torch.empty(Q.packed_nbytes(n, bits), dtype=torch.uint8)
    res_p = torch.empty(n)
    Q.quantize_pack(x, scale, s, bits, seed, packed, residual_out=res_p)
    dec = torch.full((n,), 0.25)
    Q.unpack_dequantize(packed, n, scale, s, bits, dec, True, 0.75)
    dq = torch.empty(n)
    Q.dequantize_levels(lev, scale, s, dq, 0.5)
    dqa = torch.ones(n)
    Q.dequantize_levels(lev, scale, s, dqa, -2.0, accumulate=True)
    ul = torch.empty(n, dtype=torch.int32)
    Q.unpack_levels(packed, n, s, bits, ul)
    assert torch.equal(lev, lev2) and torch.equal(ul, lev)
    return {"levels": lev, "residual_in_place": res, "packed": packed, "residual_pack": res_p,
            "unpack_acc": dec, "dequant": dq, "dequant_acc": dqa,
            "absmax": torch.tensor([Q.absmax(x)]) if n else torch.zeros(1)}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


@pytest.mark.skipif(not HAVE_C, reason="C quantizer unavailable (no compiler?)")
@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("n", [0, 1, 9, 31, 33, 1024, 1025, 2100, 4133])
def test_c_and_fallback_identical(bits, n):
    x = sample(n, n * 7 + bits)
    if n >= 40:  # non-finite inputs, signed zeros, a value above the scale (saturates)
        x[1], x[2], x[3], x[4], x[5] = float("nan"), float("inf"), -float("inf"), -0.0, 1e30
        x[6] = -float("nan")
    finite = x[torch.isfinite(x) & (x.abs() < 1e29)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    s = Q.levels_for_bits(bits)
    for seed in (0, 2**64 - 1, -5):
        t = with_impl(False, lambda seed=seed: _all_outputs(x, scale, s, bits, seed))
        for simd in (True, False):
            Q.use_simd(simd)
            try:
                c = with_impl(True, lambda seed=seed: _all_outputs(x, scale, s, bits, seed))
            finally:
                Q.use_simd(True)
            for key in c:
                if key == "absmax":
                    assert (math.isnan(float(c[key])) and math.isnan(float(t[key]))) or torch.equal(c[key], t[key])
                    continue
                assert _bitwise_equal(c[key], t[key]), (key, n, bits, seed, simd)


@pytest.mark.skipif(not HAVE_C, reason="C quantizer unavailable (no compiler?)")
def test_c_handles_unaligned_views_and_kernels_switch():
    base = sample(5000, 3)
    x = base[3:]  # storage offset: not 32-byte aligned
    scale = Q.absmax(x)
    a = with_impl(True, lambda: levels_of(x, scale, 7, 9))
    b = with_impl(False, lambda: levels_of(x, scale, 7, 9))
    assert torch.equal(a, b)
    K.use_kernels(False)  # the global switch of kernels.py also turns the quantizer's C off
    try:
        assert not Q.quantize_kernels_available()
    finally:
        K.use_kernels(True)
    assert Q.quantize_kernels_available()


@pytest.mark.skipif(not HAVE_C, reason="C quantizer unavailable (no compiler?)")
def test_large_outputs_use_streaming_stores_with_same_results():
    """Outputs >= 16 MiB take the non-temporal store path; their prefix must equal a small call's."""
    n, m = (16 << 20) // 4 + 37, 100_003
    x = sample(n, 5)
    scale = Q.absmax(x)
    big = levels_of(x, scale, 15, 11)
    small = levels_of(x[:m].clone(), scale, 15, 11)  # same indices, same seed -> same levels
    assert torch.equal(big[:m], small)
    out_big, out_small = torch.empty(n), torch.empty(m)
    Q.dequantize_levels(big, scale, 15, out_big, 0.5)
    Q.dequantize_levels(small, scale, 15, out_small, 0.5)
    assert torch.equal(out_big[:m], out_small)
    packed = torch.empty(Q.packed_nbytes(n, 5), dtype=torch.uint8)
    Q.quantize_pack(x, scale, 15, 5, 11, packed)
    Q.unpack_dequantize(packed, n, scale, 15, 5, out_big, False, 0.5)
    assert torch.equal(out_big[:m], out_small)
    tail = slice(n - 1000, n)
    expect = big[tail].float() * float(torch.tensor(scale / 15 * 0.5, dtype=torch.float32))
    assert torch.equal(out_big[tail], expect)


# ---------------------------------------------------------------------------------------------- semantics

def test_levels_in_range_and_saturation(impl):
    x = torch.linspace(-3, 3, 1001)
    for s in (1, 5, 127, 1000):
        lev = levels_of(x, 1.0, s, 3)  # scale below max|x|: saturates at +-s
        assert int(lev.max()) == s and int(lev.min()) == -s
        assert bool((lev[x.abs() >= 1] == torch.sign(x[x.abs() >= 1]).int() * s).all())
        lev = levels_of(x, 3.0, s, 3)
        assert int(lev.abs().max()) <= s
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    assert levels_of(special, 1.0, 7, 0).tolist() == [7, -7, 7, -7, 0, 0]
    assert levels_of(torch.randn(100), 0.0, 7, 0).abs().max() == 0  # zero scale: all levels 0


def test_ternary_terngrad(impl):
    """s = 1 with the max-norm scale: levels in {-1, 0, 1}, P(+-1) = |x| / max|x|, the max always kept."""
    n = 20_000
    x = sample(n, 8)
    scale = Q.absmax(x)
    packed = torch.empty(Q.packed_nbytes(n, 2), dtype=torch.uint8)
    assert Q.quantize_ternary(x, scale, 5, packed) == n // 4
    lev = torch.empty(n, dtype=torch.int32)
    Q.unpack_levels(packed, n, 1, 2, lev)
    assert torch.equal(lev, levels_of(x, scale, 1, 5))
    assert set(lev.unique().tolist()) <= {-1, 0, 1}
    top = x.abs().argmax()
    assert int(lev[top]) == int(torch.sign(x[top]))
    assert bool((lev[x == 0] == 0).all())
    assert bool((lev * torch.sign(x).int() >= 0).all())  # never the opposite sign
    p = (x.abs() / scale).double()
    hits = lev.abs().double()
    # total count of +-1 vs its expectation: sum of independent Bernoullis, 6 standard deviations
    assert abs(float(hits.sum() - p.sum())) <= 6 * math.sqrt(float((p * (1 - p)).sum())) + 1


def test_seeds_and_reproducibility(impl):
    x = sample(3000, 4)
    scale = Q.absmax(x)
    a, b, c = levels_of(x, scale, 3, 1), levels_of(x, scale, 3, 1), levels_of(x, scale, 3, 2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(levels_of(x, scale, 3, -1), levels_of(x, scale, 3, 2**64 - 1))  # seeds are mod 2^64


def test_residual_out_is_the_quantization_error(impl):
    x = sample(2000, 6)
    scale = Q.absmax(x)
    res = torch.empty(2000)
    lev = torch.empty(2000, dtype=torch.int32)
    Q.quantize_levels(x, scale, 7, 3, lev, residual_out=res)
    step = float(torch.tensor(scale / 7, dtype=torch.float32))
    assert torch.equal(res, x - lev.float() * step)
    assert float(res.abs().max()) <= step * (1 + 1e-6)


def test_absmax(impl):
    assert Q.absmax(torch.empty(0)) == 0.0
    assert Q.absmax(torch.tensor([1.0, -3.5, 2.0])) == 3.5
    assert math.isnan(Q.absmax(torch.tensor([1.0, float("nan"), -2.0])))
    assert Q.absmax(torch.tensor([-float("inf"), 1.0])) == math.inf
    x = sample(10_007, 9)
    assert Q.absmax(x) == float(x.abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gpu_kernels", [True, False], ids=["triton", "torch"])
def test_cuda_matches_cpu(gpu_kernels):
    if gpu_kernels and not K.gpu_kernels_available():
        pytest.skip("the Triton kernels are unavailable on this machine")
    K.use_gpu_kernels(gpu_kernels)
    try:
        _check_cuda_matches_cpu()
    finally:
        K.use_gpu_kernels(True)


def _check_cuda_matches_cpu():
    x = sample(10_003, 10)
    scale = Q.absmax(x)
    for bits in ALL_BITS:
        s = Q.levels_for_bits(bits)
        cpu = _all_outputs(x, scale, s, bits, 77)
        xg = x.cuda()
        n = xg.numel()
        lev = torch.empty(n, dtype=torch.int32, device="cuda")
        Q.quantize_levels(xg, scale, s, 77, lev)
        packed = torch.empty(Q.packed_nbytes(n, bits), dtype=torch.uint8, device="cuda")
        Q.quantize_pack(xg, scale, s, bits, 77, packed)
        dec = torch.full((n,), 0.25, device="cuda")
        Q.unpack_dequantize(packed, n, scale, s, bits, dec, True, 0.75)
        assert torch.equal(lev.cpu(), cpu["levels"])
        assert torch.equal(packed.cpu(), cpu["packed"])
        assert torch.equal(dec.cpu(), cpu["unpack_acc"])
