"""GroupedCollectives in one process (SimulatedGroup): same bytes as one allgather per tensor, planned groups,
mixed payload dtypes and sizes, and a clear error when ranks grouped different tensors."""

from __future__ import annotations

import pytest
import torch
from codec_calls import sparse_encode

from crossover.compression.collectives import SimulatedGroup
from crossover.compression.grouped import FIRST_GROUP_BYTES, GroupedCollectives


class _Counting:
    """A rank's Collectives that counts the allgathers it starts."""

    def __init__(self, view):
        self.view, self.names = view, []

    def size(self):
        return self.view.size()

    def rank(self):
        return self.view.rank()

    def allgather_async(self, tensor, name):
        self.names.append(name)
        return self.view.allgather_async(tensor, name)

    def wait(self, handle):
        return self.view.wait(handle)


def _payloads(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Members of mixed dtypes and trailing shapes; rank-dependent row counts (variable sizes)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return {
        "a": torch.randint(-1000, 1000, (3 + rank, 2), dtype=torch.int32, generator=gen),
        "b": torch.randint(0, 255, (7 + 2 * rank,), dtype=torch.uint8, generator=gen),
        "c": torch.randn(5, generator=gen),
        "d": torch.randint(0, 9, (1, 3), dtype=torch.int64, generator=gen),
    }


def _step(comms, step, numels, orders=None):
    """Every rank files its payloads, flushes and waits; returns each rank's result per member."""
    world = len(comms)
    handles = []
    for r, comm in enumerate(comms):
        comm.begin_step()
        mine = {}
        names = list(numels) if orders is None else orders[r]
        for name in names:
            comm.note(list(numels).index(name), numels[name])
            mine[name] = comm.allgather_async(_payloads(r, step)[name], name)
        handles.append(mine)
    for comm in comms:
        comm.flush()
    out = []
    for r in range(world):
        out.append({n: comms[r].wait(h) for n, h in handles[r].items()})
    return out


def test_grouped_results_equal_one_allgather_per_tensor():
    world = 2
    group = SimulatedGroup(world)
    inner = [_Counting(group.rank_view(r)) for r in range(world)]
    comms = [GroupedCollectives(c) for c in inner]
    numels = {"a": 1000, "b": 300_000, "c": 10, "d": 5}  # dense sizes: "b" closes the first group (1 MiB)
    for step in range(3):
        got = _step(comms, step, numels)
        for r in range(world):
            for name in numels:
                expect = torch.cat([_payloads(q, step)[name] for q in range(world)])
                assert got[r][name].dtype == expect.dtype and torch.equal(got[r][name], expect), (step, r, name)
    # step 0: nothing planned, one group of all; then planned: a+b reach 1 MiB, c+d the second group
    for c in inner:
        assert c.names[0] == "crossover.group.extra.a"
        assert c.names[1:] == ["crossover.group.a", "crossover.group.c"] * 2


def test_planned_group_leaves_as_soon_as_complete():
    group = SimulatedGroup(1)
    inner = _Counting(group.rank_view(0))
    comm = GroupedCollectives(inner, first_bytes=8, group_bytes=8)
    for step in range(2):
        comm.begin_step()
        for i, name in enumerate(("x", "y")):
            comm.note(i, 2)
            comm.allgather_async(torch.ones(2, dtype=torch.int32), name)
            if step == 1:  # planned: each member is a group of its own, sent on arrival
                assert inner.names[-1] == f"crossover.group.{name}"
        comm.flush()
    assert inner.names == ["crossover.group.extra.x", "crossover.group.x", "crossover.group.y"]


def test_arrival_order_does_not_change_the_groups():
    """Ranks whose tensors arrive in different orders still send the same groups (planned by `order`)."""
    world = 2
    group = SimulatedGroup(world)
    comms = [GroupedCollectives(group.rank_view(r), first_bytes=4 * 1000, group_bytes=4 * 1000) for r in range(world)]
    numels = {"a": 1000, "b": 1000, "c": 1000, "d": 1000}
    orders = [["a", "b", "c", "d"], ["d", "c", "b", "a"]]
    for step in range(3):
        got = _step(comms, step, numels, orders)
        for name in numels:
            expect = torch.cat([_payloads(q, step)[name] for q in range(world)])
            assert all(torch.equal(got[r][name], expect) for r in range(world))


def test_ranks_that_grouped_other_tensors_raise():
    world = 2
    group = SimulatedGroup(world)
    comms = [GroupedCollectives(group.rank_view(r)) for r in range(world)]
    handles = []
    for r, comm in enumerate(comms):
        comm.begin_step()
        handles.append(comm.allgather_async(torch.zeros(2, 2, dtype=torch.int32), "w" if r == 0 else "v"))
    for comm in comms:
        comm.flush()
    w, v = group._pending.pop("crossover.group.extra.w"), group._pending.pop("crossover.group.extra.v")
    w[0].update(v[0])  # as if both had used one name
    group._pending["crossover.group.extra.w"] = w
    with pytest.raises(RuntimeError, match="grouped 1 tensors that differ"):
        comms[0].wait(handles[0])


def test_disabled_passes_through_and_bad_sizes_refused():
    group = SimulatedGroup(1)
    inner = _Counting(group.rank_view(0))
    comm = GroupedCollectives(inner, enabled=False)
    h = comm.allgather_async(torch.arange(4, dtype=torch.int32), "t")
    assert inner.names == ["t"] and torch.equal(comm.wait(h), torch.arange(4, dtype=torch.int32))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="first_bytes"):
            GroupedCollectives(inner, first_bytes=bad)
    assert FIRST_GROUP_BYTES == 1 << 20


