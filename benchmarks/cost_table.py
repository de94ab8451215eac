"""The cost model's bytes and time per worker for every transport, from 2 to 1 024 workers: a table and a plot.

Pure arithmetic (``crossover/compression/cost_model.py``), no training and no network: the figures are
deterministic. One model of ``--params`` float32 gradient elements, compressed at ``--cf`` (dense and fp16 send
everything), each worker on a link of ``--rate`` with ``--alpha-us`` per collective round.

    python -m benchmarks.cost_table                     # writes reports/cost-model.md and reports/img/cost-model.png
    python -m benchmarks.cost_table --params 1.1e6 --cf 100 --rate 1gbit --out /tmp/x.md --png /tmp/x.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from crossover.compression import cost_model as cm
from crossover.compression.selectors import k_for

__all__ = ["LABELS", "WORLDS", "main", "rows"]

WORLDS = tuple(2 ** i for i in range(1, 11))  # 2 .. 1 024
LABELS = {
    cm.DENSE: "dense fp32 (ring allreduce)",
    cm.FP16: "fp16 (ring allreduce)",
    cm.ALLGATHER: "top-k, allgather of pairs",
    cm.ALLREDUCE: "random-k, shared seed",
    cm.AGREED: "agreed top-k (this project)",
    cm.SCATTER: "top-k, sparse reduce-scatter (this project)",
    cm.GTOPK: "gTop-k tree (modelled)",
    cm.OKTOPK: "Ok-Topk bound (modelled)",
    cm.POWERSGD: "PowerSGD, 2 allreduces (modelled)",
}
_RATES = {"mbit": 1e6, "gbit": 1e9}


def _rate(text: str) -> float:
    for unit, mult in _RATES.items():
        if text.lower().endswith(unit):
            try:
                return float(text[: -len(unit)]) * mult
            except ValueError:
                break
    raise argparse.ArgumentTypeError(f"a rate like 1gbit or 100mbit, got {text!r}")


def rows(params: int, cf: float, link: cm.Link, worlds: tuple[int, ...] = WORLDS) -> list[dict[str, object]]:
    """Per world size and transport: bytes per worker, rounds, seconds (one tensor of ``params`` elements)."""
    k = k_for(params, cf)
    out = []
    for w in worlds:
        for kind in cm.MODELLED:
            cost = cm.transport_cost(kind, params, params if kind in (cm.DENSE, cm.FP16) else k, w)
            out.append({"world": w, "kind": kind, "bytes": cost.bytes, "rounds": cost.rounds,
                        "time_s": cost.time_s(link)})
    return out


def _table(data: list[dict[str, object]], field: str, fmt: str, worlds: tuple[int, ...]) -> list[str]:
    head = "| transport | " + " | ".join(str(w) for w in worlds) + " |"
    lines = [head, "|---|" + "---:|" * len(worlds)]
    for kind in cm.MODELLED:
        vals = {d["world"]: d[field] for d in data if d["kind"] == kind}
        lines.append(f"| {LABELS[kind]} | " + " | ".join(fmt.format(vals[w]) for w in worlds) + " |")
    return lines


def markdown(params: int, cf: float, link: cm.Link, data: list[dict[str, object]], command: str,
             png: str | None) -> str:
    k = k_for(params, cf)
    growth = {kind: next(d["bytes"] for d in data if d["kind"] == kind and d["world"] == 8)
              / next(d["bytes"] for d in data if d["kind"] == kind and d["world"] == 2) for kind in cm.MODELLED}
    lines = [
        "# Cost model: bytes and time per worker, 2 to 1 024 workers (generated)", "",
        f"Command: `{command}`. Pure arithmetic from `crossover/compression/cost_model.py`; the model and what",
        "it leaves out are described in [docs/scaling.md](../docs/scaling.md).", "",
        f"One gradient of {params:,} float32 elements ({4 * params / 1e6:.1f} MB); compressed transports send "
        f"k = {k:,} elements (CF {cf:g}); link {link.rate_bps / 1e9:g} Gbit/s each way, "
        f"alpha = {1e6 * link.alpha_s:g} us per collective round.", "",
        "## Bytes received per worker per step (MB)", "",
        *_table([{**d, "bytes": float(d["bytes"]) / 1e6} for d in data], "bytes", "{:.3g}", WORLDS), "",
        "## Time per step on that link (ms: rounds x alpha + bytes / rate)", "",
        *_table([{**d, "time_s": 1e3 * float(d["time_s"])} for d in data], "time_s", "{:.3g}", WORLDS), "",
        "## Growth of bytes per worker from 2 to 8 workers", "",
        "| transport | 8 workers / 2 workers |", "|---|---:|",
        *[f"| {LABELS[kind]} | {growth[kind]:.2f}x |" for kind in cm.MODELLED], "",
    ]
    if png:
        lines += [f"![bytes and time per worker against workers]({png})", ""]
    return "\n".join(lines)


def plot(path: Path, data: list[dict[str, object]], link: cm.Link, params: int, cf: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind in cm.MODELLED:
        xs = [d["world"] for d in data if d["kind"] == kind]
        style = "--" if kind in (cm.GTOPK, cm.OKTOPK, cm.POWERSGD) else "-"
        width = 2.5 if kind in (cm.AGREED, cm.SCATTER) else 1.3
        axes[0].plot(xs, [d["bytes"] / 1e6 for d in data if d["kind"] == kind], style, lw=width, marker="o",
                     ms=3, label=LABELS[kind])
        axes[1].plot(xs, [1e3 * d["time_s"] for d in data if d["kind"] == kind], style, lw=width, marker="o",
                     ms=3, label=LABELS[kind])
    for ax, what in zip(axes, ("MB received per worker per step", "ms per step (alpha-beta)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{params / 1e6:.1f} M float32 elements, CF {cf:g}, {link.rate_bps / 1e9:g} Gbit/s, "
                 f"alpha {1e6 * link.alpha_s:g} us")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cost_table", description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=25.6e6,
                   help="gradient elements of the model (default 25.6e6, ResNet-50's parameters)")
    p.add_argument("--cf", type=float, default=100.0, help="compression factor of the sparse transports (default 100)")
    p.add_argument("--rate", type=_rate, default=1e9, help="link rate each way, e.g. 1gbit (default 1gbit)")
    p.add_argument("--alpha-us", type=float, default=50.0, help="latency per collective round in us (default 50)")
    p.add_argument("--out", default="reports/cost-model.md", help="markdown to write (default reports/cost-model.md)")
    p.add_argument("--png", default="reports/img/cost-model.png", help="plot to write ('' for none)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not a.params >= 1 or not a.cf >= 1:
        build_parser().error("--params and --cf must be >= 1")
    link = cm.Link(alpha_s=a.alpha_us * 1e-6, rate_bps=a.rate)
    params = int(a.params)
    data = rows(params, a.cf, link)
    out = Path(a.out)
    png_rel = None
    if a.png:
        png = Path(a.png)
        plot(png, data, link, params, a.cf)
        try:
            png_rel = str(png.resolve().relative_to(out.resolve().parent))
        except ValueError:
            png_rel = str(png)
    command = "python -m benchmarks.cost_table " + " ".join(argv if argv is not None else sys.argv[1:])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(params, a.cf, link, data, command.strip(), png_rel))
    print(f"wrote {out}" + (f" and {a.png}" if a.png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
