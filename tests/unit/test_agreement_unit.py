"""Ranks that disagree get a clear error, never a hang (issue 45): the agreement checks in the statistics vector
(crossover/compression/wire.py: Agreement, CHECK_SLOTS), unit by unit and through the codecs on simulated ranks.
The real multi-rank Horovod jobs are in test_agreement_hvd.py."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from crossover.compression import cost_model
from crossover.compression.collectives import SimulatedGroup
from crossover.compression.grouped import GroupedCollectives
from crossover.compression.lowrank_codec import LowRankCodec
from crossover.compression.quant_codec import QuantCodec
from crossover.compression.sparse_codec import SparseCodec
from crossover.compression.wire import CHECK_LEN, CHECK_SLOTS, Agreement, RanksDisagree, SparseStatsLayout, check_span
from crossover.driver import StepRecord

BASE = Agreement(shape=(100, 200), dtype="float32", compressor="topk", sent_cf=10.0, probes=(10.0, 20.0),
                 transport="allgather", seed=None, grouped=True, bitmap=True)

#: field changed alone -> (the changes, the check that must name it, words of its message)
CHANGES = {
    "shape, transposed": ({"shape": (200, 100)}, "tensor", "disagree on the shape"),
    "shape, element count": ({"shape": (100, 201)}, "tensor", "disagree on the shape"),
    "dtype": ({"dtype": "float64"}, "tensor", "disagree on the shape"),
    "compressor": ({"compressor": "dgc"}, "compression", "compressor or compression factor"),
    "sent CF": ({"sent_cf": 20.0}, "compression", "compressor or compression factor"),
    "probes": ({"probes": (10.0,)}, "compression", "compressor or compression factor"),
    "transport": ({"transport": "scatter"}, "transport", "disagree on the transport"),
    "grouping": ({"grouped": False}, "format", "how the allgathers"),
    "wire format": ({"bitmap": False}, "format", "how the allgathers"),
    "seed drawn from": ({"seed": 7}, "seed", "disagree on the seed"),
}


def _slot_range(name: str) -> range:
    start = 0
    for slot, pieces in CHECK_SLOTS:
        if slot == name:
            return range(start, start + 2 * pieces)
        start += 2 * pieces
    raise KeyError(name)


def _reduce32(vectors: list[list[float]], prescale: bool) -> list[float]:
    """Each rank's vector summed in float32 as the hosts do: Horovod's Average sums then scales by 1/world, the DDP
    hook scales each rank's payload by 1/world then sums (sequential sums: the worst order for rounding)."""
    world = len(vectors)
    t = torch.tensor(vectors, dtype=torch.float32)
    inv = torch.tensor(1.0 / world, dtype=torch.float32)
    acc = torch.zeros(t.shape[1], dtype=torch.float32)
    for row in t:
        acc = acc + (row * inv if prescale else row)
    return (acc if prescale else acc * inv).tolist()


def _judge(ranks: list[Agreement], prescale: bool = False) -> list[str | None]:
    """Each rank's verdict on the reduced checks of `ranks` (one Agreement per rank): its message, or None."""
    world = len(ranks)
    reduced = _reduce32([[1.0, *a.values(world)] for a in ranks], prescale)
    out: list[str | None] = []
    for r, a in enumerate(ranks):
        try:
            a.check(reduced[1:], reduced[0], world, "fc1.weight", r)
            out.append(None)
        except RanksDisagree as exc:
            out.append(str(exc))
    return out


@pytest.mark.parametrize("field", list(CHANGES))
@pytest.mark.parametrize("world", [2, 3])
def test_each_field_changes_its_own_check_and_is_named(field, world):
    """Changing one field alone changes the fingerprint in its own slot only, and every rank raises naming it
    (removing a field from the fingerprint fails here)."""
    change, slot, words = CHANGES[field]
    base = BASE if slot != "seed" else dataclasses.replace(BASE, seed=3)
    other = dataclasses.replace(base, **change)
    mine, theirs = base.values(world), other.values(world)
    assert len(mine) == CHECK_LEN
    differ = {i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b}
    assert differ and differ <= set(_slot_range(slot)), (field, differ)
    ranks = [base] * (world - 1) + [other]
    said = _judge(ranks)
    for r, msg in enumerate(said):
        assert msg is not None and words in msg and f"this rank ({r})" in msg, (field, msg)
    assert _judge([base] * world) == [None] * world


