"""The step driver and the codecs with N simulated ranks in one process (no Horovod).

Each rank has its own codec (its own residuals) and its own driver; the test plays the host: it
runs every rank's encode, reduces the payloads itself (sum or average, as Horovod or DDP would),
then every rank's decode, and checks the averaged gradient, error-feedback conservation and that
every rank plans the same on every step with gradients that differ on purpose.
"""

from __future__ import annotations

import math

import pytest
import torch

from crossover.adaptive.gravac import GravacPolicy
from crossover.adaptive.static import StaticPolicy
from crossover.compression.collectives import SimulatedGroup
from crossover.compression.quant_codec import QuantCodec
from crossover.compression.sparse_codec import SparseCodec
from crossover.compression.wire import CHECK_LEN, SparseStatsLayout, normalize_reduced, shared_seed
from crossover.driver import QuantStepDriver, SparseStepDriver, dqsgd_settings
from crossover.driver.session import SparseSession


class SimRank:
    """One simulated rank: a driver, a codec, its view of the group."""

    def __init__(self, group: SimulatedGroup, rank: int, policy, compressor: str = "topk", seed: int = 0) -> None:
        self.comm = group.rank_view(rank)
        self.now = 0.0
        self.session = SparseSession(SparseCodec(compressor, error_feedback=True, seed=seed, grad_norms=True),
                                     SparseStepDriver(policy, compressor=compressor, seed=seed), momentum=0.0,
                                     unknown_momentum=0.0, clock=lambda: self.now)
        self.driver, self.codec = self.session.driver, self.session.codec


def _step(ranks: list[SimRank], grads: list[dict[str, torch.Tensor]], op: str = "average",
          t: float = 0.0) -> list[dict[str, torch.Tensor]]:
    """One training step of every rank; returns each rank's decoded (averaged) gradients."""
    world = len(ranks)
    for r in ranks:
        r.now = t
        r.session.begin_step(r.comm)
    encoded = []
    for r, g in zip(ranks, grads):
        out = {}
        for key, tensor in g.items():
            if r.session.skips_all():  # as the hosts do: the tensor goes through untouched
                r.session.count(tensor.numel() * 4, tensor.numel() * 4)
                out[key] = (tensor, None)
                continue
            out[key] = r.session.encode(key, tensor, r.comm)
        encoded.append(out)
    results = []
    for r, enc in zip(ranks, encoded):
        dec = {}
        for key, (_, ctx) in enc.items():
            total = sum(e[key][0] for e in encoded)
            reduced = total / world if op == "average" else total
            if ctx is None:
                dec[key] = reduced.clone()
                continue
            dec[key] = r.session.decode(reduced.clone(), ctx, r.comm).clone()
        results.append(dec)
    return results


def _grads(world: int, step: int, sizes: dict[str, int]) -> list[dict[str, torch.Tensor]]:
    """Gradients that differ on purpose: each rank its own scale and distribution."""
    out = []
    for r in range(world):
        gen = torch.Generator().manual_seed(1000 * step + r)
        g = {}
        for key, n in sizes.items():
            base = torch.randn(n, generator=gen)
            g[key] = base * (1 + r) if r % 2 == 0 else base.abs() ** 3 * (r + 0.5)
        out.append(g)
    return out


@pytest.mark.parametrize("op", ["average", "sum"])
@pytest.mark.parametrize("compressor", ["topk", "randomk"])
def test_static_cf_averages_exactly_what_ranks_sent(op, compressor):
    world, n = 3, 50_000
    group = SimulatedGroup(world)
    ranks = [SimRank(group, r, StaticPolicy(cf=100.0), compressor) for r in range(world)]
    grads = _grads(world, 0, {"w": n})
    before = [r.codec.memory.residual("w", g["w"]).clone() for r, g in zip(ranks, grads)]
    out = _step(ranks, grads, op)
    # what each rank sent = gradient + old residual - new residual (error feedback conserves it)
    sent = [g["w"] + b - r.codec.memory.residual("w", g["w"]) for r, g, b in zip(ranks, grads, before)]
    expected = sum(sent) / (world if op == "average" else 1)  # Horovod's Sum gives the sum
    for dec in out:
        torch.testing.assert_close(dec["w"], expected, rtol=1e-5, atol=1e-6)
    for s in sent:  # about n / 100 elements per rank (top-k trims past 1.1 k)
        assert 0 < int((s != 0).sum()) <= math.ceil(1.1 * n / 100) + 1
    for r in ranks:
        assert r.driver.bytes_sent * 20 < r.driver.bytes_dense


