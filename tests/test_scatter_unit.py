"""The sparse reduce-scatter's maths (crossover/compression/scatter.py) and the codec's SCATTER transport with
simulated ranks in threads (the real Horovod jobs are in test_scatter_hvd.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from crossover.compression import cost_model, scatter
from crossover.compression.collectives import SimulatedGroup
from crossover.compression.sparse_codec import SparseCodec


def test_route_orders_pairs_by_owner():
    idx = torch.tensor([7, 2, 4, 9, 0, 5], dtype=torch.int32)
    val = torch.arange(6, dtype=torch.float32)
    rows, splits = scatter.route(idx, val, 3)
    assert splits == [2, 2, 2]  # owners (i mod 3): 9 0 | 7 4 | 2 5
    assert rows[:, 0].tolist() == [9, 0, 7, 4, 2, 5]  # stable within an owner
    owners = [int(i) % 3 for i in rows[:, 0]]
    assert owners == sorted(owners)
    assert sorted(zip(rows[:, 0].tolist(), rows[:, 1].view(torch.float32).tolist())) == sorted(
        zip(idx.tolist(), val.tolist()))


def test_reduce_owned_sums_keeps_the_largest_and_pads():
    region = torch.zeros(4)
    # rank 1 of 3 owns 1, 4, 7, 10 of 12 elements; two ranks sent 4, one sent 7 and 10
    rec = torch.tensor([[4, 0], [7, 0], [4, 0], [10, 0]], dtype=torch.int32)
    rec[:, 1] = torch.tensor([1.0, -5.0, 2.0, 0.5]).view(torch.int32)
    out = scatter.reduce_owned(rec, 1, 3, 12, 2, region)
    got = dict(zip(out[:, 0].tolist(), out[:, 1].view(torch.float32).tolist()))
    assert got == {7: -5.0, 4: 3.0}
    assert bool((region == 0).all()), "the region buffer is left zero"
    out = scatter.reduce_owned(rec, 1, 3, 12, 5, region)  # more room than indices: padding (1, +0.0)
    assert out.shape == (5, 2)
    assert out[3:, 0].tolist() == [1, 1] and out[3:, 1].view(torch.float32).tolist() == [0.0, 0.0]


def test_reduce_owned_refuses_indices_it_does_not_own():
    rec = torch.tensor([[5, 0]], dtype=torch.int32)  # 5 mod 3 = 2, not rank 1
    with pytest.raises(RuntimeError, match="does not own"):
        scatter.reduce_owned(rec, 1, 3, 12, 2, torch.zeros(4), "w")
    with pytest.raises(RuntimeError, match="does not own"):
        scatter.reduce_owned(torch.tensor([[13, 0]], dtype=torch.int32), 1, 3, 12, 2, torch.zeros(5), "w")


def test_lost_marks_what_no_owner_kept():
    marks = torch.zeros(10, dtype=torch.bool)
    gone = scatter.lost(torch.tensor([1, 3, 5], dtype=torch.int32), torch.tensor([3, 8], dtype=torch.int32), marks)
    assert gone.tolist() == [True, False, True]
    assert not bool(marks.any())


def test_cost_model_scatter_is_flat_in_workers():
    n, k = 1_000_000, 10_000
    b = {w: cost_model.transport_cost(cost_model.SCATTER, n, k, w).bytes for w in (2, 8, 1024)}
    assert b[8] / b[2] == pytest.approx(1.75, rel=0.01)  # 2 k (W-1)/W pairs: as a ring allreduce grows
    assert b[1024] < 2.05 * b[2]  # ceil(k / W) per owner rounds up
    gather = cost_model.transport_cost(cost_model.ALLGATHER, n, k, 8).bytes
    assert b[8] < gather / 3
    assert cost_model.choose_transport(n, k, 8, False, cost_model.SCATTER) == cost_model.SCATTER
    assert cost_model.choose_transport(n, k, 1, False, cost_model.SCATTER) != cost_model.SCATTER  # one rank
    # two ranks: the allgather's bytes in one collective instead of two
    assert cost_model.choose_transport(n, k, 2, False, cost_model.SCATTER) == cost_model.ALLGATHER
    assert cost_model.choose_transport(n, 600_000, 8, False, cost_model.SCATTER) == cost_model.DENSE
    with pytest.raises(ValueError):
        cost_model.choose_transport(n, k, 8, False, "nope")


class _Plan:
    def __init__(self, step: int, cf: float, kind: str | None) -> None:
        self.step, self.sent_cf, self.probes, self.transport = step, cf, (cf,), kind


@pytest.mark.parametrize("world", [3, 5])
def test_simulated_ranks_decode_the_same_exact_average(world):
    n = 6007  # not a multiple of any world: the owners' stretches differ by one
    group = SimulatedGroup(world, timeout_s=30)
    codecs = [SparseCodec("topk") for _ in range(world)]
    gen = torch.Generator().manual_seed(world)
    for step in range(4):
        grads = [torch.randn(n, generator=gen) * (1 + 10 * r) for r in range(world)]
        grads[0][:600] *= 50  # a hot stretch: spread over every owner by the strided ownership
        before = [c.memory._residuals.get("w", torch.zeros(n)).clone() for c in codecs]
        enc = [c.encode("w", grads[r].clone(), _Plan(step, 20, cost_model.SCATTER), 0.01, group.rank_view(r))
               for r, c in enumerate(codecs)]
        assert {e[1].kind for e in enc} == {"scatter"}
        reduced = sum(e[0] for e in enc) / world
        outs: list = [None] * world

        def run(r: int, outs: list = outs, enc: list = enc, reduced: torch.Tensor = reduced) -> None:
            outs[r] = codecs[r].decode(reduced.clone(), enc[r][1], group.rank_view(r))[0].clone()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(torch.equal(outs[0], o) for o in outs[1:]), "every rank decodes the same"
        applied = [grads[r] + before[r] - codecs[r].memory._residuals["w"] for r in range(world)]
        torch.testing.assert_close(sum(applied) / world, outs[0], rtol=0, atol=1e-5 * float(outs[0].abs().max()))
        k = -(-n // 20)
        assert int((outs[0] != 0).sum()) <= world * -(-k // world)


def test_a_host_without_alltoall_is_told_at_once():
    class NoAlltoall:
        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return 0

    with pytest.raises(RuntimeError, match="alltoall"):
        SparseCodec("topk").encode("w", torch.randn(5000), _Plan(1, 20, cost_model.SCATTER), 0.0, NoAlltoall())


def test_the_ddp_hook_refuses_scatter_at_construction():
    from crossover.ddp import AdaptiveState

    with pytest.raises(ValueError, match="scatter"):
        AdaptiveState(transport="scatter")
