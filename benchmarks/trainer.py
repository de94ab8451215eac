"""One rank of a benchmark run: ``python -m benchmarks.trainer CONFIG.json`` under Horovod.

The benchmark CLI (:mod:`benchmarks.cli`) writes the config and starts this module on every rank (with
``horovodrun``, on an emulated cluster, or under the crossover scheduler). Every rank trains on its own
shard with ``hvd.DistributedOptimizer`` and the chosen compression; evaluation is sharded too and summed
over ranks. Rank 0 records per step (time, bytes, CF or bits, loss) and per evaluation (accuracy or
perplexity, training time so far) and writes ``raw.json`` in the output folder, plus a ``progress``
file the CLI reads for its progress bar.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("benchmarks.trainer")

__all__ = ["run", "main"]


def _pin() -> int:
    """Pin this rank to one core (rank modulo the cores it may use); return the core."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(os.environ.get("HOROVOD_RANK", "0")) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def _gate() -> None:
    """Wait until BENCH_GATE_N ranks (of all jobs) have reached this point, when BENCH_GATE_DIR is set."""
    gate = os.environ.get("BENCH_GATE_DIR")
    if not gate:
        return
    d = Path(gate)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{os.getpid()}").write_text("")
    n, deadline = int(os.environ.get("BENCH_GATE_N", "1")), time.monotonic() + 600
    while len(list(d.iterdir())) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _sync_buffers(model: torch.nn.Module, hvd: Any) -> None:
    """Average float buffers (batch-norm running statistics) over ranks, so every rank evaluates one model."""
    bufs = [b for b in model.buffers() if b.is_floating_point()]
    if bufs and hvd.size() > 1:
        for b, avg in zip(bufs, hvd.grouped_allreduce(bufs, op=hvd.Average, name="bench.buffers")):
            b.copy_(avg)


def evaluate(model: torch.nn.Module, data: Any, text: bool, batch_size: int, hvd: Any) -> dict[str, float]:
    """Accuracy (top-1, top-5) or perplexity on the evaluation set, sharded over ranks and summed."""
    _sync_buffers(model, hvd)
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # loss sum, count, top-1 correct, top-5 correct
    with torch.no_grad():
        state = None
        for x, y in data.eval_batches(hvd.rank(), hvd.size(), batch_size):
            if text:
                logits, state = model(x, state)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                         reduction="sum")
                sums += torch.tensor([float(loss), y.numel(), 0.0, 0.0], dtype=torch.float64)
            else:
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
                k = min(5, logits.shape[1])
                top = logits.topk(k, dim=1).indices
                hit = top == y.view(-1, 1)
                sums += torch.tensor([float(loss), len(y), float(hit[:, 0].sum()), float(hit.any(1).sum())],
                                     dtype=torch.float64)
    if hvd.size() > 1:
        sums = hvd.allreduce(sums, op=hvd.Sum, name="bench.eval")
    model.train()
    n = max(1.0, float(sums[1]))
    loss = float(sums[0]) / n
    if text:
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "eval_count": n}
    return {"eval_loss": loss, "accuracy": float(sums[2]) / n, "top5": float(sums[3]) / n, "eval_count": n}


