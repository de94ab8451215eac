"""What a user keeps (issue 33): with momentum SGD, compressed training ends within the bound of dense.

A real 2-rank Horovod job (benchmarks/accuracy_curves.py) trains the digits MLP (64-1024-1024-10) with SGD
momentum 0.9, lr 0.05, three ways in the same processes, side by side on the same batches from the same start:
dense, static top-k 10x (the CF the defaults allow under this momentum) and ``AdaptiveCompression()`` with its
defaults, on 3 seeds. "Final" is the mean test accuracy over the last 10 % of the steps (the test set has 360
images, one image is 0.28 points: a single evaluation is too noisy). Each compressed method's median gap to dense
over the seeds must be within dense's own seed-to-seed spread, or 0.5 point, whichever is larger (the matrix's
target, benchmarks/report.py), and the defaults must have read the optimizer's momentum and capped the CF at 10.

The check can fail: with static top-k 100x in place of 10x the same job ended 3.0 and 3.1 points under dense and 0.3
above (median gap -3.0 against a bound of 1.1; docs/accuracy.md has the figures).
"""

from __future__ import annotations

import statistics

from hvd_harness import run_function

from benchmarks.accuracy_curves import run_seeds

SEEDS = [0, 1, 2]
METHODS = ["dense", "topk:10", "gravac"]


def test_momentum_sgd_compressed_runs_end_within_the_bound_of_dense():
    r0, r1 = run_function(run_seeds, args=(SEEDS, METHODS, {"epochs": 20, "lr": 0.05, "momentum": 0.9}),
                          timeout=900)
    assert r0 == r1  # every rank ends with the same models
    seeds = [str(s) for s in SEEDS]
    assert all(r0[s]["gravac"]["max_cf"] == 10.0 for s in seeds), r0  # the optimizer's momentum capped the CF
    # from the first step on
    assert all(r0[s]["gravac"]["steps_above_cap"] == [] for s in seeds), r0
    dense = [r0[s]["dense"]["final"] for s in seeds]
    bound = max(max(dense) - min(dense), 0.005)
    for name in METHODS[1:]:
        gaps = [r0[s][name]["final"] - r0[s]["dense"]["final"] for s in seeds]
        assert statistics.median(gaps) >= -bound, (name, gaps, f"bound {bound:.4f}")