def test_messages_name_this_rank_and_its_own_value():
    ranks = [BASE, dataclasses.replace(BASE, transport="scatter", bitmap=False), BASE]
    said = _judge(ranks)
    assert "this rank (0) sends it by 'allgather'" in said[0] and "set transport= alike" in said[0]
    assert "this rank (1) sends it by 'scatter'" in said[1]
    said = _judge([dataclasses.replace(BASE, shape=(200, 100)), BASE])
    assert "shape (200, 100)" in said[0] and "shape (100, 200)" in said[1]
    said = _judge([dataclasses.replace(BASE, sent_cf=20.0), BASE])
    assert "at CF 20" in said[0] and "at CF 10" in said[1] and "probing CF 10, 20" in said[1]
    said = _judge([dataclasses.replace(BASE, grouped=False), BASE])
    assert "grouped=False" in said[0] and "grouped=True" in said[1]
    said = _judge([dataclasses.replace(BASE, transport="allreduce", compressor="randomk", seed=s)
                   for s in (0, 1)])
    for r, msg in enumerate(said):
        assert f"seed={r}" in msg and "different seeds" in msg and "same seed on every rank" in msg


def test_the_seed_counts_only_where_something_is_drawn_from_it():
    assert dataclasses.replace(BASE, seed=None).values(2) == BASE.values(2)
    assert dataclasses.replace(BASE, seed=0).values(2) != dataclasses.replace(BASE, seed=1).values(2)


@pytest.mark.parametrize("world", [2, 3, 8, 64, 250, 511])
@pytest.mark.parametrize("prescale", [False, True])
def test_checks_survive_float32_reductions(world, prescale):
    """Equal ranks never look different, and one rank whose pieces differ always does, after the float32
    reductions of either host, at any world size (the pieces stay below wire.check_span)."""
    span = check_span(world)
    assert world * span <= 512
    gen = torch.Generator().manual_seed(world)
    for trial in range(20):
        dims = tuple(int(d) for d in torch.randint(1, 4000, (2,), generator=gen))
        a = dataclasses.replace(BASE, shape=dims, sent_cf=float(trial + 2), seed=trial)
        assert max(a.values(world)[0::2]) <= max(span, 500 // world)
        assert _judge([a] * world, prescale) == [None] * world
        b = dataclasses.replace(a, shape=dims[::-1] if dims[0] != dims[1] else (dims[0] + 1, dims[1]))
        verdicts = _judge([a] * (world - 1) + [b], prescale)
        assert all(v is not None for v in verdicts) == (a.values(world) != b.values(world))
        assert len(set(verdicts)) <= world  # each rank names itself


# ------------------------------------------------------------------------------------------------
# Through the codecs, on simulated ranks: a disagreement raises in decode on every rank BEFORE any wait on the
# codec's own collectives (SimulatedGroup raises "would hang" on a wait that no rank can complete).
# ------------------------------------------------------------------------------------------------
def _decode_all(codecs, encoded, views, comms=None) -> list[str]:
    world = len(codecs)
    reduced = torch.stack([e[0] for e in encoded]).sum(0) / world  # Horovod's Average
    out = []
    for r, (c, e) in enumerate(zip(codecs, encoded)):
        comm = comms[r] if comms is not None else views[r]
        if isinstance(comm, GroupedCollectives):
            comm.flush()
        with pytest.raises(RanksDisagree) as info:
            c.decode(reduced.clone(), e[1], comm)
        out.append(str(info.value))
    return out


def _grads(world: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=gen) for _ in range(world)]


def test_codec_ranks_on_different_transports_raise_before_waiting():
    """Item 1: 'allgather' on rank 0, 'scatter' on ranks 1 and 2 (3 ranks): each collective has one or two of the
    three ranks; every rank raises naming the transport instead of waiting."""
    world, shape = 3, (100, 200)
    group = SimulatedGroup(world)
    views = [group.rank_view(r) for r in range(world)]
    codecs = [SparseCodec("topk") for _ in range(world)]
    rec = StepRecord(step=1, sent_cf=10.0, probes=())
    kinds = [cost_model.ALLGATHER, cost_model.SCATTER, cost_model.SCATTER]
    enc = [c.encode("fc1.weight", g, rec, 0.0, v, kind) for c, g, v, kind in zip(codecs, _grads(world, shape),
                                                                                   views, kinds)]
    said = _decode_all(codecs, enc, views)
    assert "this rank (0) sends it by 'allgather'" in said[0]
    assert "this rank (1) sends it by 'scatter'" in said[1] and "this rank (2) sends it by 'scatter'" in said[2]