def run(cfg: dict[str, Any]) -> None:
    """Train as configured by the CLI; rank 0 writes raw.json (steps, evaluations, metadata) to cfg['out']."""
    if cfg.get("pin"):
        _pin()
    setup_start = time.time()
    import horovod.torch as hvd

    from benchmarks.datasets import TextData, load_dataset
    from benchmarks.methods import ByteCounter, CompressionOptions, make_compression
    from benchmarks.models import build_model, count_parameters
    from benchmarks.registry import parse_compression

    hvd.init()
    torch.set_num_threads(int(cfg.get("threads", 1)))
    rank, size = hvd.rank(), hvd.size()
    out = Path(cfg["out"])
    seed = int(cfg["seed"])
    torch.manual_seed(seed)
    data = load_dataset(cfg["dataset"], cfg["data"], image_size=cfg.get("image_size"),
                        num_classes=cfg.get("num_classes"), synthetic_size=cfg.get("synthetic_size"),
                        eval_samples=cfg.get("eval_samples"), vocab_size=cfg.get("vocab_size"),
                        seq_len=int(cfg.get("seq_len", 35)), augment=bool(cfg.get("augment", True)),
                        noise=float(cfg.get("synthetic_noise", 3.0)), seed=seed)
    text = isinstance(data, TextData)
    batch = int(cfg["batch_size"])
    per_epoch = data.steps_per_epoch(size, batch)
    if per_epoch < 1:
        raise SystemExit(f"{cfg['dataset']}: too little training data for {size} ranks x batch {batch} "
                         f"(each rank gets {(len(data.train_ids) if text else data.train_size) // size} "
                         f"{'tokens' if text else 'samples'}); "
                         "lower --batch-size or use more data")
    if cfg.get("steps_per_epoch"):
        per_epoch = min(per_epoch, int(cfg["steps_per_epoch"]))
    total = per_epoch * int(cfg["epochs"])
    if cfg.get("max_steps"):
        total = min(total, int(cfg["max_steps"]))
    model = build_model(cfg["model"], cfg["dataset"], data.num_classes, width=float(cfg.get("width", 1.0)),
                        image_size=cfg.get("image_size"), tie_weights=bool(cfg.get("tie_weights", False)),
                        in_channels=None if text else data.shape[0])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    method = parse_compression(cfg["compression"])
    window = cfg.get("gravac_window")
    opts = CompressionOptions(total_steps=total, gravac_epsilon=cfg.get("gravac_epsilon"),
                              gravac_window=None if window is None else int(window),
                              gravac_cf_min=cfg.get("gravac_cf_min"), gravac_cf_max=cfg.get("gravac_cf_max"),
                              gravac_compressor=cfg.get("gravac_compressor", "topk"),
                              min_compress_numel=cfg.get("min_compress_numel"), seed=seed,
                              log_csv=str(out / "policy.csv") if rank == 0 else None)
    compression = make_compression(method, opts)
    _gate()  # with --crossover: both jobs start training together (before the optimizer takes the device)
    base_lr = float(cfg["lr"])
    sgd = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=float(cfg["momentum"]),
                          weight_decay=float(cfg.get("weight_decay", 0.0)))
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression)
    counter = ByteCounter(method, compression, model)
    clip = float(cfg.get("clip") or 0.0)
    cosine = cfg.get("lr_schedule") == "cosine"
    eval_every = int(cfg.get("eval_every") or 0)
    eval_batch = int(cfg.get("eval_batch_size") or batch)
    progress = out / "progress"
    me = rank == 0
    if me:
        out.mkdir(parents=True, exist_ok=True)
        log.info("%s; %s on %d ranks, %.2f M parameters, %d steps (%d per epoch)", data.info, cfg["model"], size,
                 count_parameters(model) / 1e6, total, per_epoch)
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    meta = {"rank0_host": os.environ.get("HOROVOD_HOSTNAME", ""), "size": size, "parameters": count_parameters(model),
            "gradient_bytes_dense": counter.dense_per_step, "steps_per_epoch": per_epoch, "total_steps": total,
            "data_info": data.info, "num_classes": data.num_classes, "text": text,
            "metric": "perplexity" if text else "accuracy", "job": os.environ.get("CROSSOVER_JOB", ""),
            "gravac_window": window if method.kind == "gravac" else None}

    def save(done: bool) -> None:
        if me:
            _write_atomic(out / "raw.json", json.dumps({"meta": {**meta, "finished": done}, "steps": steps,
                                                        "evals": evals}))

    def do_eval(epoch: int, step: int) -> None:
        t = time.perf_counter()
        res = evaluate(model, data, text, eval_batch, hvd)
        evals.append({"epoch": epoch, "step": step, "train_s": train_s, "wall_s": time.perf_counter() - t_start,
                      "eval_s": time.perf_counter() - t, **res})
        if me:
            metric = f"perplexity {res['perplexity']:.2f}" if text else f"accuracy {res['accuracy']:.4f}"
            log.info("epoch %d step %d: %s (train %.1f s)", epoch, step, metric, train_s)
        save(False)

    hvd.allreduce(torch.zeros(1), name="bench.ready")  # start the clock together
    meta["setup_s"] = time.time() - setup_start
    t_start = time.perf_counter()
    train_s = 0.0
    step = 0
    model.train()
    for epoch in range(1, int(cfg["epochs"]) + 1):
        if step >= total:
            break
        state = None
        t_data = time.perf_counter()
        for i, (x, y) in enumerate(data.train_batches(epoch, rank, size, batch, seed)):
            if i >= per_epoch or step >= total:
                break
            t0 = time.perf_counter()
            if cosine:
                for g in sgd.param_groups:
                    g["lr"] = base_lr * 0.5 * (1.0 + math.cos(math.pi * step / total))
            opt.zero_grad()
            if text:
                if state is not None:
                    state = (state[0].detach(), state[1].detach())
                logits, state = model(x, state)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            else:
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if clip > 0:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            t1 = time.perf_counter()
            loss_v = loss.item()
            step += 1
            train_s += t1 - t_data
            sent, dense, cf, bits = counter.step()
            if me:
                steps.append({"step": step, "epoch": epoch, "t": round(train_s, 6), "time": round(time.time(), 6),
                              "step_s": round(t1 - t0, 6), "data_s": round(t0 - t_data, 6), "loss": loss_v,
                              "bytes_sent": sent, "bytes_dense": dense, "cf": cf, "bits": bits,
                              "lr": sgd.param_groups[0]["lr"]})
                _write_atomic(progress, f"{step} {total} {loss_v:.4f}")
            if eval_every and step % eval_every == 0 and step < total:
                do_eval(epoch, step)
            t_data = time.perf_counter()
        do_eval(epoch, step)
    meta["wall_s"] = time.perf_counter() - t_start
    meta["train_s"] = train_s
    if hasattr(compression, "stats"):
        st = compression.stats()
        meta["compression_stats"] = {k: v for k, v in st.items() if k != "policy"}
    save(True)


def main(argv: list[str] | None = None) -> int:
    """Entry point on each rank: read the JSON config named on the command line and train."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m benchmarks.trainer CONFIG.json (written by crossover-bench)\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    run(json.loads(Path(args[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
