"""Unit tests of the pure-Python DQ-SGD bit-width policy with plain synthetic numbers."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from crossover.adaptive.dqsgd import (
    VARIANCE_BOUNDS,
    BitsPlan,
    DqsgdPolicy,
    DqsgdStats,
    error_budget_for_bits,
    quantization_variance,
    target_levels,
)
from crossover.compression.wire import levels_for_bits

D = 1_000_000


def make(**kw) -> DqsgdPolicy:
    args = {"total_steps": 1000, "error_budget": 1.0}
    args.update(kw)
    return DqsgdPolicy(**args)


def bits_after(policy: DqsgdPolicy, g: float, lr: float = 0.1, step: int | None = None, numel: int = D) -> int:
    policy.observe(DqsgdStats(grad_sq_norm=g, numel=numel, lr=lr, step=step))
    return policy.plan().bits


def unclamped_bits(s_target: float) -> int:
    """Smallest b with 2**(b-1) - 1 >= s_target, straight from the definition."""
    b = 1
    while (1 << (b - 1)) - 1 < s_target * (1 - 1e-12):
        b += 1
    return b


# ---------------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, match", [
    ({"total_steps": 0}, "total_steps must be an int >= 1"),
    ({"total_steps": 10.0}, "total_steps must be an int >= 1"),
    ({"total_steps": True}, "total_steps must be an int >= 1"),
    ({"error_budget": 0.0}, r"error_budget must be a finite number > 0"),
    ({"error_budget": float("inf")}, r"error_budget must be a finite number > 0"),
    ({"b_min": 1}, r"b_min must be an int in \[2, 8\]"),
    ({"b_min": 2.0}, r"b_min must be an int in \[2, 8\]"),
    ({"b_max": 9}, r"b_max must be an int in \[2, 8\]"),
    ({"b_min": 6, "b_max": 4}, "b_min must be <= b_max, got b_min=6 b_max=4"),
    ({"decay": 1.0}, r"decay must be in \(0, 1\)"),
    ({"decay": 0.0}, r"decay must be in \(0, 1\)"),
    ({"decay": float("nan")}, r"decay must be in \(0, 1\)"),
    ({"variance_bound": "qsgd"}, "variance_bound must be one of min, d/s\\^2, sqrt\\(d\\)/s"),
    ({"ewma_alpha": 0.0}, r"ewma_alpha must be in \(0, 1\]"),
    ({"ewma_alpha": 1.5}, r"ewma_alpha must be in \(0, 1\]"),
    ({"initial_bits": 9}, r"initial_bits must be None or an int in \[b_min, b_max\]"),
    ({"b_max": 4, "initial_bits": 5}, r"initial_bits must be None or an int in \[b_min, b_max\] = \[2, 4\]"),
])
def test_validation_messages(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_plan_before_any_observation_and_levels():
    assert make().plan() == BitsPlan(bits=8, levels=127)
    assert make(initial_bits=3).plan() == BitsPlan(bits=3, levels=3)
    assert make(b_min=3, b_max=5).plan() == BitsPlan(bits=5, levels=15)
    for b in range(2, 9):
        assert levels_for_bits(b) == 2 ** (b - 1) - 1
        assert b == math.ceil(math.log2(levels_for_bits(b) + 1)) + 1


# ---------------------------------------------------------------------------------------------- the rule

def test_closed_form_on_each_branch():
    """1 + log2 s_t is the closed form of the docstring: REFERENCE.md's on d/s^2, doubled on sqrt(d)/s."""
    rng = random.Random(0)
    for _ in range(200):
        g, lr, d = 10 ** rng.uniform(-4, 4), 10 ** rng.uniform(-4, 0), rng.randint(1, 10**8)
        T, decay, eps = rng.randint(1, 10**4), rng.uniform(0.99, 0.99999), 10 ** rng.uniform(-8, 2)
        t = rng.randint(0, T - 1)
        kw = dict(grad_sq_norm=g, numel=d, lr=lr, step=t, total_steps=T, decay=decay, error_budget=eps)
        norm_term = math.log2(math.sqrt(g)) + math.log2(lr)
        b0 = 1 + 0.5 * math.log2(d * T / eps)
        ref = b0 + norm_term + (T - 1 - t) / 2 * math.log2(decay)
        b0_sqrt = 1 + 0.5 * math.log2(d) + math.log2(T / eps)
        doubled = b0_sqrt + 2 * norm_term + (T - 1 - t) * math.log2(decay)
        got = {vb: 1 + math.log2(target_levels(variance_bound=vb, **kw)) for vb in VARIANCE_BOUNDS}
        assert got["d/s^2"] == pytest.approx(ref, abs=1e-9)
        assert got["sqrt(d)/s"] == pytest.approx(doubled, abs=1e-9)
        assert got["min"] == pytest.approx(min(ref, doubled), abs=1e-9)
        # each step's share of the bound is epsilon / T at the continuous target, on every bound
        w = decay ** (T - 1 - t) * lr * lr * g
        for vb in VARIANCE_BOUNDS:
            s = target_levels(variance_bound=vb, **kw)
            assert w * quantization_variance(s, d, vb) == pytest.approx(eps / T, rel=1e-9)


