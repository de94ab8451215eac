"""The low-rank codec (crossover/compression/lowrank_codec.py) on simulated ranks whose gradients differ on purpose:
every rank applies the same average, error feedback loses nothing, a full rank is exact, inf/NaN leaves no trace."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from crossover.adaptive.static import StaticPolicy
from crossover.compression.collectives import SimulatedGroup
from crossover.compression.lowrank_codec import LowRankCodec, matrix_shape, rank_for
from crossover.driver import SparseStepDriver, StepRecord
from crossover.driver.session import AUTO, LOWRANK, LowRankSession, cf_session, check_compressor


def _step(codecs: list[LowRankCodec], grads: list[torch.Tensor], step: int, cf: float,
          group: SimulatedGroup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rec = StepRecord(step=step, sent_cf=cf, probes=(cf,))
    views = [group.rank_view(r) for r in range(len(codecs))]
    enc = [c.encode("w", g.clone(), rec, 0.01, v) for c, g, v in zip(codecs, grads, views)]
    reduced = torch.stack([e[0] for e in enc]).mean(0)
    for c, v in zip(codecs, views):
        c.advance(v)  # every rank starts its Q allreduce before any waits on it (the ranks run in turn here)
    return [c.decode(reduced.clone(), e[1], v) for c, e, v in zip(codecs, enc, views)]


def _grads(world: int, step: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step)
    return [torch.randn(shape, generator=gen) * (r + 1) + r for r in range(world)]


def test_matrix_shape_and_rank():
    assert matrix_shape(torch.Size((64, 3, 3, 3))) == (64, 27)
    assert matrix_shape(torch.Size((10,))) is None
    assert rank_for(256, 512, 100.0) == 1
    assert rank_for(256, 512, 10.0) == 17  # 256 * 512 / (10 * (256 + 512)) = 17.07
    assert rank_for(3, 3, 10.0) == 0  # rank 1 would save less than 2x: dense
    assert rank_for(2, 1000, 1.5) == 0  # rank 1 sends 1002 of 2000 floats
    assert rank_for(4, 1000, 1.5) == 1  # rank 2 would send 2008 of 4000 floats: less than 2x


def test_one_rank_for_every_matrix_from_the_second_step():
    """PowerSGD's choice: once the matrices are known, one rank serves them all, sized so that their factors send
    1/cf of them; a matrix is never factored beyond what still shrinks it 2x."""
    mats = {"fc": (256, 1600), "conv": (64, 288), "out": (10, 256)}
    shared = (sum(r * c for r, c in mats.values()), sum(r + c for r, c in mats.values()))
    assert rank_for(*mats["conv"], 30.0, shared) == 5  # 430592 // (30 * 2474) = 5, where alone it would get 1
    assert rank_for(*mats["out"], 10.0, shared) == 4  # 17 for all, but rank 5 would shrink 10 x 256 under 2x
    view = SimulatedGroup(1).rank_view(0)
    codec = LowRankCodec(seed=1)
    for step, want in ((1, {"fc": 7, "conv": 1, "out": 1}), (2, {"fc": 5, "conv": 5, "out": 4})):
        rec = StepRecord(step=step, sent_cf=30.0, probes=(30.0,))
        enc = {k: codec.encode(k, torch.randn(shape), rec, 0.01, view) for k, shape in mats.items()}
        assert {k: e[1].q.shape[1] for k, e in enc.items()} == want  # step 1: each on its own; then one for all
        codec.advance(view)
        for payload, ctx, _ in enc.values():
            codec.decode(payload, ctx, view)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_applies_the_same_average_and_error_feedback_loses_nothing(world):
    shape, cf = (64, 96), 20.0
    group = SimulatedGroup(world)
    codecs = [LowRankCodec(seed=5) for _ in range(world)]
    sent_total = torch.zeros(shape)
    grad_total = torch.zeros(shape)
    for step in range(1, 6):
        grads = _grads(world, step, shape)
        outs = _step(codecs, grads, step, cf, group)
        for out, _ in outs[1:]:
            assert torch.equal(out, outs[0][0])  # bit for bit on every rank
        sent_total += outs[0][0]
        grad_total += sum(grads) / world
        residual_mean = sum(c.memory.get("w").view(shape) for c in codecs) / world
        torch.testing.assert_close(sent_total + residual_mean, grad_total, rtol=1e-4, atol=1e-4)
        stats = outs[0][1]
        assert float(stats[0]) == pytest.approx(1.0)


def test_an_average_of_lower_rank_than_the_factors_is_exact():
    """Ranks whose gradients differ but share a rank-2 row space: rank 3 factors carry their average exactly."""
    world, rows, cols = 3, 30, 40
    b = torch.randn(2, cols)
    grads = [torch.randn(rows, 2, generator=torch.Generator().manual_seed(r)) @ b for r in range(world)]
    group = SimulatedGroup(world)
    codecs = [LowRankCodec(seed=1) for _ in range(world)]
    outs = _step(codecs, grads, 1, rows * cols / (3 * (rows + cols)), group)  # rank 3
    torch.testing.assert_close(outs[0][0], sum(grads) / world, rtol=1e-4, atol=1e-4)


def test_warm_start_converges_to_the_leading_subspace():
    """A fixed rank-2 gradient: after a few warm-started steps rank 2 reconstructs it (power iteration)."""
    world, rows, cols = 2, 40, 50
    u, v = torch.randn(rows, 2), torch.randn(cols, 2)
    target = u @ v.t()
    group = SimulatedGroup(world)
    codecs = [LowRankCodec(error_feedback=False, seed=2) for _ in range(world)]
    cf = rows * cols / (2 * (rows + cols)) - 1  # rank 2
    for step in range(1, 5):
        outs = _step(codecs, [target.clone() for _ in range(world)], step, cf, group)
    torch.testing.assert_close(outs[0][0], target, rtol=1e-3, atol=1e-3)


def test_a_nonfinite_gradient_decodes_nan_everywhere_and_leaves_no_trace():
    world, shape, cf = 2, (32, 48), 10.0
    group = SimulatedGroup(world)
    codecs = [LowRankCodec(seed=3) for _ in range(world)]
    _step(codecs, _grads(world, 1, shape), 1, cf, group)
    residuals = [c.memory.get("w").clone() for c in codecs]
    warm = [c._q["w"].clone() for c in codecs]
    grads = _grads(world, 2, shape)
    grads[1][3, 4] = float("inf")
    outs = _step(codecs, grads, 2, cf, group)
    for out, stats in outs:
        assert torch.isnan(out).all() and not math.isfinite(float(stats.sum()))
    torch.testing.assert_close(codecs[0].memory.get("w"), residuals[0])  # put back as it was
    assert bool((codecs[1].memory.get("w") == 0).all())  # its own gradient was not finite: zeros
    for c, q in zip(codecs, warm):
        assert torch.equal(c._q["w"], q)  # the warm start is untouched


def test_vectors_and_small_matrices_go_dense_with_their_statistics():
    world = 2
    group = SimulatedGroup(world)
    codecs = [LowRankCodec() for _ in range(world)]
    rec = StepRecord(step=1, sent_cf=10.0, probes=(10.0,))
    views = [group.rank_view(r) for r in range(world)]
    enc = [c.encode("b", torch.full((50,), float(r)), rec, 0.0, v) for r, (c, v) in enumerate(zip(codecs, views))]
    reduced = torch.stack([e[0] for e in enc]).mean(0)
    out, _ = codecs[0].decode(reduced, enc[0][1], views[0])
    assert torch.equal(out, torch.full((50,), 0.5))


def test_the_session_and_the_compressor_name():
    assert check_compressor(LOWRANK) == LOWRANK
    with pytest.raises(ValueError, match="compressor must be one of"):
        check_compressor("zip")
    session = cf_session(LOWRANK, StaticPolicy(cf=10.0), error_feedback=True, seed=0, log_csv=None,
                         rank=lambda: 0, transport="allgather", alltoall=True, fixed_gather=True, momentum=0.9,
                         unknown_momentum=0.0, clock=lambda: 0.0)
    assert isinstance(session, LowRankSession) and isinstance(session.driver, SparseStepDriver)
    group = SimulatedGroup(1)
    comm = group.rank_view(0)
    session.begin_step(comm)
    payload, ctx = session.encode("w", torch.randn(64, 64), comm)
    out = session.decode(payload.clone(), ctx, comm)
    assert out.shape == (64, 64) and session.stats()["bytes_sent"] * 5 < session.stats()["bytes_dense"]


def test_probes_measure_what_each_rank_keeps_and_gravac_decides_alike_on_every_rank():
    """GraVAC over the low-rank family: every probed CF's kept energy comes from one Q (more rank keeps more), and
    two ranks with different gradients take the same decisions step by step."""
    from crossover.adaptive.gravac import GravacPolicy

    world, shape = 2, (96, 128)
    group = SimulatedGroup(world)
    now = [0.0]
    sessions = [cf_session(LOWRANK, GravacPolicy(window=4), error_feedback=True, seed=7, log_csv=None,
                           rank=lambda: 0, transport=None, alltoall=True, fixed_gather=True, momentum=0.0,
                           unknown_momentum=0.0, clock=lambda: now[0]) for _ in range(world)]
    views = [group.rank_view(r) for r in range(world)]
    u = torch.randn(shape[0], 3) * torch.tensor([10.0, 3.0, 1.0])
    plans = []
    for _ in range(1, 40):
        for s, v in zip(sessions, views):
            s.settle()
            s.begin_step(v)
        grads = [u @ torch.randn(3, shape[1]) + 0.1 * torch.randn(shape) for _ in range(world)]
        enc = [s.encode("w", g, v) for s, g, v in zip(sessions, grads, views)]
        reduced = torch.stack([e[0] for e in enc]).mean(0)
        for s, v in zip(sessions, views):
            s.advance(v)
        outs = [s.decode(reduced.clone(), e[1], v) for s, e, v in zip(sessions, enc, views)]
        assert torch.equal(outs[0], outs[1])
        plans.append([(s.driver.current.sent_cf, s.driver.current.probes) for s in sessions])
        now[0] += 0.1 if sessions[0].driver.current.sent_cf == 1.0 else 0.05
    assert all(p[0] == p[1] for p in plans)
    gains = sessions[0].policy.gains
    assert gains and all(0.0 < g <= 1.0 + 1e-6 for g in gains.values()), gains
    ordered = [gains[cf] for cf in sorted(gains)]
    assert ordered == sorted(ordered, reverse=True), gains  # a higher CF (lower rank) keeps no more


def test_a_resumed_run_continues_from_the_saved_warm_starts():
    """Q is warm-started from the last step: a checkpoint keeps it, so the step after a resume is the step the run
    would have taken (without it, Q was drawn again from the seed and the factors differed)."""
    world, shape, cf = 2, (64, 96), 20.0
    group = SimulatedGroup(world)
    ran = [LowRankCodec(seed=5) for _ in range(world)]
    for step in range(1, 4):
        _step(ran, _grads(world, step, shape), step, cf, group)
    saved = [(c.warm_state(), c.memory.state()) for c in ran]
    assert all(torch.equal(saved[0][0]["w"], s[0]["w"]) for s in saved)  # the same on every rank
    resumed = [LowRankCodec(seed=5) for _ in range(world)]
    for c, (warm, residuals) in zip(resumed, saved):
        c.load_warm(LowRankCodec.check_warm_state(warm))
        c.memory.load(residuals)
    redrawn = [LowRankCodec(seed=5) for _ in range(world)]
    for c, (_, residuals) in zip(redrawn, saved):
        c.memory.load(residuals)
    grads = _grads(world, 4, shape)
    straight = _step(ran, grads, 4, cf, group)[0][0]
    assert torch.equal(_step(resumed, grads, 4, cf, group)[0][0], straight)
    assert not torch.allclose(_step(redrawn, grads, 4, cf, group)[0][0], straight)


@pytest.mark.parametrize("bad", [float("nan"), "not a tensor", torch.zeros(3), torch.zeros(4, 2, dtype=torch.float64)])
def test_a_bad_warm_start_in_a_checkpoint_is_refused_and_changes_nothing(bad):
    kw = dict(error_feedback=True, seed=0, log_csv=None, rank=lambda: 0, transport=None, alltoall=False,
              fixed_gather=True, momentum=0.9, unknown_momentum=0.0, clock=None)
    session = cf_session(LOWRANK, StaticPolicy(cf=10), **kw)
    session.codec._q["w"] = torch.eye(4)[:, :2].contiguous()
    state = session.state_dict()
    assert set(state["warm_starts"]) == {"w"}
    state["warm_starts"] = {"w": torch.full((4, 2), bad) if isinstance(bad, float) else bad}
    state["step"] = 7
    with pytest.raises(ValueError, match="low-rank warm start 'w'"):
        session.load_state_dict(state)
    assert session.driver.step == 0 and torch.equal(session.codec._q["w"], torch.eye(4)[:, :2])
    session.load_state_dict({**state, "warm_starts": {"w": torch.ones(5, 1)}})  # another shape: redrawn when used
    assert session.driver.step == 7 and session.codec._q["w"].shape == (5, 1)


def test_a_checkpoint_keeps_the_matrices_the_one_rank_is_sized_on():
    """Without them the first step after a resume would size each matrix on its own: another rank than the run's."""
    kw = dict(error_feedback=True, seed=0, log_csv=None, rank=lambda: 0, transport=None, alltoall=False,
              fixed_gather=True, momentum=0.9, unknown_momentum=0.0, clock=None)
    ran = cf_session(LOWRANK, StaticPolicy(cf=10), **kw)
    ran.codec._matrices = {"fc": (256, 1600), "conv": (64, 288)}
    state = ran.state_dict()
    resumed = cf_session(LOWRANK, StaticPolicy(cf=10), **kw)
    resumed.load_state_dict(state)
    assert resumed.codec.totals(5) == ran.codec.totals(5) == (256 * 1600 + 64 * 288, 256 + 1600 + 64 + 288)
    with pytest.raises(ValueError, match="low-rank matrix 'conv'"):
        resumed.load_state_dict({**state, "step": 9, "matrices": {"conv": [64, 0]}})
    assert resumed.driver.step == state["step"]  # refused: nothing changed


