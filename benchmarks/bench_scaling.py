"""Bytes per worker and step time of every transport on 2, 4 and 8 emulated hosts, beside the cost model.

One command (root needed: network namespaces)::

    python -m benchmarks.bench_scaling                  # writes reports/scaling-measured.md (generated)
    python -m benchmarks.bench_scaling --hosts 2 8 --methods dense agreed --steps 30 --out /tmp/s.md

For each host count an ``EmulatedCluster`` (``benchmarks/netem``: one namespace per host, ``--rate`` up and down
per host) runs one Horovod job per method, one rank per host, training the digits MLP
(``benchmarks/scaling_worker.py``). Each rank reads its own interface counters around the measured steps:
bytes received per worker per step are what crossed its link, TCP/IP headers and Horovod's coordination
traffic included; the idle rate (the counters over ``--idle`` seconds before training) shows that
coordination traffic alone. The cost model's prediction is computed by each rank for the steps it measured
from what its codec did (payload only: ``crossover/compression/cost_model.py``).

Bytes are deterministic (up to the coordination traffic, which follows time); step times are not: the machine
this was written on has 2 cores shared with other work and 8 ranks share them, so every time here is noisy
and only comparable within one run. ``adaptive`` is ``AdaptiveCompression()`` with its defaults, measured over
its last ``--steps`` steps of ``--adaptive-steps`` (after its search).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["METHODS", "main", "markdown"]

METHODS = ("dense", "fp16", "allgather", "agreed", "scatter", "randomk", "adaptive")
REPO = Path(__file__).resolve().parent.parent


def run_job(cluster: Any, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One method on every host of ``cluster``: rank 0's RESULT line, parsed."""
    from .netem import launch_horovod

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
           "OMP_NUM_THREADS": "1"}
    pkg = __package__ or "benchmarks"
    res = launch_horovod(cluster, 1, [sys.executable, "-m", f"{pkg}.scaling_worker", json.dumps(cfg)], env=env,
                         timeout=timeout, check=True)
    for line in res[0].stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"rank 0 printed no RESULT line:\n{res[0].stdout}\n{res[0].stderr}")


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    ranks = result["ranks"]
    rx = [r["rx_per_step"] for r in ranks]
    step = statistics.median(r["step_s_median"] for r in ranks)
    idle = statistics.fmean(r["idle_rx_per_s"] for r in ranks)
    pred = statistics.fmean(r["predicted_per_step"] for r in ranks)
    return {"method": result["config"]["method"], "rate": result["config"]["rate"], "world": result["world"],
            "rx": statistics.fmean(rx),
            "rx_min": min(rx), "rx_max": max(rx), "predicted": pred, "step_s": step, "idle_rx_per_s": idle,
            "coordination": idle * step, "cfs": ranks[0]["cfs"], "transports": ranks[0]["transports"],
            "last": [ranks[0]["last_cf"], ranks[0]["last_transport"]]}


def _k(x: float) -> str:
    return f"{x / 1e3:.1f}"