def test_continuous_closed_form_minimises_total_bits():
    """Relaxation (s = 2^(b-1) real, q = d/s^2): a grid search over the budget surface finds the closed form."""
    T, d, decay, eps = 3, 10_000, 0.8, 1e-3
    g, lr = [4.0, 1.0, 2.0], [0.1, 0.05, 0.02]
    w = [decay ** (T - 1 - t) * lr[t] ** 2 * g[t] for t in range(T)]
    closed = [1 + math.log2(target_levels(grad_sq_norm=g[t], numel=d, lr=lr[t], step=t, total_steps=T, decay=decay,
                                          error_budget=eps, variance_bound="d/s^2")) for t in range(T)]

    def total(b0, b1):
        """Total bits when steps 0 and 1 get b0, b1 and the last step spends the rest of the budget."""
        rest = eps - w[0] * d / 4.0 ** (b0 - 1) - w[1] * d / 4.0 ** (b1 - 1)
        return math.inf if rest <= 0 else b0 + b1 + 1 + 0.5 * math.log2(w[2] * d / rest)

    best, center, width = math.inf, (6.0, 6.0), 8.0
    for _ in range(6):  # coarse-to-fine grid search, 41 x 41 points per round
        pts = [center[0] - width + width * i / 20 for i in range(41)]
        qts = [center[1] - width + width * i / 20 for i in range(41)]
        best, center = min((total(a, b), (a, b)) for a in pts for b in qts)
        width /= 8
    b2 = best - center[0] - center[1]
    assert best == pytest.approx(sum(closed), abs=1e-6)
    assert [center[0], center[1], b2] == pytest.approx(closed, abs=1e-3)


def test_integer_plans_against_brute_force():
    """Over random small problems, the per-step rule meets the budget and is within T - 1 bits of
    the fewest total bits that meet it (brute force over [2, 8]^T, exact s = 2^(b-1) - 1 and the
    exact bound). The ceiling argument gives < T on a single branch of the bound; measured: <= T - 1."""
    rng = random.Random(1)
    checked = 0
    gaps = []
    while checked < 60:
        T = rng.choice([2, 3, 4])
        d = rng.choice([10, 100, 1000, 10**6])
        decay = rng.uniform(0.3, 0.99)
        bound = rng.choice(VARIANCE_BOUNDS)
        g = [rng.uniform(0.1, 10) for _ in range(T)]
        lr = [rng.uniform(0.01, 0.5) for _ in range(T)]
        w = [decay ** (T - 1 - t) * lr[t] ** 2 * g[t] for t in range(T)]
        eps = error_budget_for_bits(rng.choice([3, 4, 5]), grad_sq_norm=g[-1], numel=d, lr=lr[-1], total_steps=T,
                                    variance_bound=bound) * rng.uniform(0.5, 3)
        policy = DqsgdPolicy(total_steps=T, error_budget=eps, decay=decay, variance_bound=bound, b_min=2, b_max=8)
        plans = [unclamped_bits(target_levels(grad_sq_norm=g[t], numel=d, lr=lr[t], step=t, total_steps=T,
                                              decay=decay, error_budget=eps, variance_bound=bound))
                 for t in range(T)]
        if any(not 2 <= b <= 8 for b in plans):
            continue  # clamped: the budget cannot be met exactly, skip
        for t in range(1, T):  # the policy plans step t from the numbers observed at step t - 1
            p = DqsgdPolicy.from_state_dict(policy.state_dict())
            p.observe(DqsgdStats(grad_sq_norm=g[t], numel=d, lr=lr[t], step=t - 1))
            assert p.plan().bits == plans[t]

        def spent(bs, w=w, d=d, bound=bound, T=T):
            return sum(w[t] * quantization_variance(levels_for_bits(bs[t]), d, bound) for t in range(T))

        assert spent(plans) <= eps * (1 + 1e-9)
        best = min(sum(bs) for bs in itertools.product(range(2, 9), repeat=T) if spent(bs) <= eps)
        gaps.append(sum(plans) - best)
        assert 0 <= sum(plans) - best <= T - 1
        checked += 1
    assert min(gaps) == 0  # often exactly optimal