def test_codec_ranks_that_group_differently_raise_before_waiting():
    """Item 2: grouped allgathers on rank 0, one per tensor on rank 1."""
    world, shape = 2, (100, 200)
    group = SimulatedGroup(world)
    views = [group.rank_view(r) for r in range(world)]
    comms = [GroupedCollectives(v, enabled=(r == 0)) for r, v in enumerate(views)]
    codecs = [SparseCodec("topk", fixed_gather=True) for _ in range(world)]
    rec = StepRecord(step=1, sent_cf=10.0, probes=())
    for c in comms:
        c.begin_step()
    enc = [c.encode("w", g, rec, 0.0, comm, cost_model.ALLGATHER)
           for c, g, comm in zip(codecs, _grads(world, shape), comms)]
    said = _decode_all(codecs, enc, views, comms)
    assert "this rank (0) sends them in groups (grouped=True)" in said[0]
    assert "this rank (1) sends them one collective per tensor (grouped=False)" in said[1]


@pytest.mark.parametrize("what", ["transposed", "cf"])
def test_codec_scatter_ranks_with_another_shape_or_cf_raise(what):
    """Items 3 and 10: under the sparse reduce-scatter (3 ranks), a transposed parameter on rank 2 was summed
    silently; another CF on rank 2 failed in Horovod's alltoall with 'Mismatched data types'."""
    world, shape = 3, (100, 200)
    group = SimulatedGroup(world)
    views = [group.rank_view(r) for r in range(world)]
    codecs = [SparseCodec("topk") for _ in range(world)]
    shapes = [shape, shape, shape[::-1] if what == "transposed" else shape]
    cfs = [10.0, 10.0, 10.0 if what == "transposed" else 100.0]
    gen = torch.Generator().manual_seed(2)
    enc = [c.encode("w", torch.randn(s, generator=gen), StepRecord(step=1, sent_cf=cf, probes=()), 0.0, v,
                    cost_model.SCATTER) for c, s, cf, v in zip(codecs, shapes, cfs, views)]
    said = _decode_all(codecs, enc, views)
    words = "disagree on the shape" if what == "transposed" else "compressor or compression factor"
    assert all(words in m for m in said), said
    if what == "cf":
        assert "at CF 100" in said[2] and "at CF 10" in said[0]


@pytest.mark.parametrize("transport", [cost_model.ALLREDUCE, cost_model.AGREED])
def test_codec_ranks_with_different_seeds_raise(transport):
    """The seed is one of the checks (no second mechanism): random-k's indices, the agreed set's first draw."""
    world, shape = 2, (100, 200)
    group = SimulatedGroup(world)
    views = [group.rank_view(r) for r in range(world)]
    codecs = [SparseCodec("randomk" if transport == cost_model.ALLREDUCE else "topk", seed=r) for r in range(world)]
    rec = StepRecord(step=1, sent_cf=10.0, probes=())
    enc = [c.encode("w", g, rec, 0.0, v, transport) for c, g, v in zip(codecs, _grads(world, shape), views)]
    said = _decode_all(codecs, enc, views)
    for r, msg in enumerate(said):
        assert f"seed={r}" in msg and "different seeds" in msg and "same seed on every rank" in msg


def test_lowrank_ranks_with_different_seeds_raise_before_waiting():
    """PowerSGD draws its first Q from the seed: ranks with different seeds would average unrelated factors."""
    world, shape = 2, (64, 96)
    group = SimulatedGroup(world)
    views = [group.rank_view(r) for r in range(world)]
    codecs = [LowRankCodec(seed=r) for r in range(world)]
    rec = StepRecord(step=1, sent_cf=10.0, probes=())
    enc = [c.encode("w", g, rec, 0.0, v) for c, g, v in zip(codecs, _grads(world, shape), views)]
    said = _decode_all(codecs, enc, views)
    for r, msg in enumerate(said):
        assert f"seed={r}" in msg and "first Q" in msg


@pytest.mark.parametrize("what", ["bits", "transposed"])
def test_quantized_allgather_ranks_that_disagree_raise_before_waiting(what):
    """Packed codes travel by allgather, which takes segments of any length: ranks at other bits or with a transposed
    parameter gathered and decoded garbage silently. Now the statistics carry the checks, judged before the wait."""
    world, shape = 2, (100, 200)
    group = SimulatedGroup(world)
    views = [group.rank_view(r) for r in range(world)]
    codecs = [QuantCodec() for _ in range(world)]
    bits = [8, 4 if what == "bits" else 8]
    shapes = [shape, shape[::-1] if what == "transposed" else shape]
    gen = torch.Generator().manual_seed(3)
    enc = [c.encode("w", torch.randn(s, generator=gen), b, 1, v, cost_model.ALLGATHER)
           for c, s, b, v in zip(codecs, shapes, bits, views)]
    said = _decode_all(codecs, enc, views)
    if what == "bits":
        assert "8-bit quantization" in said[0] and "4-bit quantization" in said[1]
    else:
        assert all("disagree on the shape" in m for m in said) and "shape (200, 100)" in said[1]