class _Plan:
    """A dense step that measures (GraVAC's warm-up and dense trials): no CF, statistics wanted."""

    step, sent_cf, probes = 1, 1.0, ()


@pytest.mark.parametrize("residual_held", [False, True])
def test_dense_payload_is_the_gradient_when_statistics_go_apart(residual_held):
    """No copy of the gradient to append the statistics: the payload is the gradient's own storage, the
    statistics wait in ctx.stats_apart, and decode with their reduction gives what the appended form gives."""
    from crossover.compression.sparse_codec import SparseCodec
    from crossover.compression.wire import SparseStatsLayout

    group = SimulatedGroup(1)
    comm = group.rank_view(0)
    grad = torch.randn(1000)
    outs = []
    for apart in (False, True):
        codec = SparseCodec("topk", dense_stats_apart=apart)
        g = grad.clone()
        if residual_held:  # the first dense step after compressed ones sends the residual along, once
            codec.memory.residual("w", g).fill_(0.5)
        payload, ctx, sent = sparse_encode(codec, "w", g, _Plan(), 0.1, comm)
        assert sent == (1000 + SparseStatsLayout(0).length) * 4
        if apart:
            assert payload.data_ptr() == g.data_ptr() and payload.numel() == 1000
            stats = ctx.stats_apart.clone()
            out, reduced = codec.decode(payload.clone(), ctx, comm, stats)
        else:
            assert payload.numel() == 1000 + SparseStatsLayout(0).length
            out, reduced = codec.decode(payload.clone(), ctx, comm)
        outs.append((out, reduced, codec.memory.get("w")))
    (o0, s0, r0), (o1, s1, r1) = outs
    assert torch.equal(o0, o1) and torch.equal(s0, s1)
    assert torch.equal(o0, grad + (0.5 if residual_held else 0.0))
    if residual_held:
        assert torch.equal(r0, r1) and not bool(r1.any())


def test_buckets_are_ddps_first_small_then_large():
    """DDP's assignment: a bucket closes once it holds its cap (1 MiB first, then 25 MiB), whatever comes next."""
    from crossover.compression.grouped import cut_buckets

    mib = 1 << 18  # float32 elements in 1 MiB
    assert cut_buckets([10, 2560, 256, 409_600, 64, 18_432, 32, 288]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cut_buckets([mib - 1, 1, 5, 25 * mib, 3]) == [[0, 1], [2, 3], [4]]
    assert cut_buckets([3, 4], first_bytes=12, group_bytes=12) == [[0], [1]]
    assert cut_buckets([]) == []