def test_bits_grow_with_gradient_norm_and_lr():
    policy = make(total_steps=100, error_budget=1e-3, variance_bound="min")
    seen = []
    for g in [2.0**k for k in range(-40, 10)]:
        p = DqsgdPolicy.from_state_dict(policy.state_dict())
        seen.append(bits_after(p, g, lr=0.1, step=98))
    assert seen == sorted(seen) and seen[0] == 2 and seen[-1] == 8 and set(seen) == set(range(2, 9))
    by_lr = []
    for lr in [2.0 ** (k / 2) for k in range(-40, 1)]:
        p = DqsgdPolicy.from_state_dict(policy.state_dict())
        by_lr.append(bits_after(p, 1e-2, lr=lr, step=98))
    assert by_lr == sorted(by_lr) and set(by_lr) == set(range(2, 9))


def test_bits_grow_toward_the_end_of_training():
    T = 20_000
    eps = error_budget_for_bits(8, grad_sq_norm=1.0, numel=D, lr=0.1, total_steps=T)
    policy = make(total_steps=T, error_budget=eps, decay=0.999)
    planned = {}  # step -> bits
    for t in range(T - 1):
        policy.observe(DqsgdStats(grad_sq_norm=1.0, numel=D, lr=0.1))
        planned[t + 1] = policy.plan().bits
    bits = [planned[t] for t in sorted(planned)]
    assert bits == sorted(bits)
    assert bits[0] == 2 and bits[-1] == 8  # calibrated: s_t = 127 exactly (8 bits) on the last step
    # With d = 10^6 every target is below sqrt(d): the sqrt(d)/s branch, where s_t halves every
    # 1/|log2 decay| = 693 steps before the end. So 8 bits (s_t > 63) over the last 693 * log2(127/63)
    # steps, and more than 2 bits (s_t > 1) over the last 693 * log2(127) steps.
    halving = 1 / -math.log2(0.999)
    first = {b: min(t for t, v in planned.items() if v >= b) for b in (3, 8)}
    assert first[8] == pytest.approx(T - 1 - halving * math.log2(127 / 63), abs=2)
    assert first[3] == pytest.approx(T - 1 - halving * math.log2(127), abs=2)


def test_clamping_zero_gradient_and_summary():
    policy = make(b_min=3, b_max=6)
    assert bits_after(policy, 1e12) == 6
    s = policy.summary()
    assert s["clamped"] and s["continuous_bits"] > 6 and s["bits"] == 6 and s["levels"] == 31
    assert bits_after(policy, 1e-30) == 3
    assert policy.summary()["clamped"]
    assert bits_after(policy, 0.0) == 3
    s = policy.summary()
    assert s["target_levels"] == 0.0 and s["continuous_bits"] is None
    assert json.loads(json.dumps(s)) == s


def test_calibration_plans_exact_bits_on_last_step():
    for bound in VARIANCE_BOUNDS:
        for bits in range(2, 9):
            for d in (10, 10_000, 25_000_000):
                eps = error_budget_for_bits(bits, grad_sq_norm=3.0, numel=d, lr=0.05, total_steps=500,
                                            variance_bound=bound)
                policy = DqsgdPolicy(total_steps=500, error_budget=eps, variance_bound=bound)
                assert bits_after(policy, 3.0, lr=0.05, step=498, numel=d) == bits
                assert bits_after(policy, 3.0 * 1.01, lr=0.05, step=498, numel=d) == min(8, bits + 1)


def test_steps_horizon_and_past_the_end():
    policy = make(total_steps=100, error_budget=1e-4)
    assert policy.step == 0
    policy.observe(DqsgdStats(grad_sq_norm=1.0, numel=D, lr=0.1))
    assert policy.step == 1
    policy.observe(DqsgdStats(grad_sq_norm=1.0, numel=D, lr=0.1, step=49))
    assert policy.step == 50
    at_end = bits_after(make(total_steps=100, error_budget=1e-4), 1.0, step=98)
    past = bits_after(make(total_steps=100, error_budget=1e-4), 1.0, step=5000)
    assert past == at_end  # past the horizon: planned like the last step
    policy.observe(DqsgdStats(grad_sq_norm=1.0, numel=D, lr=0.1, step=50, total_steps=10_000))
    assert policy.total_steps == 10_000 and policy.summary()["budget_per_step"] == pytest.approx(1e-8)