def test_dense_plan_with_probes_sends_gradient_plus_residual():
    world, n = 2, 30_000
    group = SimulatedGroup(world)
    ranks = [SimRank(group, r, StaticPolicy(cf=10.0)) for r in range(world)]
    _step(ranks, _grads(world, 0, {"w": n}))  # leaves residuals
    for r in ranks:
        r.driver.policy = StaticPolicy(cf=1.0)
    grads = _grads(world, 1, {"w": n})
    acc = [g["w"] + r.codec.memory.residual("w", g["w"]) for r, g in zip(ranks, grads)]
    for r in ranks:  # dense, but keep measuring one CF: the selection is undone
        r.driver.policy.plan = lambda: type(StaticPolicy(cf=1.0).plan())(send_cf=1.0, probe_cfs=(10.0,))
    out = _step(ranks, grads)
    torch.testing.assert_close(out[0]["w"], sum(acc) / world, rtol=1e-5, atol=1e-6)
    for r, g in zip(ranks, grads):
        assert float(r.codec.memory.residual("w", g["w"]).abs().sum()) == 0.0


def test_first_measured_dense_step_sends_what_error_feedback_still_holds():
    # The ladder settling dense after CF 10 (plans measure the step, probe nothing): the first dense step
    # sends gradient + residual and empties the residual, later ones send the gradient alone. Before, the
    # residual stayed held and was never sent while dense (the TensorFlow glue always sent g + e).
    world, n = 2, 30_000
    group = SimulatedGroup(world)
    ranks = [SimRank(group, r, StaticPolicy(cf=10.0)) for r in range(world)]
    _step(ranks, _grads(world, 0, {"w": n}))  # leaves residuals
    dense = type(StaticPolicy(cf=1.0).plan())(send_cf=1.0, probe_cfs=(), measure=True)
    for r in ranks:
        r.driver.policy.plan = lambda: dense
    for step in (1, 2):
        grads = _grads(world, step, {"w": n})
        acc = [g["w"] + r.codec.memory.residual("w", g["w"]) for r, g in zip(ranks, grads)]
        assert (step == 1) == all(float(r.codec.memory.residual("w", g["w"]).abs().sum()) > 0
                                  for r, g in zip(ranks, grads))
        out = _step(ranks, grads)
        for dec in out:
            torch.testing.assert_close(dec["w"], sum(acc) / world, rtol=1e-5, atol=1e-6)
        for r, g in zip(ranks, grads):
            assert float(r.codec.memory.residual("w", g["w"]).abs().sum()) == 0.0


def test_dense_steps_of_the_ladder_are_measured_and_observed():
    """A ladder that tries (or settles on) dense still needs every step's time: its windows, retries and
    drift checks count observed steps. Only a plan that measures nothing passes tensors through."""
    world, n = 2, 20_000
    group = SimulatedGroup(world)
    ranks = [SimRank(group, r, GravacPolicy(window=4)) for r in range(world)]
    clock = 0.0
    steps = 60
    for step in range(steps):
        _step(ranks, _grads(world, step, {"w": n}), t=clock)
        # compression never pays here: a compressed step costs 50% more than a dense one
        clock += 0.1 if ranks[0].driver.current.sent_cf == 1.0 else 0.15
        assert not any(r.driver.skips_all() for r in ranks)
    for r in ranks:
        assert r.driver.policy.step == steps - 2  # observations lag two steps, dense steps included
        assert r.driver.policy.send_cf == 1.0 and r.driver.policy.settled
    dense_only = SparseStepDriver(StaticPolicy(cf=1.0), compressor="topk", seed=0)
    dense_only.begin_step(0.0)
    assert dense_only.skips_all()


