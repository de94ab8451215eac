"""The agreed index set transport (crossover/compression/agreed.py) with N simulated ranks in one process.

The test plays the host as tests/unit/test_driver_sim.py does: every rank's encode, the reduction (sum or average),
every rank's decode. Real multi-process jobs: tests/hvd/test_agreed_hvd.py (Horovod) and tests/ddp/test_ddp_hook.py.
"""

from __future__ import annotations

import pytest
import torch
from codec_calls import sparse_encode

from crossover.compression import agreed
from crossover.compression import cost_model as cm
from crossover.compression.collectives import SimulatedGroup
from crossover.compression.selectors import k_for
from crossover.compression.sparse_codec import SparseCodec
from crossover.compression.wire import SparseStatsLayout, shared_seed


class _Plan:
    def __init__(self, step: int, cf: float, transport: str | None = cm.AGREED) -> None:
        self.step, self.sent_cf, self.probes, self.transport = step, cf, (cf,), transport


def _grads(world: int, step: int, n: int) -> list[torch.Tensor]:
    """Gradients that differ on purpose: scale and distribution per rank."""
    out = []
    for r in range(world):
        g = torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + r))
        out.append(g * (1 + r) if r % 2 == 0 else g.abs() ** 3 * (r + 0.5))
    return out


def _exchange(codecs, group, grads, plan, op="average", key="w"):
    world = len(codecs)
    enc = [sparse_encode(c, key, g, plan, 0.01, group.rank_view(r)) for r, (c, g) in enumerate(zip(codecs, grads))]
    total = torch.stack([e[0] for e in enc]).sum(0)
    reduced = total / world if op == "average" else total
    out = [c.decode(reduced.clone(), e[1], group.rank_view(r))[0].clone() for r, (c, e) in enumerate(zip(codecs, enc))]
    return enc, out


@pytest.mark.parametrize("op", ["average", "sum"])
@pytest.mark.parametrize("world", [2, 3, 5])
def test_average_is_exactly_what_ranks_sent_and_residuals_are_exact(op, world):
    n, cf = 40_000, 200.0
    k = k_for(n, cf)
    group = SimulatedGroup(world)
    codecs = [SparseCodec("topk") for _ in range(world)]
    for step in range(1, 7):
        grads = _grads(world, step, n)
        before = [c.memory.residual("w", g).clone() for c, g in zip(codecs, grads)]
        enc, out = _exchange(codecs, group, grads, _Plan(step, cf), op)
        idx = enc[0][1].idx
        assert idx.numel() == k and len(set(idx.tolist())) == k
        assert all(torch.equal(e[1].idx, idx) for e in enc)  # every rank sent at the same indices
        sent = []
        for c, g, b in zip(codecs, grads, before):
            acc = g + b
            s = torch.zeros(n)
            s[idx.long()] = acc[idx.long()]
            sent.append(s)
            expect_res = acc.clone()
            expect_res[idx.long()] = 0.0
            torch.testing.assert_close(c.memory.get("w"), expect_res, rtol=0, atol=0)  # exact, nothing lost
        expected = sum(sent) / (world if op == "average" else 1)
        for o in out:
            torch.testing.assert_close(o, expected, rtol=1e-6, atol=1e-6)
            assert torch.equal(o, out[0])
        sets = [c._agreed["w"] for c in codecs]  # the next step's set, agreed with no further communication
        assert all(torch.equal(s.idx, sets[0].idx) and s.hashes == sets[0].hashes for s in sets)
        assert sets[0].step == step + 1 and sets[0].idx.numel() == k
        assert bool((sets[0].idx[1:] > sets[0].idx[:-1]).all())


def test_first_set_is_drawn_from_the_shared_seed_and_later_ones_follow_the_proposals():
    world, n, cf = 3, 20_000, 200.0
    k = k_for(n, cf)
    group = SimulatedGroup(world)
    codecs = [SparseCodec("topk", seed=7) for _ in range(world)]
    grads = _grads(world, 1, n)
    enc, _ = _exchange(codecs, group, grads, _Plan(1, cf))
    assert torch.equal(enc[0][1].idx, agreed.bootstrap(n, k, shared_seed(7, 1, "w"), torch.device("cpu")))
    # a huge value on one rank is proposed by it and sent by everyone next step
    grads = _grads(world, 2, n)
    grads[1][12345] = 1e6
    _exchange(codecs, group, grads, _Plan(2, cf))
    enc, _ = _exchange(codecs, group, _grads(world, 3, n), _Plan(3, cf))
    assert 12345 in enc[0][1].idx.tolist()