def _auto(momentum: float | None = None, unknown: float = 0.0, tensorboard: object = None,
          transport: str = "allgather"):
    from crossover.adaptive.gravac import GravacPolicy

    return cf_session(AUTO, GravacPolicy(), error_feedback=True, seed=3, log_csv=None, rank=lambda: 0,
                      transport=transport, alltoall=True, fixed_gather=True, momentum=momentum,
                      unknown_momentum=unknown, clock=lambda: 0.0, tensorboard=tensorboard)


@pytest.mark.parametrize("transport", ["agreed", "scatter"])
def test_a_top_k_transport_with_low_rank_is_refused_or_said(transport, caplog):
    from crossover import StaticCompression
    from crossover.ddp import AdaptiveState

    with pytest.raises(ValueError, match=f"transport='{transport}' is how top-k's selections travel"):
        StaticCompression("powersgd", cf=10, transport=transport)
    if transport == "agreed":  # the DDP hook has no alltoall (no scatter)
        with pytest.raises(ValueError, match="low rank"):
            AdaptiveState(compressor="powersgd", transport=transport)
    session = _auto(transport=transport)  # "auto": the family is not known before the first step
    with caplog.at_level(logging.WARNING, logger="crossover.driver"):
        chosen = session.for_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9))
    assert chosen.driver.compressor == LOWRANK
    assert any(f"transport='{transport}' is top-k's and goes unused" in r.getMessage() for r in caplog.records)
    assert _auto(transport=transport).for_optimizer(None).driver.compressor == "topk"  # kept where top-k runs


