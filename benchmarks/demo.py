"""The main demo: 2 Horovod ranks train the digits task dense and with AdaptiveCompression (GraVAC).

`python benchmarks/demo.py` launches itself under `horovodrun -np 2 --gloo`; both runs use the same
seed, data and epochs, and rank 0 prints accuracy per epoch and the bytes each run sent.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd

    sys.path.insert(0, str(REPO))
    from benchmarks.digits import demo_compression, train_digits

    hvd.init()
    dense = train_digits(None, epochs=args.epochs)
    adaptive = train_digits(demo_compression(), epochs=args.epochs)
    if hvd.rank() != 0:
        return
    print(f"{'epoch':>5}  {'dense acc':>9}  {'adaptive acc':>12}")
    for d, a in zip(dense["history"], adaptive["history"]):
        print(f"{d['epoch']:>5}  {d['test_accuracy']:>9.3f}  {a['test_accuracy']:>12.3f}")
    print(f"\n{'run':<10}{'final acc':>10}{'last-3 acc':>11}{'MB sent':>10}{'less bytes':>11}{'seconds':>9}")
    for label, r in (("dense", dense), ("adaptive", adaptive)):
        print(f"{label:<10}{r['final_accuracy']:>10.3f}{r['last3_accuracy']:>11.3f}{r['bytes_sent'] / 1e6:>10.2f}"
              f"{r['dense_bytes'] / r['bytes_sent']:>10.1f}x{r['seconds']:>9.1f}")
    c = adaptive["compression"]
    print(f"\n{dense['size']} Horovod ranks, {dense['parameters']:,}-parameter MLP, {dense['steps']} steps each. "
          f"AdaptiveCompression ended at compression factor {c['compression_factor']:g} "
          f"(gain {c['gain'] if c['gain'] is None else round(c['gain'], 3)}), sending "
          f"{dense['dense_bytes'] / adaptive['bytes_sent']:.1f}x fewer bytes than dense; accuracy "
          f"{100 * (adaptive['last3_accuracy'] - dense['last3_accuracy']):+.1f} points (mean of last 3 epochs).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="number of Horovod ranks (default 2)")
    parser.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    horovodrun = Path(sys.executable).with_name("horovodrun")
    cmd = [str(horovodrun) if horovodrun.exists() else "horovodrun", "-np", str(args.np),
           "-H", f"localhost:{args.np}", "--gloo", sys.executable, __file__, "--worker",
           "--epochs", str(args.epochs)]
    print("running:", " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
