"""The allgather's bitmap wire format (sparse_codec.send_allgather / receive, wire.gather_bitmap), simulated
ranks.

Where a rank's k selected entries are dense enough (about CF < 32), they travel as a bitmap of the tensor and the
values in index order instead of (index, value) pairs. The real multi-rank jobs that cover it are the Horovod and
DDP tests at CF 10 (tests/hvd/test_grouped_hvd.py, tests/ddp/test_ddp_hook.py); here the format's maths and its
refusals.
"""

from __future__ import annotations

import math

import pytest
import torch
from codec_calls import sparse_encode

from crossover.compression import cost_model, sparse_codec, wire
from crossover.compression.collectives import SimulatedGroup
from crossover.compression.selectors import Selection
from crossover.compression.sparse_codec import SparseCodec


class _Plan:
    def __init__(self, step: int, cf: float) -> None:
        self.step, self.sent_cf, self.probes = step, cf, (cf,)


def test_the_bitmap_is_chosen_below_cf_32_and_saves_a_third_at_cf_10() -> None:
    n = 1_000_000
    assert wire.gather_bitmap(n // 10, n)
    assert not wire.gather_bitmap(n // 100, n)
    assert not wire.gather_bitmap(n // 40, n)
    ratio = cost_model.gather_part_bytes(n // 10, n, True) / cost_model.gather_part_bytes(n // 10, n, False)
    assert 0.6 < ratio < 0.7
    pairs = cost_model.ring_allgather(8 * (n // 10) + cost_model.GATHER_HEADER_BYTES, 2).bytes
    assert cost_model.transport_cost(cost_model.ALLGATHER, n, n // 10, 2).bytes < 0.7 * pairs


def _run(world: int, n: int, cf: float, bitmap: bool, steps: int = 3) -> tuple[list, list, list]:
    """Every rank's decoded gradients, what each applied, and the contexts, per step."""
    group = SimulatedGroup(world, timeout_s=30)
    codecs = [SparseCodec("topk", fixed_gather=True) for _ in range(world)]
    for c in codecs:
        c.gather_bitmap = bitmap
    gen = torch.Generator().manual_seed(world * 7 + n)
    outs, applied, ctxs = [], [], []
    for step in range(steps):
        grads = [torch.randn(n, generator=gen) * (1 + 5 * r) for r in range(world)]  # ranks differ on purpose
        before = [c.memory._residuals.get("w", torch.zeros(n)).clone() for c in codecs]
        enc = [sparse_encode(c, "w", grads[r].clone(), _Plan(step, cf), 0.01, group.rank_view(r))
               for r, c in enumerate(codecs)]
        reduced = sum(e[0] for e in enc) / world
        outs.append([c.decode(reduced.clone(), enc[r][1], group.rank_view(r))[0].clone()
                     for r, c in enumerate(codecs)])
        applied.append([grads[r] + before[r] - codecs[r].memory._residuals["w"] for r in range(world)])
        ctxs.append([e[1] for e in enc])
    return outs, applied, ctxs


@pytest.mark.parametrize("world,n", [(2, 5003), (3, 4096), (4, 70)])
def test_bitmaps_decode_the_exact_average_the_same_on_every_rank_and_as_pairs_do(world: int, n: int) -> None:
    got, applied, ctxs = _run(world, n, 10, True)
    ref, _, ref_ctxs = _run(world, n, 10, False)
    assert all(c.bitmap for step in ctxs for c in step) and not any(c.bitmap for step in ref_ctxs for c in step)
    for step in range(len(got)):
        assert all(torch.equal(got[step][0], o) for o in got[step][1:]), "every rank decodes the same"
        avg = sum(applied[step]) / world
        torch.testing.assert_close(got[step][0], avg, rtol=0, atol=1e-6 * float(avg.abs().max()))
        torch.testing.assert_close(got[step][0], ref[step][0], rtol=1e-6, atol=1e-7)  # the same as pairs
        assert int((got[step][0] != 0).sum()) <= world * math.ceil(n / 10)


def test_bitmaps_send_fewer_bytes() -> None:
    n = 100_000
    sent = {}
    for bitmap in (True, False):
        group = SimulatedGroup(2)  # rank 0 encodes only: nothing waits for rank 1
        codec = SparseCodec("topk", fixed_gather=True)
        codec.gather_bitmap = bitmap
        sent[bitmap] = sparse_encode(codec, "w", torch.randn(n), _Plan(0, 10), 0.01, group.rank_view(0))[2]
    assert sent[True] < 0.7 * sent[False]


def _packed(sel: Selection, n: int, k: int,
            bitmap: bool) -> tuple[torch.Tensor, sparse_codec.SparseCtx, SimulatedGroup]:
    group = SimulatedGroup(1)
    rows = sparse_codec.gather_rows(k, n, bitmap)
    packed = torch.empty((rows + sparse_codec.HEADER_ROWS, 2), dtype=torch.int32)
    sparse_codec.send_allgather(sel, torch.ones(1), group.rank_view(0), "w", packed, (n,), bitmap)
    ctx = sparse_codec.SparseCtx(kind=sparse_codec.ALLGATHER, key="w", shape=torch.Size((n,)), numel=n, nstats=1, k=k,
                              bitmap=bitmap)
    return packed, ctx, group


def test_values_follow_their_indices_in_any_order() -> None:
    n, k = 640, 64
    sel = Selection(idx=torch.tensor([600, 5, 9], dtype=torch.int32), val=torch.tensor([1.0, 2.0, 3.0]),
                    sumsq_sel=0.0, sumsq_acc=0.0)
    packed, ctx, group = _packed(sel, n, k, True)
    out = sparse_codec.receive(torch.ones(1), _with(ctx, group, packed), group.rank_view(0), torch.empty(n))
    want = torch.zeros(n)
    want[600], want[5], want[9] = 1.0, 2.0, 3.0
    assert torch.equal(out, want)


def test_a_repeated_index_adds_up_as_with_pairs() -> None:
    n, k = 640, 64
    idx = torch.tensor([5, 9, 5, 600], dtype=torch.int32)
    val = torch.tensor([1.0, 2.0, 3.0, -4.0])
    sel = Selection(idx=idx, val=val, sumsq_sel=0.0, sumsq_acc=0.0)
    packed, ctx, group = _packed(sel, n, k, True)
    ctx.handle = group.rank_view(0).allgather_async(packed, "w2")
    out = sparse_codec.receive(torch.ones(1), ctx, group.rank_view(0), torch.empty(n))
    want = torch.zeros(n)
    want[5], want[9], want[600] = 4.0, 2.0, -4.0
    assert torch.equal(out, want)


def test_garbled_bitmaps_and_mixed_formats_raise() -> None:
    n, k = 100, 20  # 100 elements: the bitmap's 128 bits end with 28 that must stay clear
    sel = Selection(idx=torch.tensor([1, 50], dtype=torch.int32), val=torch.tensor([1.0, 2.0]), sumsq_sel=0.0,
                    sumsq_acc=0.0)
    packed, ctx, group = _packed(sel, n, k, True)
    bad = packed.clone()
    bad[sparse_codec.HEADER_ROWS + 1, 1] = -1  # bits beyond the tensor's 100 elements
    with pytest.raises(RuntimeError, match="beyond the tensor"):
        sparse_codec.receive(torch.ones(1), _with(ctx, group, bad), group.rank_view(0), torch.empty(n))
    bad = packed.clone()
    bad[sparse_codec.HEADER_ROWS, :] = -1  # 64 marks, 20 values
    bad[sparse_codec.HEADER_ROWS + 1, :] = 0
    with pytest.raises(RuntimeError, match="more elements than"):
        sparse_codec.receive(torch.ones(1), _with(ctx, group, bad), group.rank_view(0), torch.empty(n))
    pairs, pctx, _ = _packed(sel, n, k, False)
    with pytest.raises(RuntimeError, match="another wire format"):
        sparse_codec.receive(torch.ones(1), _with(ctx, group, pairs), group.rank_view(0), torch.empty(n))


def _with(ctx: sparse_codec.SparseCtx, group: SimulatedGroup, payload: torch.Tensor) -> sparse_codec.SparseCtx:
    ctx.handle = group.rank_view(0).allgather_async(payload, f"w.{id(payload)}")
    return ctx