def test_every_rank_plans_the_same_with_different_gradients():
    world = 3
    group = SimulatedGroup(world)
    policy = dict(cf_min=4.0, cf_max=256.0, epsilon=0.3, omega=0.05, window=6, ewma_alpha=0.3)
    ranks = [SimRank(group, r, GravacPolicy(**policy)) for r in range(world)]
    sizes = {"a": 40_000, "b": 20_000}
    plans = []
    for step in range(80):
        out = _step(ranks, _grads(world, step, sizes), t=0.01 * step * (1 + step % 3))
        seen = {(r.driver.current.sent_cf, r.driver.current.probes) for r in ranks}
        assert len(seen) == 1, f"step {step}: ranks disagree {seen}"
        plans.append(seen.pop())
        for key in sizes:
            for dec in out[1:]:
                assert torch.equal(dec[key], out[0][key])
    assert len({p[0] for p in plans}) > 1, "the CF never changed: the test would not see a disagreement"
    assert len({repr(r.driver.policy.state_dict()) for r in ranks}) == 1


def test_driver_state_round_trip_continues_the_same_schedule():
    world = 2
    group = SimulatedGroup(world)
    policy = dict(cf_min=4.0, cf_max=64.0, epsilon=0.3, window=4, ewma_alpha=0.5)
    a = [SimRank(group, r, GravacPolicy(**policy)) for r in range(world)]
    for step in range(10):
        _step(a, _grads(world, step, {"w": 20_000}), t=float(step))
    saved = [r.driver.state_dict() for r in a]
    residuals = [r.codec.memory.state() for r in a]
    group_b = SimulatedGroup(world)
    b = [SimRank(group_b, r, GravacPolicy(**policy)) for r in range(world)]
    for r, s, res in zip(b, saved, residuals):
        r.driver.load_state_dict(s)
        r.codec.memory.load(res)
    for step in range(10, 30):
        _step(a, _grads(world, step, {"w": 20_000}), t=float(step))
        _step(b, _grads(world, step, {"w": 20_000}), t=float(step))
        assert [(r.driver.current.sent_cf, r.driver.current.probes) for r in a] == \
               [(r.driver.current.sent_cf, r.driver.current.probes) for r in b]
    with pytest.raises(ValueError, match="compressor"):
        SparseStepDriver(StaticPolicy(cf=2.0), compressor="randomk", seed=0).load_state_dict(saved[0])


def test_stats_layout_and_normalization():
    lay = SparseStatsLayout(2)
    v = lay.local(step_time=0.5, grad_sq=4.0, acc_sq=9.0, probe_sq=[1.0, 0.25], momentum=0.9)
    assert len(v) == lay.length == 11 + CHECK_LEN  # the agreement checks end it (pieces of 1 when not given)
    assert v[lay.check_start:] == [1.0] * CHECK_LEN
    assert SparseStatsLayout(2, checks=False).length == 11
    assert v[lay.GRAD_NORM] == 2.0 and v[lay.ACC_NORM] == 3.0 and v[lay.probe_norm(1)] == 0.5
    # Average over 4 ranks of identical vectors: sums come back x4, the step time stays a mean
    avg = normalize_reduced(v, 4)
    assert avg[lay.STEP_TIME] == 0.5 and avg[lay.ACC_SQ] == 36.0
    assert avg[lay.MOMENTUM] == pytest.approx(0.9)  # a mean over ranks, like the step time
    summed = normalize_reduced([x * 4 for x in v], 4)
    assert summed == avg
    assert normalize_reduced([0.0] + v[1:], 4) is None
    assert normalize_reduced([float("nan")] + v[1:], 4) is None


def test_gradient_keys_and_seeds():
    from horovod_ext._torch_host import GradientKeys

    keys = GradientKeys()
    assert keys.key("w") == ("w", False)
    assert keys.key(None) == ("#1", False)
    assert keys.key("w") == ("w", True)
    keys.begin()
    assert keys.key(None) == ("#0", False)
    assert shared_seed(0, 1, "w") == shared_seed(0, 1, "w") != shared_seed(0, 2, "w")
    assert 0 <= shared_seed(7, 3, "x") < 2 ** 63