@pytest.mark.parametrize(("opt", "setting", "unknown", "family"), [
    ("sgd", None, 0.0, "topk"), ("momentum", None, 0.0, LOWRANK), ("adam", None, 0.0, LOWRANK),
    ("momentum", 0.0, 0.0, "topk"),  # momentum= wins over what is read
    (None, None, 0.9, LOWRANK), (None, None, 0.0, "topk"),  # a host that sees no optimizer: its assumption
])
def test_auto_picks_the_family_from_the_momentum_once(opt, setting, unknown, family):
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizers = {"sgd": torch.optim.SGD(params, lr=0.1), "momentum": torch.optim.SGD(params, lr=0.1, momentum=0.9),
                  "adam": torch.optim.Adam(params), None: None}
    session = _auto(setting, unknown)
    assert check_compressor(AUTO) == AUTO and session.driver.compressor == "topk"
    chosen = session.for_optimizer(optimizers[opt])
    assert chosen.driver.compressor == family and chosen.policy is session.policy
    assert isinstance(chosen, LowRankSession) == (family == LOWRANK)
    flip = optimizers["sgd"] if family == LOWRANK else optimizers["momentum"]
    assert chosen.for_optimizer(flip) is chosen  # decided once
    assert session.stats()["compressor"] == "topk" and chosen.stats()["compressor"] == family


