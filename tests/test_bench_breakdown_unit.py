"""The breakdown benchmark's interval beside each verdict (benchmarks/bench_breakdown.py), on made-up ratios."""

from __future__ import annotations

import random
import statistics

from benchmarks.bench_breakdown import median_ci


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
