"""What a user keeps (issue 33): with momentum SGD, compressed training ends within the bound of dense.

A real 2-rank Horovod job trains the digits MLP (64-1024-1024-10) with SGD momentum 0.9, lr 0.05, three ways in
the same processes, side by side on the same batches from the same start: dense, static top-k 10x (the CF the
defaults allow under this momentum) and ``AdaptiveCompression()`` with its defaults, on 3 seeds. "Final" is the
mean test accuracy over the last 10 % of the steps (the test set has 360 images, one image is 0.28 points: a single
evaluation is too noisy). Each compressed method's median gap to dense over the seeds must be within dense's own
seed-to-seed spread, or 0.5 point, whichever is larger (the matrix's target, benchmarks/report.py), and the defaults
must have read the optimizer's momentum and capped the CF at 10.

The check can fail: with static top-k 100x in place of 10x the same job ended 3.0, 3.1 and -0.3 points under dense
(median gap -3.0 against a bound of 1.1; docs/accuracy.md has the figures).
"""

from __future__ import annotations

import statistics

import torch
from hvd_harness import run_function

SEEDS = (0, 1, 2)
EPOCHS = 20
HIDDEN = 1024
BATCH = 32
LR, MOMENTUM = 0.05, 0.9
FINAL_WINDOW = 0.10  # the last 10 % of the steps, as the benchmark report's robust final
METHODS = ("dense", "topk10", "adaptive")


def _compression(name: str):
    import horovod.torch as hvd

    from crossover import AdaptiveCompression, StaticCompression

    if name == "dense":
        return hvd.Compression.none
    if name.startswith("topk"):
        return StaticCompression("topk", cf=float(name[4:]))
    return AdaptiveCompression()


def train_side_by_side(seed: int, methods: tuple[str, ...] = METHODS) -> dict[str, float]:
    """Robust final test accuracy of each method after the same steps (runs inside a Horovod rank), and the
    highest CF the adaptive policy allowed itself (`max_cf`)."""
    import horovod.torch as hvd

    from benchmarks.digits import load_digits_split, make_model

    xtr, ytr, xte, yte = load_digits_split(seed)
    xtr, ytr = xtr[hvd.rank()::hvd.size()], ytr[hvd.rank()::hvd.size()]
    models, opts, comps = {}, {}, {}
    for i, name in enumerate(methods):
        torch.manual_seed(seed)
        model = make_model(HIDDEN)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        named = [(f"m{i}.{n}", p) for n, p in model.named_parameters()]  # collectives' names differ per method
        comps[name] = _compression(name)
        opts[name] = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                              named_parameters=named, compression=comps[name])
        models[name] = model
    per_epoch = len(xtr) // BATCH
    total = EPOCHS * per_epoch
    window_from = total - max(1, int(FINAL_WINDOW * total))
    gen = torch.Generator().manual_seed(seed + 1)
    evals: dict[str, list[float]] = {name: [] for name in methods}
    step = 0
    for _ in range(EPOCHS):
        order = torch.randperm(len(xtr), generator=gen)
        for b in range(per_epoch):
            idx = order[b * BATCH:(b + 1) * BATCH]
            for name in methods:
                opts[name].zero_grad()
                torch.nn.functional.cross_entropy(models[name](xtr[idx]), ytr[idx]).backward()
                opts[name].step()
            step += 1
            if step > window_from:
                with torch.no_grad():
                    for name in methods:
                        evals[name].append(float((models[name](xte).argmax(1) == yte).float().mean()))
    out = {name: statistics.fmean(v) for name, v in evals.items()}
    if "adaptive" in comps:
        out["max_cf"] = comps["adaptive"].stats()["policy/max_cf"]
    return out


def accuracy_job() -> dict[str, dict[str, float]]:
    return {str(seed): train_side_by_side(seed) for seed in SEEDS}


def test_momentum_sgd_compressed_runs_end_within_the_bound_of_dense():
    r0, r1 = run_function(accuracy_job, timeout=900)
    assert r0 == r1  # every rank ends with the same models
    seeds = [str(s) for s in SEEDS]
    dense = [r0[s]["dense"] for s in seeds]
    bound = max(max(dense) - min(dense), 0.005)
    assert all(r0[s]["max_cf"] == 10.0 for s in seeds), r0  # the optimizer's momentum 0.9 capped the CF
    for name in METHODS[1:]:
        gaps = [r0[s][name] - r0[s]["dense"] for s in seeds]
        assert statistics.median(gaps) >= -bound, (name, r0, f"median gap {statistics.median(gaps):+.4f}, "
                                                               f"bound {bound:.4f}")
