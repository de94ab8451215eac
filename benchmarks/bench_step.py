"""Training-step time of compression methods side by side, in one Horovod job.

    python -m benchmarks.bench_step --methods dense,fp16,topk:100,adaptive --rate 1gbit --np 2

With --rate the ranks run on emulated hosts joined by links of that rate (benchmarks.netem, needs
root); without it they run on plain loopback via horovodrun. Every method trains the same model
(an MLP of --params parameters, synthetic data) in the same processes, interleaved in blocks of
--block steps so drift affects all alike; the table gives median step times and ratios to dense.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_compression(method: str, window: int):
    """Compression object for a method name: dense, fp16, hvd-fp16, topk:CF, randomk:CF, dgc:CF,
    redsync:CF, adaptive (defaults), adaptive:EPSILON, adaptive-off."""
    import horovod.torch as hvd

    from crossover import AdaptiveCompression, FP16Compression, StaticCompression

    if method == "dense":
        return hvd.Compression.none
    if method == "hvd-fp16":
        return hvd.Compression.fp16
    if method == "fp16":
        return FP16Compression()
    if method == "adaptive":  # exactly as a user writes it: the defaults
        return AdaptiveCompression()
    if method.startswith("adaptive:"):  # adaptive:EPSILON overrides epsilon (and the window), for the record
        return AdaptiveCompression(window=window, epsilon=float(method.partition(":")[2]))
    if method == "adaptive-off":
        return AdaptiveCompression(enabled=False)
    name, _, cf = method.partition(":")
    return StaticCompression(name, cf=float(cf or 100))


def _settled_cf(comp) -> float | None:
    """The CF an adaptive policy has settled on, None while it searches (or for a fixed method)."""
    from crossover.adaptive.gravac import GravacPolicy

    policy = getattr(comp, "policy", None)
    if not isinstance(policy, GravacPolicy) or not policy.settled:
        return None
    return float(policy.send_cf)


def build_model(params: int):
    """An MLP with about `params` parameters: 1024 -> h -> h -> 10."""
    import torch

    h = int((-(1024 + 10) + ((1024 + 10) ** 2 + 4 * params) ** 0.5) / 2)
    return torch.nn.Sequential(torch.nn.Linear(1024, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                               torch.nn.ReLU(), torch.nn.Linear(h, 10))


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    methods = args.methods.split(",")
    runs = []
    for i, m in enumerate(methods):
        torch.manual_seed(0)
        model = build_model(args.params)
        comp = make_compression(m, args.window)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=[(f"{i}.{n}", p) for n, p in model.named_parameters()],
                                       compression=comp)
        runs.append((m, model, opt, comp))
    x = torch.randn(args.batch, 1024)
    y = torch.randint(0, 10, (args.batch,))
    times: dict[str, list[float]] = {m: [] for m in methods}
    settled: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}  # (step s, CF) of settled steps
    total = args.warmup + args.steps
    for first in range(0, total, args.block):
        # Interleave methods in blocks so drift hits all of them alike. Blocks, not single steps: an adaptive
        # policy times the wall time between its own steps, which must be its own step, not a round of all.
        for m, model, opt, comp in runs:
            for step in range(first, min(first + args.block, total)):
                before = _settled_cf(comp)
                t0 = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if step >= args.warmup:
                    times[m].append(time.perf_counter() - t0)
                    if before is not None and _settled_cf(comp) == before:
                        settled[m].append((times[m][-1], before))
    if hvd.rank() == 0:
        nparams = sum(p.numel() for p in runs[0][1].parameters())
        dense = statistics.median(times[methods[0]])
        rows = []
        for m, _, _, comp in runs:
            med = statistics.median(times[m])
            st = comp.stats() if hasattr(comp, "stats") else {}
            ratio = (st["bytes_dense"] / st["bytes_sent"]) if st.get("bytes_sent") else None  # None: not counted
            if m == "dense":
                ratio = 1.0
            row = {"method": m, "median_step_s": med, "vs_first": med / dense, "bytes_ratio": ratio,
                   "cf": st.get("compression_factor")}
            if settled[m]:  # an adaptive policy: the steps it ran settled, apart from its searches
                cfs = [cf for _, cf in settled[m]]
                row.update(settled_steps=len(cfs), settled_cf=statistics.mode(cfs),
                           settled_median_step_s=statistics.median(t for t, _ in settled[m]))
            rows.append(row)
        print(json.dumps({"params": nparams, "size": hvd.size(), "rows": rows}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--methods", default="dense,fp16,topk:100,adaptive",
                        help="comma-separated: dense, fp16, hvd-fp16, topk:CF, randomk:CF, dgc:CF, "
                             "redsync:CF, adaptive, adaptive:EPSILON, adaptive-off (first = baseline; no repeats)")
    parser.add_argument("--params", type=int, default=12_000_000, help="model parameters (default 12 M)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--block", type=int, default=10,
                        help="steps each method runs before the next method's turn (default 10)")
    parser.add_argument("--window", type=int, default=5, help="GraVAC window for 'adaptive' (short runs)")
    parser.add_argument("--np", type=int, default=2, help="ranks (one per emulated host with --rate)")
    parser.add_argument("--rate", default=None, help="emulated link rate, e.g. 1gbit (needs root)")
    parser.add_argument("--delay", default=None, help="emulated one-way delay, e.g. 1ms")
    parser.add_argument("--json", default=None, help="write the result JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", f"{__package__}.bench_step", "--worker", "--methods", args.methods,
           "--params", str(args.params), "--batch", str(args.batch), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--window", str(args.window), "--block", str(args.block)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    print("command:", " ".join(sys.argv), flush=True)
    if args.rate:
        from .netem import EmulatedCluster, launch_horovod

        with EmulatedCluster(hosts=args.np, rate=args.rate, delay=args.delay) as cluster:
            procs = launch_horovod(cluster, 1, cmd, env=env, timeout=3600)
        out = "\n".join(p.stdout for p in procs)
    else:
        hr = Path(sys.executable).with_name("horovodrun")
        out = subprocess.run([str(hr), "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo", *cmd],
                             env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if '"rows"' in ln)
    result = json.loads(line[line.index("{"):])
    result.update(rate=args.rate or "loopback (unshaped)", delay=args.delay, command=" ".join(sys.argv))
    print(f"\n{result['size']} ranks, {result['params'] / 1e6:.1f} M parameters, link {result['rate']}")
    print(f"{'method':<14}{'step ms':>10}{'vs ' + result['rows'][0]['method']:>12}{'bytes dense/sent':>18}"
          f"{'settled: steps, CF, step ms':>30}")
    for r in result["rows"]:
        ratio = "n/a" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.1f}"
        tail = (f"{r['settled_steps']:>10}{r['settled_cf']:>8g}{1000 * r['settled_median_step_s']:>12.1f}"
                if "settled_steps" in r else "")
        print(f"{r['method']:<14}{1000 * r['median_step_s']:>10.1f}{r['vs_first']:>12.3f}{ratio:>18}{tail}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
