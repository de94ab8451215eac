"""The main demo: dense, Horovod fp16, static top-k 10x and `AdaptiveCompression()` (its defaults) train the same model.

`make demo` (`python benchmarks/demo.py`) trains scikit-learn's digits with an MLP and SGD with momentum 0.9 (the
commonest recipe) on 2 Horovod ranks, four times, each its own job: dense fp32 (`hvd.Compression.none`), Horovod's
own `hvd.Compression.fp16`, `StaticCompression("topk", cf=10)` (the highest top-k that keeps accuracy under
momentum) and `AdaptiveCompression()` exactly as the README writes it. When root is available the two ranks run on
two emulated hosts joined by a 1 Gbit/s link (benchmarks/netem: network namespaces + tc), where
communication costs what it costs on a real cluster; otherwise they share the loopback, and the demo
says so (loopback is so fast that compression has little to win). It prints the time each run took to
reach the dense run's final accuracy (within 1 point; evaluated every few steps), the bytes it sent
and its final accuracy; while each run trains, a progress bar (a line every 10 s when not on a terminal).
Every run is a `crossover-bench` run (benchmarks/cli.py); `--out` keeps them.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/demo.py` from a checkout
    sys.path.insert(0, str(REPO))
if not __package__:  # run as a file: its relative imports resolve in the package it belongs to
    __package__ = Path(__file__).resolve().parent.name

METHODS = (("none", "dense fp32"), ("fp16", "Horovod fp16"), ("topk:10", "top-k 10x"),
           ("gravac", "AdaptiveCompression()"))
LR, MOMENTUM = "0.02", "0.9"  # SGD with momentum: 0.02 / (1 - 0.9) is the plain-SGD step 0.2 that trains this MLP
log = logging.getLogger("crossover.demo")
BUSY = 0.5  # load average per core above which the demo says its speed-ups are those of a shared machine


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15, help="training epochs of each run (default 15)")
    p.add_argument("--width", type=float, default=4.0,
                   help="MLP width multiplier (default 4: 64-2048-2048-10, 4.4 M parameters)")
    p.add_argument("--bandwidth", default="1gbit",
                   help="emulated link rate between the 2 hosts (default 1gbit; needs root, else loopback)")
    p.add_argument("--loopback", action="store_true", help="do not emulate a link: 2 ranks on the loopback")
    p.add_argument("--eval-every", type=int, default=5, help="evaluate every N steps (default 5)")
    p.add_argument("--out", default=None, help="keep the runs' outputs here (default: a temporary folder)")
    return p


def _run(method: str, label: str, args: argparse.Namespace, out: Path, bandwidth: str | None) -> Path:
    """One crossover-bench run, its output kept for a failure; its progress shown meanwhile (benchmarks/progress.py:
    a bar on a terminal, a line every few seconds otherwise)."""
    from .progress import ProgressDisplay

    argv = [sys.executable, "-m", f"{__package__}.cli", "--model", "mlp", "--dataset", "digits", "--width",
            str(args.width), "--epochs", str(args.epochs), "--lr", LR, "--momentum", MOMENTUM, "--eval-every",
            str(args.eval_every), "--hosts", "2", "--compression", method, "--out", str(out / method),
            "--no-plots"]
    if bandwidth:
        argv += ["--bandwidth", bandwidth]
    log.info("running %s", " ".join(a if a != sys.executable else "python" for a in argv))
    progress = out / method / "progress"
    progress.unlink(missing_ok=True)  # a kept --out folder: not the previous run's
    with ProgressDisplay({label: progress}):
        proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout)
        raise SystemExit(f"demo: the {method} run failed (exit {proc.returncode}); its output is above")
    return out / method / "results.json"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    from . import report
    from .netem import netem_unavailable_reason

    bandwidth = None if args.loopback else args.bandwidth
    if bandwidth:
        reason = netem_unavailable_reason()
        if reason:
            log.warning("no emulated network (%s): the 2 ranks share the loopback, where communication is nearly "
                        "free and compression has little to win; run as root to see a 1 Gbit/s link", reason)
            bandwidth = None
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="crossover-demo-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        paths = [_run(m, name, args, out, bandwidth) for m, name in METHODS]
        res = report.compare(paths, out / "compare")
    rows = {r["method"]: r for r in res["rows"]}
    dense = rows["none"]
    link = f"2 emulated hosts, {bandwidth} link" if bandwidth else "2 ranks on the loopback (no emulated link)"
    print(f"\ndigits MLP (width {args.width:g}), SGD momentum {MOMENTUM}, {link}, {args.epochs} epochs each; "
          f"target: dense's final accuracy "
          f"{dense['dense_final']:.3f} less 1 point = {dense['dense_target']:.3f}\n")
    print(f"{'run':<24}{'time to target':>15}{'vs dense':>10}{'step ms':>9}{'less bytes':>11}{'final acc':>10}")
    for m, name in METHODS:
        r = rows[m]
        t = r["time_to_dense_final_s"]
        less = r["compression_ratio"] or 1.0
        print(f"{name:<24}{'not reached' if t is None else f'{t:.1f} s':>15}"
              f"{'-' if not r['tta_speedup_vs_dense'] else format(r['tta_speedup_vs_dense'], '.2f') + 'x':>10}"
              f"{1e3 * (r['median_step_s'] or 0):>9.1f}{less:>10.1f}x{r['final_metric']:>10.3f}")
    g = rows["gravac"]
    print(f"\nAdaptiveCompression() chose {g.get('compressor') or 'its codec'} and ended at compression factor "
          f"{g['cf_final']:g}, sending "
          f"{g['compression_ratio'] or 1:.1f}x fewer bytes than dense, final accuracy "
          f"{100 * (g['final_minus_dense'] or 0):+.1f} points against dense.")
    cores = os.cpu_count() or 1
    if load_before > BUSY * cores:  # other work shares the cores the ranks (and the emulated link) compute on
        print(f"\nThe machine was busy before the demo began (load average {load_before:.1f} on {cores} cores): "
              "every step computes slower, so communication, which compression saves, is a smaller share of it "
              "and the speed-ups above are smaller than on a quiet machine. Run it again when the machine is idle "
              "to see the link's effect alone.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