def markdown(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    lines = ["# Bytes per worker on emulated hosts, measured (generated)", "",
             f"Command: `{info['command']}`", "",
             f"Digits MLP (width {info['width']:g}: {info['params']:,} parameters, {4 * info['params'] / 1e6:.1f} MB "
             f"fp32), one rank per emulated host, links of the rate shown, up and down per host: the static methods "
             f"at {info['rate']}, `AdaptiveCompression()` (and dense beside it) at {info['adaptive_rate']}, a link "
             "where compression pays on this machine (at 1 Gbit/s its 8 ranks share 2 cores and a step is "
             "compute-bound). "
             f"CF {info['cf']:g} for the static methods, {info['steps']} measured steps per job (after "
             f"{info['warmup']}; adaptive: the last {info['steps']} of {info['adaptive_steps']}, after its search). "
             "Bytes received per worker per step from each host's "
             "`eth0` counters (mean over hosts, [min-max]); model: the cost model for what the codec sent "
             "(payload only); coordination: each host's idle receive rate (Horovod's background loop alone) x "
             "the median step. Step times are noisy (2 shared cores for up to 8 ranks): compare them within a "
             "row group only, and re-run on a quiet machine for figures to quote.", "",
             "| hosts | link | method | received / worker / step (kB) | model (kB) | measured / model | "
             "coordination (kB) | median step (ms) | CF, transport at the end |",
             "|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = r["rx"] / r["predicted"] if r["predicted"] else float("nan")
        last = r["last"]
        lines.append(f"| {r['world']} | {r['rate']} | {r['method']} | {_k(r['rx'])} [{_k(r['rx_min'])}-"
                     f"{_k(r['rx_max'])}] | "
                     f"{_k(r['predicted'])} | {ratio:.2f} | {_k(r['coordination'])} | {1e3 * r['step_s']:.0f} | "
                     f"{last[0]:g}, {last[1] or '-'} |")
    lines += ["", "## Targets", ""]
    for what, figure, ok in check_targets(rows):
        lines.append(f"- {what}: {figure} ({'met' if ok else 'NOT met' if ok is not None else 'not measured'})")
    return "\n".join(lines) + "\n"


def check_targets(rows: list[dict[str, Any]]) -> list[tuple[str, str, bool | None]]:
    # dense beside the adaptive job (same link) when there is one; bytes do not depend on the link anyway
    ordered = sorted(rows, key=lambda r: r["rate"] != r.get("adaptive_rate"))
    by: dict[tuple[str, int], dict[str, Any]] = {}
    for r in ordered:
        by.setdefault((r["method"], r["world"]), r)
    out: list[tuple[str, str, bool | None]] = []
    a2, a8, d8 = by.get(("adaptive", 2)), by.get(("adaptive", 8)), by.get(("dense", 8))
    if a2 and a8:
        g = a8["rx"] / a2["rx"]
        out.append(("adaptive: bytes per worker at 8 hosts <= 2.0x those at 2", f"{g:.2f}x", g <= 2.0))
    if a8 and d8:
        g = a8["rx"] / d8["rx"]
        out.append(("adaptive: bytes per worker at 8 hosts <= 0.2x dense's at 8", f"{g:.3f}x", g <= 0.2))
    worst = max((abs(r["rx"] / r["predicted"] - 1.0), r["method"], r["world"]) for r in rows if r["predicted"])
    out.append(("cost model within 20 % of the measured bytes (worst row)",
                f"{100 * worst[0]:.0f} % ({worst[1]}, {worst[2]} hosts)", worst[0] <= 0.2))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_scaling", description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4, 8], help="host counts (default 2 4 8)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="methods (default: all): dense, fp16 (Horovod's), allgather, agreed and scatter (static "
                        "top-k by each transport), randomk, adaptive (AdaptiveCompression() defaults)")
    p.add_argument("--rate", default="1gbit",
                   help="link rate per host, each way, of the static methods (default 1gbit)")
    p.add_argument("--adaptive-rate", default="100mbit",
                   help="link rate of the adaptive job and a dense job beside it (default 100mbit: where compression "
                        "pays on a 2-core machine; 8 ranks at 1gbit are compute-bound)")
    p.add_argument("--cf", type=float, default=100.0, help="CF of the static methods (default 100)")
    p.add_argument("--width", type=float, default=2.0, help="MLP width (default 2: 1.1 M parameters)")
    p.add_argument("--steps", type=int, default=40, help="measured steps per job (default 40)")
    p.add_argument("--warmup", type=int, default=10, help="steps before the measured ones (default 10)")
    p.add_argument("--adaptive-steps", type=int, default=240,
                   help="steps of the adaptive job; the last --steps are measured (default 240)")
    p.add_argument("--batch-size", type=int, default=32, help="batch per rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05, momentum 0.9)")
    p.add_argument("--min-compress-numel", type=int, default=16384, help="smaller tensors go dense (default 16384)")
    p.add_argument("--idle", type=float, default=1.0, help="seconds of idle counting before training (default 1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job before it is killed (default 900)")
    p.add_argument("--out", default="reports/scaling-measured.md", help="markdown to write")
    p.add_argument("--json", default=None, help="also write every rank's figures here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    from . import netem
    from .models import build_model

    reason = netem.netem_unavailable_reason()
    if reason:
        p.error(f"the emulated network is unavailable here: {reason}")
    if min(a.hosts) < 2 or a.steps < 1 or a.adaptive_steps <= a.steps:
        p.error("--hosts must be >= 2, --steps >= 1 and --adaptive-steps > --steps")
    params = sum(q.numel() for q in build_model("mlp", "digits", 10, width=a.width).parameters())
    rows, raw = [], []
    begin = time.perf_counter()
    plan = [(a.rate, m) for m in a.methods if m != "adaptive"]
    if "adaptive" in a.methods:
        plan += [(a.adaptive_rate, "adaptive")] + ([(a.adaptive_rate, "dense")] if a.adaptive_rate != a.rate else [])
    for n in a.hosts:
        for rate in dict.fromkeys(r for r, _ in plan):
            with netem.EmulatedCluster(n, rate) as cluster:
                for _, method in (x for x in plan if x[0] == rate):
                    adaptive = method == "adaptive"
                    cfg = {"method": method, "rate": rate, "cf": a.cf, "width": a.width, "batch": a.batch_size,
                           "lr": a.lr, "min_numel": a.min_compress_numel, "idle_s": a.idle, "steps": a.steps,
                           "warmup": a.adaptive_steps - a.steps if adaptive else a.warmup}
                    result = run_job(cluster, cfg, a.timeout)
                    raw.append(result)
                    row = {**summarize(result), "adaptive_rate": a.adaptive_rate}
                    rows.append(row)
                    print(f"{n} hosts at {rate}, {method}: {_k(row['rx'])} kB received per worker per step (model "
                          f"{_k(row['predicted'])}), median step {1e3 * row['step_s']:.0f} ms "
                          f"({time.perf_counter() - begin:.0f}s)", flush=True)
    cmd = "python -m benchmarks.bench_scaling " + " ".join(argv if argv is not None else sys.argv[1:])
    info = {"command": cmd.strip(), "width": a.width, "params": params, "rate": a.rate,
            "adaptive_rate": a.adaptive_rate, "cf": a.cf,
            "steps": a.steps, "warmup": a.warmup, "adaptive_steps": a.adaptive_steps}
    text = markdown(rows, info)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps({"info": info, "rows": rows, "raw": raw}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