def test_a_skipped_step_or_another_cf_draws_a_fresh_set_on_every_rank():
    world, n = 2, 20_000
    group = SimulatedGroup(world)
    codecs = [SparseCodec("topk") for _ in range(world)]
    _exchange(codecs, group, _grads(world, 1, n), _Plan(1, 20.0))
    enc, _ = _exchange(codecs, group, _grads(world, 3, n), _Plan(3, 20.0))  # step 2 was dense / skipped
    assert torch.equal(enc[0][1].idx, agreed.bootstrap(n, k_for(n, 20.0), shared_seed(0, 3, "w"),
                                                       torch.device("cpu")))
    enc, _ = _exchange(codecs, group, _grads(world, 4, n), _Plan(4, 40.0))  # another CF: another k
    assert enc[0][1].idx.numel() == k_for(n, 40.0)


def test_ranks_that_disagree_on_the_set_fail_on_every_rank():
    world, n = 3, 20_000
    group = SimulatedGroup(world)
    codecs = [SparseCodec("topk") for _ in range(world)]
    _exchange(codecs, group, _grads(world, 1, n), _Plan(1, 200.0))
    codecs[2].forget_agreed()  # one rank lost its state (a reset on that rank only)
    grads = _grads(world, 2, n)
    enc = [sparse_encode(c, "w", g, _Plan(2, 200.0), 0.0, group.rank_view(r))
           for r, (c, g) in enumerate(zip(codecs, grads))]
    reduced = torch.stack([e[0] for e in enc]).mean(0)
    for r, c in enumerate(codecs):
        with pytest.raises(RuntimeError, match="different agreed index sets"):
            c.decode(reduced.clone(), enc[r][1], group.rank_view(r))


def test_checks_agree_tells_equal_from_unequal_fingerprints():
    for world in (2, 3, 1024):
        same = [world * 5.0, world * 25.0, world * 9.0, world * 81.0]
        assert agreed.checks_agree(same, world, (5, 9))
        one_off = [same[0] + 1, same[1] + 11, same[2], same[3]]  # one rank had 6 instead of 5
        assert not agreed.checks_agree(one_off, world, (5, 9))
    # a mix whose mean equals the own hash is still caught by the squares (Cauchy-Schwarz)
    assert not agreed.checks_agree([4.0 + 6.0, 16.0 + 36.0, 18.0, 162.0], 2, (5, 9))


def test_a_non_finite_step_is_undone_and_the_next_set_drawn_afresh():
    world, n, cf = 2, 20_000, 200.0
    group = SimulatedGroup(world)
    codecs = [SparseCodec("topk") for _ in range(world)]
    _exchange(codecs, group, _grads(world, 1, n), _Plan(1, cf))
    before = [c.memory.get("w").clone() for c in codecs]
    grads = _grads(world, 2, n)
    grads[0][3] = float("nan")
    _, out = _exchange(codecs, group, grads, _Plan(2, cf))
    assert all(bool(torch.isnan(o).all()) for o in out)
    torch.testing.assert_close(codecs[1].memory.get("w"), before[1], rtol=1e-5, atol=1e-5)  # restored
    assert float(codecs[0].memory.get("w").abs().sum()) == 0.0  # the non-finite rank's is reset
    assert "w" not in codecs[0]._agreed and "w" not in codecs[1]._agreed
    enc, _ = _exchange(codecs, group, _grads(world, 3, n), _Plan(3, cf))
    assert torch.equal(enc[0][1].idx, enc[1][1].idx)


def test_merge_proposals_ranks_by_position_rotates_ties_and_fills_from_the_seed():
    # 3 ranks x 2 proposals; index 5 proposed twice; k = 4
    gathered = torch.tensor([5, 1, 5, 2, 7, 3], dtype=torch.int32)
    a = agreed.merge_proposals(gathered, 3, 0, 4, 100, 11)
    # first positions of ranks 0, 1, 2 (5, 5, 7), then second positions (1, 2, 3): 5, 7, 1, 2
    assert a.tolist() == [1, 2, 5, 7]
    b = agreed.merge_proposals(gathered, 3, 1, 4, 100, 11)  # step 1: rank 1 first -> 5, 7, 5(dup), 2, 3, 1
    assert b.tolist() == [2, 3, 5, 7]
    c = agreed.merge_proposals(torch.tensor([5, 5], dtype=torch.int32), 2, 0, 6, 100, 11)  # filled from the seed
    assert c.numel() == 6 and 5 in c.tolist() and len(set(c.tolist())) == 6
    assert torch.equal(c, agreed.merge_proposals(torch.tensor([5, 5], dtype=torch.int32), 2, 0, 6, 100, 11))
    with pytest.raises(RuntimeError, match="out of range"):
        agreed.merge_proposals(torch.tensor([5, 500], dtype=torch.int32), 2, 0, 2, 100, 1)
    with pytest.raises(RuntimeError, match="do not split"):
        agreed.merge_proposals(torch.tensor([1, 2, 3], dtype=torch.int32), 2, 0, 2, 100, 1)