def test_auto_resumes_the_checkpoint_family_and_a_bad_checkpoint_changes_nothing():
    ran = _auto(0.9).for_optimizer(None)
    group = SimulatedGroup(1)
    comm = group.rank_view(0)
    ran.begin_step(comm)
    ran.decode(*ran.encode("w", torch.randn(64, 64), comm), comm)
    ran.settle()
    state = ran.state_dict()
    fresh = _auto()
    resumed = fresh.for_state(state)
    assert resumed is not fresh and resumed.driver.compressor == LOWRANK
    resumed.load_state_dict(state)
    assert resumed.driver.step == 1 and resumed.for_optimizer(None) is resumed  # the checkpoint's family stays
    assert fresh.driver.step == 0 and fresh.rebuild is not None  # the fresh session was not touched
    bad = {**state, "step": -1}
    other = _auto()
    with pytest.raises(ValueError):
        other.for_state(bad).load_state_dict(bad)
    assert other.driver.step == 0 and other.rebuild is not None
    topk = cf_session("topk", StaticPolicy(cf=10), error_feedback=True, seed=3, log_csv=None, rank=lambda: 0,
                      transport="allgather", alltoall=True, fixed_gather=True, momentum=0.9, unknown_momentum=0.0,
                      clock=None)
    assert topk.for_state(state) is topk  # a named family is fixed: its load refuses another's checkpoint
    with pytest.raises(ValueError, match="compressor"):
        topk.load_state_dict(state)


def test_auto_hands_its_tensorboard_log_to_the_family_it_picks(tmp_path):
    session = _auto(0.9, tensorboard=str(tmp_path))
    log = session.driver.tensorboard
    chosen = session.for_optimizer(None)
    assert chosen.driver.tensorboard is log and session.driver.tensorboard is None
    assert log._final() is not None and log._final().__self__ is chosen.driver
    chosen.close_tensorboard()