def test_agreeing_quantized_ranks_decode_as_before():
    world, shape = 2, (100, 200)
    group = SimulatedGroup(world)
    views = [group.rank_view(r) for r in range(world)]
    codecs = [QuantCodec() for _ in range(world)]
    enc = [c.encode("w", g, 4, 1, v, cost_model.ALLGATHER) for c, g, v in zip(codecs, _grads(world, shape), views)]
    reduced = torch.stack([e[0] for e in enc]).sum(0) / world
    outs = [c.decode(reduced.clone(), e[1], v) for c, e, v in zip(codecs, enc, views)]
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]
    assert outs[0][1][0] == pytest.approx(1.0)


def test_agreeing_codecs_carry_the_checks_and_decode_as_before():
    """The checks end every torch codec's statistics (the driver's layout says so); agreeing ranks decode."""
    world, shape = 2, (100, 200)
    group = SimulatedGroup(world)
    views = [group.rank_view(r) for r in range(world)]
    codecs = [SparseCodec("topk", fixed_gather=True) for _ in range(world)]
    rec = StepRecord(step=1, sent_cf=10.0, probes=(10.0,))
    enc = [c.encode("w", g, rec, 0.0, v, cost_model.ALLGATHER) for c, g, v in zip(codecs, _grads(world, shape),
                                                                                   views)]
    layout = SparseStatsLayout(1)
    assert all(e[1].nstats == layout.length and e[0].numel() == layout.length for e in enc)
    reduced = torch.stack([e[0] for e in enc]).sum(0) / world
    outs = [c.decode(reduced.clone(), e[1], v)[0] for c, e, v in zip(codecs, enc, views)]
    assert torch.equal(outs[0], outs[1])


def test_scatter_another_tensors_failed_alltoall_waits_for_its_own_check():
    """The first decode of a step waits for every reduce-scattered tensor's alltoall (to start their allgathers
    together). Where another tensor's exchange fails there (rank 2 holds it with more elements), the error is kept
    for that tensor's own decode, where its check names the shape on every rank; the first tensor decodes."""
    import threading

    world = 3
    group = SimulatedGroup(world, timeout_s=20)
    codecs = [SparseCodec("topk") for _ in range(world)]
    rec = StepRecord(step=1, sent_cf=100.0, probes=())
    gen = torch.Generator().manual_seed(3)
    shapes_b = [(100, 200), (100, 200), (100, 300)]
    enc_a, enc_b = [], []
    for r, c in enumerate(codecs):
        view = group.rank_view(r)
        enc_a.append(c.encode("a", torch.randn(100, 200, generator=gen), rec, 0.0, view, cost_model.SCATTER))
        enc_b.append(c.encode("b", torch.randn(shapes_b[r], generator=gen), rec, 0.0, view, cost_model.SCATTER))
    red_a = torch.stack([e[0] for e in enc_a]).sum(0) / world
    red_b = torch.stack([e[0] for e in enc_b]).sum(0) / world
    got: list = [None] * world

    def run(r: int) -> None:
        view, out = group.rank_view(r), []
        for red, e in ((red_a, enc_a[r]), (red_b, enc_b[r])):
            try:
                codecs[r].decode(red.clone(), e[1], view)
                out.append(None)
            except Exception as exc:
                out.append(exc)
        got[r] = out

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, (a, b) in enumerate(got):
        assert a is None, (r, a)
        assert isinstance(b, RanksDisagree) and "disagree on the shape of 'b'" in str(b), (r, b)


def test_parameters_that_differ_between_ranks_are_named_on_every_rank():
    """A bucket's flat shape cannot tell (100, 200) from (200, 100): the hosts that bucket check the ranks'
    parameters once, and every rank names what differs."""
    from crossover.compression.wire import check_same_parameters

    a = [("fc.weight", "float32", (100, 200)), ("fc.bias", "float32", (100,))]
    check_same_parameters([a, list(a)], 1)  # alike: nothing raised
    transposed = [("fc.weight", "float32", (200, 100)), a[1]]
    for rank, shape in ((0, "(100, 200)"), (1, "(200, 100)")):
        with pytest.raises(RanksDisagree, match=rf"shape of 'fc.weight': this rank \({rank}\) has it as float32 of "
                                                rf"shape {re.escape(shape)}"):
            check_same_parameters([a, transposed], rank)
    with pytest.raises(RanksDisagree, match=r"parameters to compress: at position 1 .*this rank \(1\) has nothing"):
        check_same_parameters([a, a[:1]], 1)
    with pytest.raises(RanksDisagree, match=r"at position 0 .*this rank \(0\) has 'fc.weight'"):
        check_same_parameters([a, [("other", "float32", (3,)), a[1]]], 0)
