"""What each compression choice keeps of the model: methods trained side by side in one real Horovod job.

Every method (dense, static top-k at a CF, ``AdaptiveCompression()`` with its defaults) trains its own copy of the
digits MLP (64-1024-1024-10) in the same 2 Horovod processes, from the same start on the same batches, step by
step in turn, with the optimizer the command names; the test accuracy is taken at the end of every epoch and, as
the robust "final", averaged over the last 10 % of the steps (360 test images: one image is 0.28 points).
This is how docs/accuracy.md chose the momentum cap of the defaults; tests/hvd/test_accuracy_hvd.py runs one case.

    python -m benchmarks.accuracy_curves --methods dense,topk:10,topk:100,gravac --seeds 0 1 2 --momentum 0.9
    python -m benchmarks.accuracy_curves --optimizer adam --lr 0.001 --methods dense,topk:100

Methods: ``dense``, ``topk:CF`` (StaticCompression("topk", cf=CF)), ``gravac`` (AdaptiveCompression()), and
``topk:A>B@F`` (a schedule, for studying rules: top-k at CF A for the first fraction F of the steps, then at CF B;
every rank switches on the same step).
Loopback only (no emulated link): accuracy does not depend on the link, but the defaults' choice does, so a
``gravac`` run here shows what they keep at the CF they chose on this machine (printed as ``max/last CF``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

FINAL_WINDOW = 0.10  # the robust final: the last 10 % of the steps, as benchmarks/report.py's
BATCH = 32
HIDDEN = 1024


def _compression(name: str, min_compress_numel: int) -> Any:
    import horovod.torch as hvd

    from crossover import AdaptiveCompression, StaticCompression

    if name == "dense":
        return hvd.Compression.none
    if name.startswith("topk:"):
        first = name[5:].split(">")[0]
        return StaticCompression("topk", cf=float(first), min_compress_numel=min_compress_numel)
    if name == "gravac":
        return AdaptiveCompression(min_compress_numel=min_compress_numel)
    raise ValueError(f"unknown method {name!r}: dense, topk:CF or gravac")


def _switch(name: str, total: int) -> tuple[int, float] | None:
    """``topk:A>B@F``: (the step after which CF B is sent, B); None for any other method."""
    if not name.startswith("topk:") or ">" not in name:
        return None
    _, _, rest = name.partition(">")
    cf, _, frac = rest.partition("@")
    if not frac or not 0.0 < float(frac) < 1.0 or float(cf) < 1.0:
        raise ValueError(f"method {name!r}: expected topk:A>B@F with CFs >= 1 and 0 < F < 1")
    return int(float(frac) * total), float(cf)


def _optimizer(params: Any, optimizer: str, lr: float, momentum: float) -> torch.optim.Optimizer:
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def train_side_by_side(seed: int, methods: list[str], *, epochs: int = 20, lr: float = 0.05, momentum: float = 0.9,
                       optimizer: str = "sgd", min_compress_numel: int = 16384) -> dict[str, Any]:
    """Inside a Horovod rank: per method, the accuracy after every epoch (`curve`), the robust `final`, and for
    ``gravac`` the highest and last CF it allowed and sent."""
    import horovod.torch as hvd

    try:
        from .digits import load_digits_split, make_model
    except ImportError:  # loaded by its path in a Horovod worker (tests/hvd_worker.py): no package
        from benchmarks.digits import load_digits_split, make_model

    xtr, ytr, xte, yte = load_digits_split(seed)
    xtr, ytr = xtr[hvd.rank()::hvd.size()], ytr[hvd.rank()::hvd.size()]
    models, opts, comps = {}, {}, {}
    for i, name in enumerate(methods):
        torch.manual_seed(seed)
        model = make_model(HIDDEN)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        comps[name] = _compression(name, min_compress_numel)
        named = [(f"m{i}.{n}", p) for n, p in model.named_parameters()]  # collectives' names differ per method
        opts[name] = hvd.DistributedOptimizer(_optimizer(model.parameters(), optimizer, lr, momentum),
                                              named_parameters=named, compression=comps[name])
        models[name] = model
    per_epoch = len(xtr) // BATCH
    total = epochs * per_epoch
    window_from = total - max(1, int(FINAL_WINDOW * total))
    gen = torch.Generator().manual_seed(seed + 1)
    curves: dict[str, list[float]] = {name: [] for name in methods}
    window: dict[str, list[float]] = {name: [] for name in methods}

    def accuracy(model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float((model(xte).argmax(1) == yte).float().mean())

    from crossover.adaptive.static import StaticPolicy

    switches = {name: sw for name in methods if (sw := _switch(name, total)) is not None}
    step = 0
    sent: list[float] = []  # the CF the defaults sent on each step
    for _ in range(epochs):
        order = torch.randperm(len(xtr), generator=gen)
        for b in range(per_epoch):
            idx = order[b * BATCH:(b + 1) * BATCH]
            for name in methods:
                opts[name].zero_grad()
                torch.nn.functional.cross_entropy(models[name](xtr[idx]), ytr[idx]).backward()
                opts[name].step()
                if name == "gravac":
                    sent.append(float(comps[name].driver.current.sent_cf))
            step += 1
            for name, (at, cf) in switches.items():
                if step == at:  # the same step on every rank: the next plan sends the new CF
                    comps[name].driver.policy = StaticPolicy(cf=cf)
            if step > window_from:
                for name in methods:
                    window[name].append(accuracy(models[name]))
        for name in methods:
            curves[name].append(accuracy(models[name]))
    out: dict[str, Any] = {name: {"curve": curves[name], "final": statistics.fmean(window[name])} for name in methods}
    if "gravac" in comps:
        st = comps["gravac"].stats()
        out["gravac"]["max_cf"] = st.get("max_cf")
        out["gravac"]["last_cf"] = st.get("compression_factor")
        # the cap holds from the first step
        cap = st.get("max_cf", math.inf)
        out["gravac"]["steps_above_cap"] = [i for i, cf in enumerate(sent) if cf > cap]
    return out


def run_seeds(seeds: list[int], methods: list[str], settings: dict[str, Any]) -> dict[str, Any]:
    """Inside a Horovod rank: every seed."""
    return {str(seed): train_side_by_side(seed, methods, **settings) for seed in seeds}


def table(results: dict[str, Any], methods: list[str]) -> str:
    """Markdown: each method's final per seed and its median gap to dense (points)."""
    seeds = sorted(results, key=int)
    lines = ["| method | " + " | ".join(f"seed {s}" for s in seeds) + " | median gap to dense |",
             "|---|" + "---:|" * (len(seeds) + 1)]
    for m in methods:
        finals = [results[s][m]["final"] for s in seeds]
        cells = [f"{v:.4f}" for v in finals]
        gap = ""
        if "dense" in methods and m != "dense":
            gaps = [results[s][m]["final"] - results[s]["dense"]["final"] for s in seeds]
            gap = f"{100 * statistics.median(gaps):+.2f}"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {gap} |")
    dense = [results[s]["dense"]["final"] for s in seeds] if "dense" in methods else []
    if dense:
        lines.append("")
        lines.append(f"dense's seed-to-seed spread: {100 * (max(dense) - min(dense)):.2f} points")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accuracy_curves", description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="dense,topk:10,topk:100,gravac", help="comma-separated (default %(default)s)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--epochs", type=int, default=20, help="epochs (default 20)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="default sgd")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--min-compress-numel", type=int, default=16384, help="smaller tensors go dense (default 16384)")
    p.add_argument("--json", default=None, help="write every curve here")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if len(set(methods)) != len(methods) or not methods:
        build_parser().error("--methods must name each method once")
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tests"))
    from hvd_harness import run_function  # the project's real 2-rank launcher (horovodrun --gloo)

    settings = {"epochs": a.epochs, "lr": a.lr, "momentum": a.momentum, "optimizer": a.optimizer,
                "min_compress_numel": a.min_compress_numel}
    timeout = 600 + 120 * len(a.seeds) * a.epochs
    results = run_function(run_seeds, args=(a.seeds, methods, settings), timeout=timeout)[0]
    print(table(results, methods))
    for s in sorted(results, key=int):
        if "gravac" in results[s]:
            g = results[s]["gravac"]
            print(f"seed {s}: gravac max CF {g['max_cf']}, last CF {g['last_cf']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": settings, "methods": methods, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
