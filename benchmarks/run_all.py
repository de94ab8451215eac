"""`make bench`: run the project's benchmarks one after another and keep their outputs in results/.

Each benchmark prints its own side-by-side ratios; this runner only sequences them and records the
exact commands. (The CIFAR/ImageNet/LSTM suite and the BENCHMARKS.md generator are not built yet.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def commands(out: Path, quick: bool) -> list[list[str]]:
    py = sys.executable
    cmds = [
        ["taskset", "-c", "0", py, "benchmarks/bench_compressors.py", "--no-fallback", "--json",
         str(out / "compressors.json")] + (["--numel", "2000000"] if quick else []),
        ["taskset", "-c", "0", py, "benchmarks/bench_quantize.py", "--json", str(out / "quantize.json")]
        + (["--numel", "2000000"] if quick else []),
        [py, "-m", "benchmarks.bench_dqsgd", "--epochs", "5" if quick else "20", "--out", str(out / "dqsgd")],
    ]
    step = [py, "-m", "benchmarks.bench_step", "--methods", "dense,fp16,topk:100,adaptive,adaptive:0.5,adaptive-off",
            "--params", "2000000" if quick else "12000000", "--steps", "5" if quick else "20",
            "--json", str(out / "step.json")]
    if os.geteuid() == 0:  # the emulated network needs root
        step += ["--rate", "1gbit"]
    cmds.append(step)
    return cmds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results", help="output folder (default results/)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for cmd in commands(out, args.quick):
        print("\n$", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
        failed += rc != 0
    print(f"\n{failed} benchmark(s) failed; outputs in {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
