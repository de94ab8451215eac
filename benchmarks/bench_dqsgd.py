"""DQ-SGD on the digits task: accuracy, bytes and the bits it chose per step (PNG), vs dense and QSGD.

    python -m benchmarks.bench_dqsgd --epochs 20 --out results/dqsgd

Runs one 2-rank Horovod job (horovodrun --gloo on localhost); each method trains the same model
from the same seed. Writes OUT.json and OUT.png (bits against step) and prints a table.
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
    from crossover import AdaptiveCompression, QSGDCompression

    from .digits import train_digits

    hvd.init()
    dense = train_digits(None, epochs=args.epochs)
    total = dense["steps"]
    runs = {"dense": dense}
    bits: dict[str, list[int]] = {}
    for label, make in (("dqsgd", lambda: AdaptiveCompression(policy="dqsgd", total_steps=total,
                                                              min_compress_numel=4096)),
                        ("qsgd-4bit", lambda: QSGDCompression(4, min_compress_numel=4096)),
                        ("qsgd-8bit", lambda: QSGDCompression(8, min_compress_numel=4096))):
        trace: list[int] = []
        runs[label] = train_digits(make(), epochs=args.epochs,
                                   on_step=lambda step, comp, trace=trace: trace.append(comp.stats()["bits"]))
        bits[label] = trace
    if hvd.rank() != 0:
        return
    result = {"epochs": args.epochs, "steps": total, "bits": bits,
              "runs": {k: {x: v[x] for x in ("final_accuracy", "last3_accuracy", "bytes_sent", "dense_bytes",
                                            "seconds")} for k, v in runs.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, trace in bits.items():
        ax.plot(range(1, len(trace) + 1), trace, label=label, drawstyle="steps-post")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per element")
    ax.set_title("Quantization bits chosen per step (digits, 2 ranks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"{'method':<11}{'final acc':>10}{'last-3 acc':>11}{'less bytes':>11}{'seconds':>9}")
    for label, r in result["runs"].items():
        print(f"{label:<11}{r['final_accuracy']:>10.3f}{r['last3_accuracy']:>11.3f}"
              f"{r['dense_bytes'] / r['bytes_sent']:>10.1f}x{r['seconds']:>9.1f}")
    dq = bits["dqsgd"]
    print(f"DQ-SGD bits: first {dq[0]}, min {min(dq)}, max {max(dq)}, last {dq[-1]}; "
          f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", default="results/dqsgd", help="output path prefix (.json and .png are added)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    hr = Path(sys.executable).with_name("horovodrun")
    cmd = [str(hr), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", f"{__package__}.bench_dqsgd",
           "--worker", "--epochs", str(args.epochs), "--out", str(Path(args.out).resolve())]
    print("command:", " ".join(sys.argv), flush=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    sys.exit(subprocess.call(cmd, env=env, cwd=REPO))


if __name__ == "__main__":
    main()