@pytest.mark.parametrize("transport", ["allgather", "allreduce"])
def test_quant_codec_averages_unbiased(transport):
    world, n, bits = 2, 20_000, 4
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * (r + 1) for r in range(world)]
    exact = sum(grads) / world
    trials, mean = 40, torch.zeros(n)
    for step in range(trials):
        group = SimulatedGroup(world)
        codecs = [QuantCodec(seed=step) for _ in range(world)]
        views = [group.rank_view(r) for r in range(world)]
        enc = [c.encode("w", g, bits, step, v, transport) for c, g, v in zip(codecs, grads, views)]
        reduced = sum(e[0].float() for e in enc) / world
        if transport == "allreduce":
            reduced = reduced.half()
        outs = [c.decode(reduced.clone(), e[1], v) for c, e, v in zip(codecs, enc, views)]
        torch.testing.assert_close(outs[0][0], outs[1][0])
        one, sq = outs[0][1]
        assert one == pytest.approx(1.0)
        assert sq == pytest.approx(sum(float(g.square().sum()) for g in grads) / world, rel=2e-2)
        mean += outs[0][0] / trials
    # unbiased: the mean over independent roundings approaches the exact average
    err = float((mean - exact).norm() / exact.norm())
    assert err < 0.05, err


def test_quant_driver_calibrates_and_plans_bits():
    settings = dqsgd_settings(total_steps=100, lr=0.1, error_budget=None, target_bits=6, b_min=2, b_max=8,
                              decay=0.999)
    drv = QuantStepDriver(bits=6, dqsgd=settings)
    assert drv.begin_step(2) == 6 and drv.policy is None
    drv.lr = 0.1
    drv.add_tensor(1000)
    drv.add_reduced_sq(1.0, 50.0, 2)
    bits = drv.begin_step(2)
    assert drv.policy is not None and 2 <= bits <= 8
    state = drv.state_dict()
    again = QuantStepDriver(bits=6, dqsgd=settings)
    again.load_state_dict(state)
    assert again.bits == drv.bits and again.step == drv.step
    with pytest.raises(ValueError, match="total_steps"):
        dqsgd_settings(total_steps=0, lr=0.1, error_budget=None, target_bits=6, b_min=2, b_max=8, decay=0.999)


def test_simulated_allgather_refuses_an_incomplete_round():
    group = SimulatedGroup(2)
    h = group.rank_view(0).allgather_async(torch.ones(3), "x")
    with pytest.raises(RuntimeError, match="would hang"):
        group.rank_view(0).wait(h)


@pytest.mark.parametrize("compressor", ["topk", "randomk"])
def test_gain_reads_the_raw_gradient_norm_apart_from_the_residual(compressor):
    """GraVAC's delivered gain divides by ||g||^2 of the raw gradient, not of g + residual: top-k reads it
    in its selection pass (fused into the C kernel), random-k in a pass of its own; both must agree with
    the definition, summed over ranks, on a step where the residuals are not zero."""
    world, n = 2, 40_000
    group = SimulatedGroup(world)
    ranks = [SimRank(group, r, StaticPolicy(cf=100.0), compressor) for r in range(world)]
    _step(ranks, _grads(world, 0, {"w": n}))  # leaves residuals
    grads = _grads(world, 1, {"w": n})
    raw = sum(float(g["w"].double().pow(2).sum()) for g in grads)
    acc = sum(float((g["w"] + r.codec.memory.residual("w", g["w"])).double().pow(2).sum())
              for r, g in zip(ranks, grads))
    assert acc > raw * 1.01  # the residuals are not negligible: the two definitions differ here
    _step(ranks, grads)
    for r in ranks:
        assert r.driver.current.grad_sq == pytest.approx(raw, rel=1e-5)
        assert r.driver.current.acc_sq == pytest.approx(acc, rel=1e-5)