def test_bad_observations_are_ignored_and_step_advances():
    policy = make()
    good = bits_after(policy, 2.0)
    before = policy.state_dict()
    for bad in [
        DqsgdStats(grad_sq_norm=float("nan"), numel=D, lr=0.1),
        DqsgdStats(grad_sq_norm=-1.0, numel=D, lr=0.1),
        DqsgdStats(grad_sq_norm=float("inf"), numel=D, lr=0.1),
        DqsgdStats(grad_sq_norm=1.0, numel=0, lr=0.1),
        DqsgdStats(grad_sq_norm=1.0, numel=True, lr=0.1),
        DqsgdStats(grad_sq_norm=1.0, numel=D, lr=0.0),
        DqsgdStats(grad_sq_norm=1.0, numel=D, lr=float("nan")),
        DqsgdStats(grad_sq_norm=1.0, numel=D, lr=0.1, step=-3),
        DqsgdStats(grad_sq_norm=1.0, numel=D, lr=0.1, total_steps=0),
        DqsgdStats(grad_sq_norm=1.0, numel=D, lr=0.1, bits=1),
    ]:
        policy.observe(bad)
    s = policy.summary()
    assert s["ignored"] == 10 and s["observations"] == 1
    assert policy.step == before["next_step"] + 10
    assert s["grad_sq_norm"] == before["grad_sq_norm"] and s["budget_spent"] == before["budget_spent"]
    assert policy.plan().bits >= good  # same numbers, later step: never fewer bits


def test_budget_accounting_uses_bits_sent():
    T, eps, decay = 50, 1e-3, 0.9
    policy = make(total_steps=T, error_budget=eps, decay=decay)
    expect = 0.0
    rng = random.Random(3)
    for t in range(T):
        plan = policy.plan()
        g, lr = rng.uniform(0.5, 2), 0.1
        used = plan.bits if t % 3 else 8  # sometimes the caller overrides the plan
        policy.observe(DqsgdStats(grad_sq_norm=g, numel=D, lr=lr, step=t, bits=used))
        expect += decay ** (T - 1 - t) * lr * lr * g * quantization_variance(levels_for_bits(used), D, "min")
    assert policy.summary()["budget_spent"] == pytest.approx(expect, rel=1e-12)


def test_ewma_smooths_the_norm():
    raw, smooth = make(), make(ewma_alpha=0.1)
    for t in range(50):
        g = 100.0 if t % 2 else 0.01
        raw.observe(DqsgdStats(grad_sq_norm=g, numel=D, lr=0.1))
        smooth.observe(DqsgdStats(grad_sq_norm=g, numel=D, lr=0.1))
    assert raw.summary()["grad_sq_norm"] == 100.0
    assert 0.01 < smooth.summary()["grad_sq_norm"] < 100.0


# ---------------------------------------------------------------------------------------------- determinism, state

def drive(policy: DqsgdPolicy, seed: int, steps: int, start: int = 0) -> list[BitsPlan]:
    rng = random.Random(seed)
    plans = []
    for t in range(start + steps):
        g, lr = 10 ** rng.uniform(-3, 1), 0.1 * 0.5 ** (t // 300)
        if t < start:
            continue
        plans.append(policy.plan())
        assert policy.plan() == plans[-1]  # plan() is pure
        policy.observe(DqsgdStats(grad_sq_norm=g, numel=D, lr=lr, step=t, total_steps=1000))
    return plans


CALIBRATED = error_budget_for_bits(6, grad_sq_norm=1.0, numel=D, lr=0.1, total_steps=1000)


def test_deterministic_across_instances():
    kw = dict(total_steps=1000, error_budget=CALIBRATED, decay=0.995, ewma_alpha=0.3)
    a, b = drive(DqsgdPolicy(**kw), 5, 1000), drive(DqsgdPolicy(**kw), 5, 1000)
    assert a == b
    assert len({p.bits for p in a}) >= 3


def test_state_round_trip_through_json():
    kw = dict(total_steps=1000, error_budget=CALIBRATED, decay=0.995, ewma_alpha=0.3, b_min=3, initial_bits=4)
    ref = DqsgdPolicy(**kw)
    full = drive(ref, 9, 1000)
    first = DqsgdPolicy(**kw)
    drive(first, 9, 400)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = DqsgdPolicy.from_state_dict(state)
    assert resumed.summary() == first.summary()
    assert drive(resumed, 9, 600, start=400) == full[400:]
    assert resumed.state_dict() == ref.state_dict()
    assert "DqsgdPolicy(step=400" in repr(DqsgdPolicy.from_state_dict(state))
    with pytest.raises(ValueError, match="config differs.*decay"):
        DqsgdPolicy(**{**kw, "decay": 0.99}).load_state_dict(state)
    with pytest.raises(ValueError, match="unsupported DqsgdPolicy state version"):
        DqsgdPolicy(**kw).load_state_dict({**state, "version": 99})
