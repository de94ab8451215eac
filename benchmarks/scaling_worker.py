"""One rank of ``benchmarks/bench_scaling.py``: train the digits MLP with one method, count this host's bytes.

Run by ``launch_horovod`` inside an emulated host (its own network namespace, interface ``eth0``), one rank per
host. It measures, on its own interface counters (``/sys/class/net/eth0/statistics``), the bytes received and
sent while idle (Horovod's coordination traffic alone) and over the measured steps, times every step, and
computes the cost model's prediction for the steps it measured from what the codec did on each (CF, transport,
the driver's per-transport bytes). Rank 0 prints one JSON line (``RESULT {...}``) with every rank's figures.

    python -m benchmarks.scaling_worker '{"method": "agreed", "cf": 100, "steps": 60, ...}'
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from crossover.compression import cost_model as cm
from crossover.compression.lowrank_codec import matrix_shape, rank_for
from crossover.compression.selectors import k_for
from crossover.compression.wire import SparseStatsLayout

__all__ = ["main"]

IFACE = "eth0"


def _counters() -> tuple[int, int]:
    base = Path("/sys/class/net") / IFACE / "statistics"
    return int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())


def _compression(method: str, cf: float, min_numel: int) -> Any:
    import horovod.torch as hvd

    from crossover import AdaptiveCompression, StaticCompression

    if method == "dense":
        return hvd.Compression.none
    if method == "fp16":
        return hvd.Compression.fp16
    if method == "allgather":
        return StaticCompression("topk", cf=cf, transport="allgather", min_compress_numel=min_numel)
    if method == "agreed":
        return StaticCompression("topk", cf=cf, transport="agreed", min_compress_numel=min_numel)
    if method == "scatter":
        return StaticCompression("topk", cf=cf, transport="scatter", min_compress_numel=min_numel)
    if method == "randomk":
        return StaticCompression("randomk", cf=cf, min_compress_numel=min_numel)
    if method == "adaptive":
        return AdaptiveCompression(min_compress_numel=min_numel)
    raise ValueError(f"unknown method {method!r}")


def _predicted(method: str, comp: Any, params: list[torch.nn.Parameter], world: int, min_numel: int) -> float:
    """The cost model's bytes per worker for the step just taken (Horovod fuses small tensors: same bytes)."""
    small = sum(p.numel() for p in params if p.numel() < min_numel)
    large = [p.numel() for p in params if p.numel() >= min_numel]
    if method in ("dense", "fp16"):
        width = 2 if method == "fp16" else 4
        return cm.ring_allreduce(width * (small + sum(large)), world).bytes
    out = cm.ring_allreduce(4.0 * small, world).bytes
    rec = comp.driver.current
    if rec.sent_cf <= 1.0:  # dense step of the adaptive policy: every tensor plus its statistics when measured
        nstats = SparseStatsLayout(len(rec.probes)).length if rec.measure or rec.probes else 0
        return out + sum(cm.ring_allreduce(4.0 * (n + nstats), world).bytes for n in large)
    if comp.driver.compressor == "powersgd":  # low rank (the defaults under momentum): P and Q of each matrix
        nstats = SparseStatsLayout(len(rec.probes)).length
        shared = comp.codec.totals(rec.step)  # the matrices the one rank of the step is sized on
        for n, shape in ((p.numel(), matrix_shape(p.shape)) for p in params if p.numel() >= min_numel):
            r = rank_for(*shape, rec.sent_cf, shared) if shape else 0
            out += cm.ring_allreduce(4.0 * ((r * sum(shape) if r else n) + nstats), world).bytes
        return out
    if method == "randomk":
        nstats = SparseStatsLayout(len(rec.probes)).length
        return out + sum(cm.transport_cost(cm.ALLREDUCE, n, k_for(n, rec.sent_cf), world, nstats).bytes
                         for n in large)
    return out + rec.transport_bytes[rec.transport or cm.ALLGATHER]


def main(argv: list[str] | None = None) -> int:
    cfg = json.loads((argv if argv is not None else sys.argv[1:])[0])
    import horovod.torch as hvd

    from .datasets import load_dataset
    from .models import build_model

    hvd.init()
    torch.set_num_threads(1)
    rank, world = hvd.rank(), hvd.size()
    torch.manual_seed(cfg.get("seed", 0))
    data = load_dataset("digits", None, seed=cfg.get("seed", 0))
    model = build_model("mlp", "digits", data.num_classes, width=cfg["width"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    params = list(model.parameters())
    comp = _compression(cfg["method"], cfg["cf"], cfg["min_numel"])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=cfg["lr"], momentum=0.9),
                                   named_parameters=list(model.named_parameters()), compression=comp)
    hvd.allreduce(torch.zeros(1), name="scaling.ready")
    rx0, tx0 = _counters()
    time.sleep(cfg["idle_s"])  # Horovod's background loop alone: its coordination traffic per second
    rx1, tx1 = _counters()
    idle_rx = (rx1 - rx0) / cfg["idle_s"]

    def batches():
        epoch = 0
        while True:
            yield from data.train_batches(epoch, rank, world, cfg["batch"], cfg.get("seed", 0))
            epoch += 1

    it = batches()
    total = cfg["warmup"] + cfg["steps"]
    times, predicted, transports, cfs = [], [], [], []
    start_rx = start_tx = None
    t_start = 0.0
    for step in range(total):
        if step == cfg["warmup"]:
            hvd.allreduce(torch.zeros(1), name="scaling.mark")
            start_rx, start_tx = _counters()
            t_start = time.perf_counter()
        x, y = next(it)
        if getattr(comp, "driver", None) is not None:  # the session's (compressor="auto" picks it at the first step)
            comp.driver.collect_costs = True  # every step records the cost model's bytes (`_predicted`)
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
            predicted.append(_predicted(cfg["method"], comp, params, world, cfg["min_numel"]))
            cur = getattr(getattr(comp, "driver", None), "current", None)
            cfs.append(cur.sent_cf if cur is not None else 1.0)
            transports.append(cur.transport if cur is not None else None)
    end_rx, end_tx = _counters()
    elapsed = time.perf_counter() - t_start
    hvd.allreduce(torch.zeros(1), name="scaling.done")
    mine = {"rank": rank, "rx_per_step": (end_rx - start_rx) / cfg["steps"],
            "tx_per_step": (end_tx - start_tx) / cfg["steps"], "idle_rx_per_s": idle_rx,
            "idle_tx_per_s": (tx1 - tx0) / cfg["idle_s"], "elapsed_s": elapsed,
            "step_s_median": statistics.median(times), "predicted_per_step": statistics.fmean(predicted),
            "cfs": sorted(set(cfs)), "transports": sorted({t for t in transports if t}),
            "last_cf": cfs[-1], "last_transport": transports[-1]}
    stats = comp.stats(debug=True) if hasattr(comp, "stats") else {}
    if rank == 0 and stats:  # the policy's view at the end (rates and gains per CF, the transport choice)
        mine["policy"] = json.loads(json.dumps({k: v for k, v in stats.items()
                                                if k.startswith(("policy/", "transport_choice/"))}, default=str))
    every = hvd.allgather_object(mine)
    if rank == 0:
        print("RESULT " + json.dumps({"config": cfg, "world": world, "ranks": every}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