@pytest.mark.parametrize("n", [20_000, 1 << 20])
@pytest.mark.parametrize("world", [1, 2, 8, 1024])
def test_proposals_are_the_exact_largest(n, world):
    score = torch.randn(n, generator=torch.Generator().manual_seed(n + world)) ** 3
    got = agreed.propose(score, n // 100, world)
    m = cm.agreed_proposals(n // 100, n, world)
    assert got.dtype == torch.int32 and got.numel() == m
    want = torch.topk(score.abs(), m).values
    torch.testing.assert_close(score.abs()[got.long()], want)


@pytest.mark.parametrize("kind", [cm.AGREED, cm.ALLGATHER])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_the_cost_model_counts_what_the_codec_hands_over(kind, world):
    """Per rank, the codec's payload and allgather are what the model puts into its ring formulas."""
    n, cf = 50_000, 100.0
    k = k_for(n, cf)
    group = SimulatedGroup(world)
    codecs = [SparseCodec("topk", fixed_gather=True) for _ in range(world)]
    nstats = SparseStatsLayout(1).length
    enc = [sparse_encode(c, "w", torch.randn(n), _Plan(1, cf, kind), 0.0, group.rank_view(r))
           for r, c in enumerate(codecs)]
    payload, _, sent = enc[0]
    gathered = sent - 4 * payload.numel()
    if kind == cm.AGREED:
        assert payload.numel() == k + cm.AGREED_CHECK + nstats
        assert gathered == 4 * cm.agreed_proposals(k, n, world) > 0
    else:
        assert payload.numel() == nstats
        assert gathered == cm.PAIR_BYTES * k + cm.GATHER_HEADER_BYTES
    expected = cm.ring_allreduce(4 * payload.numel(), world).bytes + cm.ring_allgather(gathered, world).bytes
    assert cm.transport_cost(kind, n, k, world, nstats).bytes == pytest.approx(expected)
    reduced = torch.stack([e[0] for e in enc]).mean(0)
    for r, c in enumerate(codecs):
        c.decode(reduced.clone(), enc[r][1], group.rank_view(r))


def test_random_k_and_plans_without_agreed_keep_their_transport():
    world, n = 2, 20_000
    group = SimulatedGroup(world)
    codecs = [SparseCodec("randomk") for _ in range(world)]
    enc, _ = _exchange(codecs, group, _grads(world, 1, n), _Plan(1, 20.0))
    assert enc[0][1].kind == "allreduce"  # shared indices: their own allreduce
    codecs = [SparseCodec("topk") for _ in range(world)]
    enc, _ = _exchange(codecs, group, _grads(world, 1, n), _Plan(1, 20.0, None))
    assert enc[0][1].kind == "allgather"


def test_agreed_sets_round_trip_through_a_checkpoint_and_bad_ones_are_refused():
    world, n, cf = 2, 20_000, 200.0
    group = SimulatedGroup(world)
    codecs = [SparseCodec("topk") for _ in range(world)]
    _exchange(codecs, group, _grads(world, 1, n), _Plan(1, cf))
    saved = codecs[0].agreed_state()
    fresh = [SparseCodec("topk") for _ in range(world)]
    for f, c in zip(fresh, codecs):
        f.load_agreed(saved)
        f.memory.load(c.memory.state())
    enc_a, out_a = _exchange(codecs, group, _grads(world, 2, n), _Plan(2, cf))
    enc_b, out_b = _exchange(fresh, SimulatedGroup(world), _grads(world, 2, n), _Plan(2, cf))
    assert torch.equal(enc_a[0][1].idx, enc_b[0][1].idx) and torch.equal(out_a[0], out_b[0])
    step, k, numel, idx = saved["w"]
    before = fresh[0].agreed_state()
    for bad in ({"w": [step, k, numel, idx[::-1]]}, {"w": [step, k, numel, idx[:-1]]}, {"w": [step, k, 5, idx]},
                {"w": [-1, k, numel, idx]}, {"w": "x"}, {3: [step, k, numel, idx]}, ["w"]):
        with pytest.raises(ValueError):
            fresh[0].load_agreed(bad)
    assert fresh[0].agreed_state() == before  # the failed loads changed nothing


def test_a_set_that_ranks_would_cover_takes_no_proposals_and_is_random_k():
    """W k > n / 2 (CF 4 on 3 ranks): the set of every step is random-k's from the step's seed; nothing gathered."""
    world, n, cf = 3, 20_000, 4.0
    group = SimulatedGroup(world)
    codecs = [SparseCodec("topk", seed=3) for _ in range(world)]
    randomk = SparseCodec("randomk", seed=3)
    for step in range(1, 4):
        grads = _grads(world, step, n)
        enc, _ = _exchange(codecs, group, grads, _Plan(step, cf))
        assert enc[0][1].handle is None and enc[0][2] == 4 * enc[0][0].numel()  # no allgather
        sel = randomk.selector.select("w", grads[0].clone(), None, cf, shared_seed(3, step, "w"))
        assert torch.equal(enc[0][1].idx, sel.idx)
        assert codecs[0].agreed_state() == {}
    assert cm.agreed_share(2_000, 20_000, 8) == 0.0 and cm.agreed_share(200, 20_000, 8) == 0.125
    assert cm.agreed_share(2_000, 20_000, 4) == 0.25 and cm.agreed_proposals(2_000, 20_000, 8) == 0
    assert cm.agreed_share(k_for(1_048_576, 16.0), 1_048_576, 8) == 0.125  # CF 2 W exactly: ceil(n / 2W)


@pytest.mark.parametrize("transport", [cm.AGREED, cm.ALLGATHER])
def test_agreed_statistics_carry_the_momentum_like_the_allgather(transport):
    """The agreed payload's statistics follow SparseStatsLayout as every other path's: the optimizer's momentum in
    its slot (averaged over ranks, so every rank's policy caps the CF alike) and the same length."""
    world, n, cf = 3, 40_000, 100.0
    group = SimulatedGroup(world)
    codecs = [SparseCodec("topk") for _ in range(world)]
    layout = SparseStatsLayout(1)
    grads = _grads(world, 1, n)
    enc = [sparse_encode(c, "w", g, _Plan(1, cf, transport), 0.01, group.rank_view(r), momentum=0.9)
           for r, (c, g) in enumerate(zip(codecs, grads))]
    assert {e[1].kind for e in enc} == {"agreed" if transport == cm.AGREED else "allgather"}
    assert all(e[1].nstats == layout.length for e in enc)
    if transport == cm.AGREED:
        total = torch.stack([e[0] for e in enc]).sum(0) / world
        stats = [c.decode(total.clone(), e[1], group.rank_view(r))[1] for r, (c, e) in enumerate(zip(codecs, enc))]
    else:
        stats = [torch.stack([e[0] for e in enc]).sum(0) / world]
    for s in stats:
        assert s.numel() == layout.length
        assert float(s[layout.MOMENTUM]) == pytest.approx(0.9, rel=1e-6)


def test_the_fingerprint_is_a_digest_of_every_index():
    """Two indices moved by one keep the sum: the old check (a hash of the sum) missed it; a digest does not."""
    from crossover.compression import agreed

    idx = torch.tensor([3, 10, 20, 40], dtype=torch.int32)
    moved = torch.tensor([4, 9, 20, 40], dtype=torch.int32)
    a, b = agreed.fingerprint("w", 5, "agreed", idx), agreed.fingerprint("w", 5, "agreed", moved)
    assert a != b and len(a) == 4 and all(0 <= h < agreed.CHECK_LEVELS for h in a)
    assert not agreed.checks_agree([sum(v) for v in zip(agreed.check_values(a), agreed.check_values(b))], 2, a)
    assert agreed.checks_agree([2 * v for v in agreed.check_values(a)], 2, a)
    # natural mismatches: random sets of one size almost never share the four hashes
    gen = torch.Generator().manual_seed(0)
    prints = {agreed.fingerprint("w", 5, "agreed", torch.randperm(1000, generator=gen)[:50].sort().values)
              for _ in range(2000)}
    assert len(prints) >= 1990
