"""The sparse reduce-scatter's maths (crossover/compression/scatter.py) and the codec's SCATTER transport with
simulated ranks in threads (the real Horovod jobs are in test_scatter_hvd.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from codec_calls import sparse_encode

from crossover.compression import cost_model, scatter
from crossover.compression.collectives import SimulatedGroup
from crossover.compression.sparse_codec import SparseCodec
from crossover.driver.transport import choose_transport


def test_route_orders_pairs_by_owner():
    idx = torch.tensor([7, 2, 4, 9, 0, 5], dtype=torch.int32)
    val = torch.arange(6, dtype=torch.float32)
    rows, splits = scatter.route(idx, val, 3, 12, bitmap=False)
    assert splits == [2, 2, 2]  # owners (i mod 3): 9 0 | 7 4 | 2 5
    assert rows[:, 0].tolist() == [9, 0, 7, 4, 2, 5]  # stable within an owner
    assert rows[:, 1].view(torch.float32).tolist() == [3.0, 4.0, 0.0, 2.0, 1.0, 5.0]


@pytest.mark.parametrize("bitmap", [False, True])
def test_every_owner_receives_its_entries_in_either_format(bitmap):
    world, numel = 3, 1001  # stretches of 334, 334 and 333 positions
    group = SimulatedGroup(world)
    gen = torch.Generator().manual_seed(1)
    sent = []
    for r in range(world):
        idx = torch.randperm(numel, generator=gen)[:200].to(torch.int32)
        val = torch.randn(200, generator=gen)
        sent.append((idx, val))
        data, splits = scatter.route(idx, val, world, numel, bitmap)
        assert sum(splits) == data.shape[0]
        group.rank_view(r).alltoall_async(data, splits, "a2a")
    for r in range(world):
        got = group.rank_view(r)._group._wait(("a2a", r))
        pos, val = scatter.unpack_received(got, r, world, numel, bitmap)
        have = sorted(zip((pos * world + r).tolist(), val.tolist()))
        want = sorted((int(i), float(v)) for idx, vals in sent for i, v in zip(idx, vals) if int(i) % world == r)
        assert have == want


def test_bitmaps_cost_less_only_where_the_stretch_is_dense():
    n = 1_000_000
    assert cost_model.scatter_bitmap(n // 10, n, 8)  # CF 10: a bit per position beats an index per entry
    assert not cost_model.scatter_bitmap(n // 100, n, 8)  # CF 100: it does not
    pairs = cost_model.scatter_part_bytes(100, n, 8, False)
    assert pairs == 800 and cost_model.scatter_part_bytes(100, n, 8, True) == 400 + 15_628  # 125 000 bits, to 4 bytes


def test_reduce_owned_sums_keeps_the_largest():
    region = torch.zeros(4)
    pos = torch.tensor([1, 2, 1, 3])  # two ranks sent position 1
    val = torch.tensor([1.0, -5.0, 2.0, 0.5])
    kept, sums = scatter.reduce_owned(pos, val, 2, region)
    assert dict(zip(kept.tolist(), sums.tolist())) == {2: -5.0, 1: 3.0}
    assert bool((region == 0).all()), "the region buffer is left zero"
    kept, sums = scatter.reduce_owned(pos, val, 5, region)  # room for all
    assert sorted(kept.tolist()) == [1, 2, 3]


@pytest.mark.parametrize("bitmap", [False, True])
def test_kept_sums_travel_in_the_same_size_and_come_back(bitmap):
    world, numel, keep = 3, 100, 10
    parts = []
    for r, pos in enumerate([torch.tensor([0, 5, 9]), torch.tensor([], dtype=torch.int64), torch.tensor([32])]):
        sums = torch.arange(1, pos.numel() + 1, dtype=torch.float32) * (r + 1)
        parts.append(scatter.pack_kept(pos, sums, r, world, numel, keep, bitmap))
    assert len({p.numel() for p in parts}) == 1, "the same size on every rank (fewer sums: padding)"
    idx, val = scatter.unpack_kept(torch.cat(parts), world, numel, keep, bitmap)
    got = {int(i): float(v) for i, v in zip(idx, val) if float(v) != 0.0}
    assert got == {0: 1.0, 15: 2.0, 27: 3.0, 98: 3.0}


def test_unpacking_refuses_what_this_rank_does_not_own():
    rec = torch.tensor([[5, 0]], dtype=torch.int32)  # 5 mod 3 = 2, not rank 1
    with pytest.raises(RuntimeError, match="does not own"):
        scatter.unpack_received(rec, 1, 3, 12, False, "w")
    with pytest.raises(RuntimeError, match="does not own"):
        scatter.unpack_received(torch.tensor([[13, 0]], dtype=torch.int32), 1, 3, 12, False, "w")
    data, _ = scatter.route(torch.tensor([1], dtype=torch.int32), torch.ones(1), 3, 12, True)
    with pytest.raises(RuntimeError, match="disagree"):
        scatter.unpack_received(data[:-4], 1, 3, 12, True)  # the last bitmap cut short
    with pytest.raises(RuntimeError, match="trailing"):
        scatter.unpack_received(torch.cat([data, data[:4]]), 1, 3, 12, True)
    bad = torch.zeros(scatter.bitmap_bytes(12, 3) * 3, dtype=torch.uint8)
    bad[0] = 0x80  # position 7 of rank 1's stretch of 4
    with pytest.raises(RuntimeError, match="beyond its stretch"):
        scatter.unpack_received(bad, 1, 3, 12, True)


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
    assert choose_transport(n, k, 8, False, cost_model.SCATTER) == cost_model.SCATTER
    assert choose_transport(n, k, 1, False, cost_model.SCATTER) != cost_model.SCATTER  # one rank
    # two ranks: the allgather's bytes in one collective instead of two
    assert choose_transport(n, k, 2, False, cost_model.SCATTER) == cost_model.ALLGATHER
    assert choose_transport(n, 990_000, 8, False, cost_model.SCATTER) == cost_model.DENSE
    with pytest.raises(ValueError):
        choose_transport(n, k, 8, False, "nope")


class _Plan:
    def __init__(self, step: int, cf: float, kind: str | None) -> None:
        self.step, self.sent_cf, self.probes, self.transport = step, cf, (cf,), kind


@pytest.mark.parametrize("world,cf", [(3, 20), (3, 100), (5, 20)])
def test_simulated_ranks_decode_the_same_exact_average(world, cf):
    n = 6007  # not a multiple of any world: the owners' stretches differ by one
    group = SimulatedGroup(world, timeout_s=30)
    codecs = [SparseCodec("topk") for _ in range(world)]
    gen = torch.Generator().manual_seed(world)
    for step in range(4):
        grads = [torch.randn(n, generator=gen) * (1 + 10 * r) for r in range(world)]
        grads[0][:600] *= 50  # a hot stretch: spread over every owner by the strided ownership
        before = [c.memory._residuals.get("w", torch.zeros(n)).clone() for c in codecs]
        enc = [sparse_encode(c, "w", grads[r].clone(), _Plan(step, cf, cost_model.SCATTER), 0.01, group.rank_view(r))
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
        k = -(-n // cf)
        assert int((outs[0] != 0).sum()) <= world * -(-k // world)


def test_a_host_without_alltoall_is_told_at_once():
    class NoAlltoall:
        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return 0

    with pytest.raises(RuntimeError, match="alltoall"):
        sparse_encode(SparseCodec("topk"), "w", torch.randn(5000), _Plan(1, 20, cost_model.SCATTER), 0.0, NoAlltoall())


def test_the_ddp_hook_refuses_scatter_at_construction():
    from crossover.ddp import AdaptiveState

    with pytest.raises(ValueError, match="scatter"):
        AdaptiveState(transport="scatter")
