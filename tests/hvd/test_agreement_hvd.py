"""Ranks that disagree get a clear error, never a hang (issue 45), in real `horovodrun --gloo` jobs.

Each case builds fresh parameters under fresh names, lets one rank differ from the others in one setting, and trains a
few steps: every rank must raise `RanksDisagree` (crossover/compression/wire.py) at the first step, naming the
setting, its own rank and its own value, within seconds. Before the checks, the transport and grouping cases hung
silently (the codec's allgathers and alltoalls never matched), the transposed parameter under the sparse
reduce-scatter trained on silently with diverging replicas, and another CF under the reduce-scatter failed with
Horovod's "Mismatched data types: uint8 vs int32". The jobs' timeouts are far below the harness default, so a hang
fails the test. The unit tests of each check are in test_agreement_unit.py.
"""

from __future__ import annotations

import time

import torch
from hvd_harness import run_function

SHAPE = (100, 200)  # 20 000 elements: above the default min_compress_numel
STEPS = 3
FAST_S = 15.0  # seconds a rank may take to raise, from its first step


def _case(tag: str, comp, shapes: list[tuple[int, ...]]) -> dict:
    """Train STEPS steps of parameters of `shapes` (named `tag.pI`) with `comp`; what happened on this rank."""
    import horovod.torch as hvd

    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                   named_parameters=[(f"{tag}.p{i}", p) for i, p in enumerate(params)],
                                   compression=comp)
    gen = torch.Generator().manual_seed(hvd.rank())
    start = time.monotonic()
    try:
        for _ in range(STEPS):
            opt.zero_grad()
            sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params).backward()
            opt.step()
    except Exception as exc:  # what the user would see
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start,
            "checksum": float(sum(p.detach().double().sum() for p in params))}


def three_rank_job() -> dict:
    """Items 1, 3 and 10 on 3 ranks (where the sparse reduce-scatter runs): rank 2 (or 0) differs."""
    import horovod.torch as hvd

    from crossover import StaticCompression

    r = hvd.rank()
    transposed = SHAPE[::-1] if r == 2 else SHAPE
    return {
        "transport": _case("t", StaticCompression("topk", cf=10, transport="allgather" if r == 0 else "scatter"),
                           [SHAPE, SHAPE]),
        "shape": _case("s", StaticCompression("topk", cf=10, transport="scatter"), [SHAPE, transposed]),
        "cf": _case("c", StaticCompression("topk", cf=100 if r == 2 else 10, transport="scatter"), [SHAPE]),
        "agree": _case("a", StaticCompression("topk", cf=10, transport="scatter"), [SHAPE, SHAPE]),
    }


def two_rank_job() -> dict:
    """Item 2 and the seed on 2 ranks: rank 1 differs."""
    import horovod.torch as hvd

    from crossover import AdaptiveCompression, QSGDCompression, StaticCompression

    r = hvd.rank()
    ungrouped = AdaptiveCompression()
    ungrouped.grouped = r == 0
    return {
        "grouping": _case("g", ungrouped, [SHAPE, SHAPE]),
        "seed_agreed": _case("e", StaticCompression("topk", cf=10, transport="agreed", seed=r), [SHAPE]),
        "cf": _case("c", StaticCompression("topk", cf=20 if r == 1 else 10), [SHAPE]),
        "bits": _case("q", QSGDCompression(bits=4 if r == 1 else 8, transport="allgather"), [SHAPE]),
        "agree": _case("a", AdaptiveCompression(), [SHAPE, SHAPE]),
    }


def _refused(results: list[dict], case: str, words: str) -> list[str]:
    msgs = []
    for rank, res in enumerate(results):
        got = res[case]
        assert got["error"] == "RanksDisagree", (case, rank, got)
        assert words in got["message"] and f"this rank ({rank})" in got["message"], (case, rank, got["message"])
        assert got["seconds"] < FAST_S, (case, rank, got["seconds"])
        msgs.append(got["message"])
    return msgs


def test_three_ranks_that_disagree_are_refused_fast():
    res = run_function(three_rank_job, np=3, timeout=75)
    msgs = _refused(res, "transport", "the ranks disagree on the transport of 'crossover.bucket000[t.p0..t.p1]'")
    assert "sends it by 'allgather'" in msgs[0] and "set transport= alike on every rank" in msgs[0]
    assert all("sends it by 'scatter'" in m for m in msgs[1:])
    msgs = _refused(res, "shape", "the ranks disagree on the shape of 's.p1'")
    assert "shape (200, 100)" in msgs[2] and "shape (100, 200)" in msgs[0]
    msgs = _refused(res, "cf", "the ranks disagree on the compressor or compression factor of 'c.p0'")
    assert "at CF 100" in msgs[2] and "at CF 10" in msgs[0]
    assert all(r["agree"]["error"] is None for r in res)
    assert len({r["agree"]["checksum"] for r in res}) == 1  # agreeing ranks train alike


def test_two_ranks_that_disagree_are_refused_fast():
    res = run_function(two_rank_job, np=2, timeout=60)
    msgs = _refused(res, "grouping", "the ranks disagree on how the allgathers of 'crossover.bucket000[g.p0..g.p1]'")
    assert "grouped=True" in msgs[0] and "grouped=False" in msgs[1]
    msgs = _refused(res, "seed_agreed", "the ranks disagree on the seed of 'e.p0'")
    assert "seed=0" in msgs[0] and "seed=1" in msgs[1] and "same seed on every rank" in msgs[1]
    msgs = _refused(res, "cf", "compressor or compression factor of 'c.p0'")
    assert "at CF 10" in msgs[0] and "at CF 20" in msgs[1]
    msgs = _refused(res, "bits", "compressor or compression factor of 'q.p0'")  # gathered garbage before
    assert "8-bit quantization" in msgs[0] and "4-bit quantization" in msgs[1]
    assert all(r["agree"]["error"] is None for r in res)
    assert len({r["agree"]["checksum"] for r in res}) == 1
