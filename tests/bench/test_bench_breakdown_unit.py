"""The breakdown benchmark's interval beside each verdict and its targets (benchmarks/bench_breakdown.py), on made-up
records."""

from __future__ import annotations

import random
import statistics

from benchmarks.bench_breakdown import _append_job, format_report, median_ci, summarize


def test_the_interval_brackets_the_median_and_is_the_same_on_every_call() -> None:
    rng = random.Random(3)
    ratios = [rng.lognormvariate(0.0, 0.25) for _ in range(40)]
    lo, hi = median_ci(ratios)
    assert lo < statistics.median(ratios) < hi
    assert median_ci(ratios) == (lo, hi)  # a fixed seed: a report regenerated from the same records is the same


def test_the_interval_narrows_with_more_rounds_and_vanishes_for_constant_ratios() -> None:
    rng = random.Random(5)
    few = [rng.lognormvariate(0.0, 0.25) for _ in range(12)]
    many = [rng.lognormvariate(0.0, 0.25) for _ in range(400)]
    (a, b), (c, d) = median_ci(few), median_ci(many)
    assert d - c < (b - a) / 2
    assert median_ci([1.05] * 10) == (1.05, 1.05)
    assert median_ci([1.0, 2.0, 3.0, 4.0]) is None  # under 5 rounds: nothing worth printing


def _method(step_s: float, wall_s: float, blocks: int = 3, block: int = 4) -> dict:
    recs = [{p: 0.0 for p in ("cpu", "fwd", "bwd", "wait", "opt")} | {"step": step_s} for _ in range(blocks * block)]
    return {"records": recs, "blocks": [(i * block, (i + 1) * block) for i in range(blocks)],
            "settled": [None] * len(recs), "wire": [(1000 * block, block)] * blocks, "walls": [wall_s * block] * blocks,
            "stats": {"bytes_sent": 500, "step": 1}}


def test_the_targets_compare_every_cf_run_on_both_paths_with_the_wall_clock_ratio() -> None:
    """Issue 43: CF 10 and CF 100 side by side, each with the ratio of the wall clocks (own-jobs mode)."""
    res = {"params": 1, "size": 2, "methods": {
        "hvd-topk:10": _method(0.030, 0.033), "ddp-topk:10": _method(0.020, 0.022),
        "hvd-topk:100": _method(0.021, 0.024), "ddp-topk:100": _method(0.020, 0.020)}}
    targets = {t["a"]: t for t in summarize(res, 100.0)["targets"]}
    assert set(targets) == {"hvd-topk:10", "hvd-topk:100"}
    assert abs(targets["hvd-topk:10"]["ratio"] - 1.5) < 1e-9 and not targets["hvd-topk:10"]["pass"]
    assert abs(targets["hvd-topk:10"]["wall"] - 1.5) < 1e-9
    assert abs(targets["hvd-topk:100"]["ratio"] - 1.05) < 1e-9 and targets["hvd-topk:100"]["pass"]
    assert abs(targets["hvd-topk:100"]["wall"] - 1.2) < 1e-9
    meta = {"command": "x", "date": "d", "commit": "c", "load": 0.0, "rounds": 3, "block": 4, "warmup": 1,
            "batch": 32, "rate": "r", "own_jobs": True, "model": "cnn", "model_desc": "m", "params": 1, "size": 2}
    text = format_report(summarize(res, 100.0), meta)
    assert "each method its own job" in text and "| 1.500x |" in text and "| 1.200x |" in text


def test_the_floor_pair_is_context_without_a_verdict() -> None:
    """hvd-floor:CF / ddp-floor:CF (each path moving CF's bytes with no codec) is what Horovod itself costs: shown
    beside the targets with its ratio, never judged against their bound."""
    res = {"params": 1, "size": 2, "methods": {"hvd-floor:10": _method(0.030, 0.033),
                                               "ddp-floor:10": _method(0.020, 0.022)}}
    (t,) = summarize(res, 100.0)["targets"]
    assert t["a"] == "hvd-floor:10" and abs(t["ratio"] - 1.5) < 1e-9 and "pass" not in t
    meta = {"command": "x", "date": "d", "commit": "c", "load": 0.0, "rounds": 3, "block": 4, "warmup": 1,
            "batch": 32, "rate": "r", "own_jobs": True, "model": "cnn", "model_desc": "m", "params": 1, "size": 2}
    row = next(line for line in format_report(summarize(res, 100.0), meta).splitlines() if "hvd-floor:10 /" in line)
    assert "no codec" in row and row.endswith("| - |") and "FAIL" not in row


def test_own_jobs_of_a_method_append_their_blocks_in_turn() -> None:
    """--own-jobs runs a method as several jobs that take turns with the other methods': the second job's blocks
    index its own records, after the first's."""
    methods: dict = {}
    first, second = _method(0.010, 0.011, blocks=2), _method(0.020, 0.021, blocks=1)
    _append_job(methods, first, "hvd-topk:10")
    _append_job(methods, second, "hvd-topk:10")
    m = methods["hvd-topk:10"]
    assert m["blocks"] == [(0, 4), (4, 8), (8, 12)]
    assert [r["step"] for r in m["records"][8:12]] == [0.020] * 4
    assert len(m["walls"]) == len(m["wire"]) == 3 and len(m["settled"]) == 12

