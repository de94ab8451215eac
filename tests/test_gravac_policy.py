"""Unit tests of the pure-Python GraVAC policy with plain synthetic numbers (no framework needed)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable

import pytest

from crossover.adaptive.gravac import GravacPolicy, Plan, StepStats

GainFn = Callable[[float, int], float]  # (cf, step) -> gain in [0, 1]
TimeFn = Callable[[float], float]  # sent cf -> step time in seconds


def knee_gain(cf: float, step: int = 0) -> float:
    """Nothing lost up to CF 100, then the kept norm falls off."""
    return 1.0 if cf <= 100 else math.sqrt(100.0 / cf)


def comm_bound_time(cf: float) -> float:
    """0.1 s compute + 1 s of dense communication shrinking with the CF."""
    return 0.1 + 1.0 / cf


def stats_for(plan: Plan, step: int, gain: GainFn, time: TimeFn, dense_sq: float = 4.0) -> StepStats:
    return StepStats(
        sent_cf=plan.send_cf,
        dense_sq_norm=dense_sq,
        compressed_sq_norms={cf: dense_sq * gain(cf, step) ** 2 for cf in plan.probe_cfs},
        step_time_s=time(plan.send_cf),
        samples=256,
    )


def drive(
    policy: GravacPolicy,
    steps: int,
    gain: GainFn = knee_gain,
    time: TimeFn = comm_bound_time,
    lag: int = 0,
) -> list[Plan]:
    """Plan, 'measure' and observe `steps` steps; observations arrive `lag` steps late."""
    plans: list[Plan] = []
    pending: list[StepStats] = []
    for t in range(steps):
        plan = policy.plan()
        plans.append(plan)
        pending.append(stats_for(plan, t, gain, time))
        if len(pending) > lag:
            policy.observe(pending.pop(0))
    return plans


def noisy_stream(seed: int, steps: int) -> list[tuple[float, float, float]]:
    """Per step: a gain scale, a dense squared norm and a time jitter, from a fixed seed."""
    rng = random.Random(seed)
    return [(rng.uniform(0.85, 1.0), rng.uniform(0.5, 2.0), rng.uniform(0.95, 1.05)) for _ in range(steps)]


def drive_noisy(policy: GravacPolicy, stream: list[tuple[float, float, float]], start: int = 0) -> list[Plan]:
    plans = []
    for i, (scale, dense_sq, jitter) in enumerate(stream, start):
        plan = policy.plan()
        plans.append(plan)
        g = {cf: dense_sq * (scale * knee_gain(cf)) ** 2 for cf in plan.probe_cfs}
        policy.observe(
            StepStats(plan.send_cf, dense_sq, g, comm_bound_time(plan.send_cf) * jitter, 128 + i % 3)
        )
    return plans


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cf_min": 0.5}, "cf_min must be a finite number >= 1"),
        ({"cf_min": float("nan")}, "cf_min must be"),
        ({"cf_min": 50, "cf_max": 20}, "cf_min must be <= cf_max"),
        ({"cf_max": float("inf")}, "cf_max must be"),
        ({"epsilon": 0.0}, r"epsilon must be in \(0, 1\]"),
        ({"epsilon": 1.5}, r"epsilon must be in \(0, 1\]"),
        ({"omega": -0.1}, r"omega must be in \[0, 1\)"),
        ({"omega": 1.0}, r"omega must be in \[0, 1\)"),
        ({"window": 0}, "window must be an int >= 1"),
        ({"window": 2.5}, "window must be an int >= 1"),
        ({"window": True}, "window must be an int >= 1"),
        ({"scaling": "linear"}, "scaling must be one of exponential, geometric; got 'linear'"),
        ({"ewma_alpha": 0.0}, r"ewma_alpha must be in \(0, 1\]"),
        ({"ewma_alpha": 1.01}, r"ewma_alpha must be in \(0, 1\]"),
        ({"warmup_steps": -1}, "warmup_steps must be an int >= 0"),
        ({"warmup_steps": 1.0}, "warmup_steps must be an int >= 0"),
    ],
)
def test_invalid_parameters_raise_value_error_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GravacPolicy(**kwargs)


def test_defaults_and_edge_values_are_accepted() -> None:
    assert GravacPolicy().config == {
        "cf_min": 10.0,
        "cf_max": 1000.0,
        "epsilon": 0.9,
        "omega": 0.01,
        "window": 500,
        "scaling": "exponential",
        "warmup_steps": 0,
        "ewma_alpha": 0.1,
    }
    GravacPolicy(cf_min=1, cf_max=1, epsilon=1.0, omega=0.0, window=1, ewma_alpha=1.0, scaling="geometric")


def test_parameters_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        GravacPolicy(10)  # type: ignore[misc]


# ---------------------------------------------------------------- plans


def test_initial_plan_probes_floor_and_candidate_and_sends_dense_until_measured() -> None:
    policy = GravacPolicy()
    plan = policy.plan()
    assert plan == Plan(send_cf=1.0, probe_cfs=(10.0, 20.0))
    assert plan.dense
    assert (plan.floor_cf, plan.candidate_cf, plan.cf_s) == (10.0, 20.0, 2.0)
    assert policy.plan() == plan  # plan() is pure
    assert policy.summary()["floor_gain"] is None


def test_warmup_sends_dense_while_still_probing_gains() -> None:
    policy = GravacPolicy(warmup_steps=5, window=10)
    plans = drive(policy, 5)
    assert all(p.send_cf == 1.0 and p.probe_cfs == (10.0, 20.0) for p in plans)
    assert policy.gains == {10.0: 1.0, 20.0: 1.0}  # measured during warm-up
    assert policy.throughput == {}  # warm-up steps are not throughput samples
    assert not policy.warming_up
    assert policy.plan().send_cf == 20.0
    # The search window counts from the end of warm-up: first decision after 5 + 10 observations.
    drive(policy, 9)
    assert policy.floor_cf == 10.0
    drive(policy, 1)
    assert policy.floor_cf == 20.0


def test_explores_raises_floor_and_settles_exponential() -> None:
    policy = GravacPolicy(window=50)
    plans = drive(policy, 1000)
    # floor 10 -> 20 -> 80 while nothing is lost; candidate 1000 loses too much, search exhausted.
    assert policy.settled
    assert policy.floor_cf == policy.candidate_cf == 80.0
    assert plans[-1] == Plan(send_cf=80.0, probe_cfs=(80.0,))
    sent = [p.send_cf for p in plans]
    assert sent[0] == 1.0 and sent[1:50] == [20.0] * 49
    assert set(sent) == {1.0, 20.0, 80.0}
    assert max(max(p.probe_cfs) for p in plans) == 1000.0
    assert policy.throughput[80.0] > policy.throughput[20.0]


def test_settles_on_the_lower_cf_when_two_best_throughputs_are_within_omega() -> None:
    # Communication is hidden above CF 20: compressing further buys no throughput.
    policy = GravacPolicy(window=50)
    drive(policy, 400, time=lambda cf: 0.1 if cf >= 20 else 0.1 + 1.0 / cf)
    assert policy.settled
    assert policy.floor_cf == policy.candidate_cf == 20.0
    assert policy.summary()["windows"] == 2  # 20 measured in window 1, 80 in window 2, settle


def test_never_exceeds_cf_max() -> None:
    for scaling in ("exponential", "geometric"):
        policy = GravacPolicy(cf_min=3, cf_max=50, window=20, scaling=scaling)
        plans = drive(policy, 2000, gain=lambda cf, t: 1.0)
        assert all(p.send_cf <= 50 and max(p.probe_cfs) <= 50 for p in plans)
        assert policy.settled and policy.floor_cf == 50.0  # lossless everywhere: go to the top


def test_cf_min_equal_cf_max_probes_one_cf() -> None:
    policy = GravacPolicy(cf_min=100, cf_max=100, window=5)
    plans = drive(policy, 30)
    assert plans[1:] == [Plan(send_cf=100.0, probe_cfs=(100.0,))] * 29


def test_low_gains_fall_back_to_floor_then_dense() -> None:
    def gain(cf: float, step: int) -> float:
        if step < 100:
            return 1.0
        if step < 200:
            return 0.97 if cf == 10 else 0.5  # candidate loses too much, floor still fine
        return 0.3  # everything loses too much

    policy = GravacPolicy(window=10_000)  # no search decision in this test
    sent = [p.send_cf for p in drive(policy, 300, gain=gain)]
    assert sent[1:100] == [20.0] * 99
    assert sent[120:200] == [10.0] * 80
    assert sent[230:] == [1.0] * 70
    # The EWMA switches within a few steps, not instantly.
    assert 100 < sent.index(10.0) < 110
    assert 200 < sent.index(1.0, 1) < 215


def test_settled_cf_still_falls_back_to_dense_when_its_gain_drops() -> None:
    policy = GravacPolicy(window=50)
    drive(policy, 400)
    assert policy.settled and policy.send_cf == 80.0
    drive(policy, 100, gain=lambda cf, t: 0.2)
    assert policy.settled and policy.send_cf == 1.0 and policy.floor_cf == 80.0


def test_gain_is_sqrt_of_norm_ratio_and_ewma_uses_alpha() -> None:
    policy = GravacPolicy(ewma_alpha=0.25, window=10_000)
    policy.observe(StepStats(1.0, 16.0, {10.0: 4.0, 20.0: 1.0}, 0.1, 8))
    assert policy.gains == {10.0: 0.5, 20.0: 0.25}  # first sample initialises the EWMA
    policy.observe(StepStats(1.0, 16.0, {10.0: 16.0, 20.0: 25.0}, 0.1, 8))
    assert policy.gains[10.0] == pytest.approx(0.5 + 0.25 * (1.0 - 0.5))
    assert policy.gains[20.0] == pytest.approx(0.25 + 0.25 * (1.0 - 0.25))  # clipped to 1


def test_bad_numbers_are_ignored_not_fatal() -> None:
    policy = GravacPolicy(window=10_000)
    policy.observe(StepStats(1.0, 4.0, {10.0: 4.0, 20.0: 4.0}, 0.2, 32))
    before = policy.state_dict()
    for bad in (
        StepStats(1.0, float("nan"), {10.0: 1.0}, float("inf"), 32),
        StepStats(1.0, 0.0, {10.0: 0.0}, 0.0, 0),
        StepStats(10.0, 4.0, {10.0: -1.0, 20.0: float("nan")}, -1.0, 32),
    ):
        policy.observe(bad)
    after = policy.state_dict()
    assert after["step"] == before["step"] + 3
    assert after["gains"] == before["gains"]
    assert after["throughput"] == before["throughput"]


def test_search_waits_for_the_candidate_to_be_measured() -> None:
    policy = GravacPolicy(window=3)
    for _ in range(3):  # only the floor is ever reported
        policy.observe(StepStats(1.0, 4.0, {10.0: 4.0}, 0.2, 32))
    assert (policy.floor_cf, policy.candidate_cf) == (10.0, 20.0)


def test_step_stats_keeps_a_frozen_copy() -> None:
    norms = {10.0: 1.0}
    stats = StepStats(1.0, 2.0, norms, 0.1, 4)
    norms[10.0] = 99.0
    assert stats.compressed_sq_norms[10.0] == 1.0
    with pytest.raises(TypeError):
        stats.compressed_sq_norms[10.0] = 5.0  # type: ignore[index]


# ---------------------------------------------------------------- scaling sequences


def candidates_per_window(scaling: str, windows: int) -> list[float]:
    """Candidates seen window after window when the floor is never raised (candidate always lossy)."""
    policy = GravacPolicy(cf_min=10, cf_max=1e6, window=4, scaling=scaling)
    seen = [policy.candidate_cf]
    for _ in range(windows):
        drive(policy, 4, gain=lambda cf, t: 1.0 if cf == 10 else 0.5)
        seen.append(policy.candidate_cf)
    return seen


def test_exponential_scaling_squares_cf_s() -> None:
    # CF_s = 2, 4, 16, 256, 65536, then bounded by cf_max / cf_min; one window at the bound with
    # nothing gained exhausts the search, which settles on the only CF sent (the floor).
    assert candidates_per_window("exponential", 6) == [20.0, 40.0, 160.0, 2560.0, 655360.0, 1e6, 10.0]


def test_geometric_scaling_doubles_cf_s() -> None:
    assert candidates_per_window("geometric", 5) == [20.0, 40.0, 80.0, 160.0, 320.0, 640.0]


def test_floor_raises_follow_the_scaling() -> None:
    floors = {}
    for scaling in ("exponential", "geometric"):
        policy = GravacPolicy(window=10, scaling=scaling)
        seen = []
        for _ in range(4):
            drive(policy, 10, gain=lambda cf, t: 1.0, time=lambda cf: 1.0 / cf)
            seen.append((policy.floor_cf, policy.candidate_cf))
        floors[scaling] = seen
    assert floors["exponential"] == [(20.0, 80.0), (80.0, 1000.0), (1000.0, 1000.0), (1000.0, 1000.0)]
    assert floors["geometric"] == [(20.0, 80.0), (80.0, 640.0), (640.0, 1000.0), (1000.0, 1000.0)]


# ---------------------------------------------------------------- distributed contract


def test_determinism_two_instances_same_stream_1000_steps() -> None:
    stream = noisy_stream(seed=7, steps=1000)
    a, b = GravacPolicy(window=100), GravacPolicy(window=100)
    plans_a, plans_b = drive_noisy(a, stream), drive_noisy(b, stream)
    assert plans_a == plans_b
    assert a.state_dict() == b.state_dict()
    assert len({p.send_cf for p in plans_a}) > 1  # the stream actually exercised the search


def test_one_step_observation_lag_reaches_the_same_decision() -> None:
    direct, lagged = GravacPolicy(window=50), GravacPolicy(window=50)
    drive(direct, 1000)
    drive(lagged, 1000, lag=1)
    assert lagged.settled and lagged.floor_cf == direct.floor_cf == 80.0


@pytest.mark.parametrize("cut", [1, 37, 150, 300])
def test_state_round_trip_gives_identical_future_plans(cut: int) -> None:
    stream = noisy_stream(seed=11, steps=cut + 400)
    original = GravacPolicy(window=60, warmup_steps=20, scaling="geometric")
    drive_noisy(original, stream[:cut])
    saved = json.loads(json.dumps(original.state_dict(), allow_nan=False))  # plain JSON values
    restored = GravacPolicy.from_state_dict(saved)
    assert restored.summary() == original.summary()
    into_existing = GravacPolicy(window=60, warmup_steps=20, scaling="geometric")
    into_existing.load_state_dict(saved)
    future = stream[cut:]
    expected = drive_noisy(original, future, cut)
    assert drive_noisy(restored, future, cut) == expected
    assert drive_noisy(into_existing, future, cut) == expected
    assert restored.state_dict() == into_existing.state_dict() == original.state_dict()


def test_load_state_dict_rejects_other_config_or_version() -> None:
    state = GravacPolicy(window=60).state_dict()
    with pytest.raises(ValueError, match="window: saved 60 vs 500"):
        GravacPolicy().load_state_dict(state)
    with pytest.raises(ValueError, match="unsupported GravacPolicy state version"):
        GravacPolicy(window=60).load_state_dict({**state, "version": 99})


def test_summary_is_read_only_and_json_serialisable() -> None:
    policy = GravacPolicy(window=50)
    drive(policy, 120)
    before = policy.state_dict()
    summary = policy.summary()
    summary["gains"][10.0] = 0.0
    policy.gains[20.0] = 0.0
    assert policy.state_dict() == before
    json.dumps(policy.summary())
    assert set(policy.summary()) >= {
        "step",
        "send_cf",
        "floor_cf",
        "candidate_cf",
        "floor_gain",
        "candidate_gain",
        "settled",
        "throughput",
    }
