"""The main demo: a real 2-rank Horovod training on the digits task, with what it did printed.

`python benchmarks/demo.py` launches itself under `horovodrun -np 2 --gloo`; each rank trains on
its shard and rank 0 prints accuracy per epoch, bytes communicated and time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd

    sys.path.insert(0, str(REPO))
    from benchmarks.digits import train_digits

    hvd.init()
    res = train_digits(epochs=args.epochs)
    if hvd.rank() == 0:
        for h in res["history"]:
            print(f"epoch {h['epoch']:3d}  loss {h['loss']:.4f}  test accuracy {h['test_accuracy']:.3f}")
        print(json.dumps({k: v for k, v in res.items() if k != "history"}))
        print(f"\n{res['size']} Horovod ranks trained a {res['parameters']:,}-parameter MLP for "
              f"{res['steps']} steps in {res['seconds']:.1f} s: test accuracy {res['final_accuracy']:.3f}, "
              f"{res['dense_bytes'] / 1e6:.1f} MB of fp32 gradients allreduced per rank (dense).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="number of Horovod ranks (default 2)")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
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
