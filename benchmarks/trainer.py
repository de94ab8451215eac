"""One rank of a benchmark run: ``python -m benchmarks.trainer CONFIG.json`` under Horovod.

The benchmark CLI (:mod:`benchmarks.cli`) writes the config and starts this module on every rank (with
``horovodrun``, on an emulated cluster, or under the crossover scheduler). Every rank trains on its own
shard with ``hvd.DistributedOptimizer`` and the chosen compression; evaluation is sharded too and summed
over ranks. Rank 0 records per step (time, bytes, CF or bits, loss) and per evaluation (accuracy or
perplexity and loss, training time so far) and writes ``raw.json`` in the output folder, plus a ``progress``
file the CLI (and ``make demo``) read for their progress lines (benchmarks/progress.py).
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

from .optim import lr_factor, set_lr
from .progress import Reading, write_progress

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


class _Training:
    """One configured training (model, data, compression, optimizer) that advances a step at a time and keeps
    its own clock: ``train_s`` counts only its own steps (data loading included), so several can share one
    process in turns (``run_side_by_side``) and each still measures what it alone costs."""

    def __init__(self, cfg: dict[str, Any], data: Any, hvd: Any, index: int = 0) -> None:
        from .datasets import TextData
        from .methods import ByteCounter, CompressionOptions, make_compression
        from .models import build_model, count_parameters
        from .optim import build_optimizer
        from .registry import metric_of, parse_compression

        self.cfg, self.data, self.hvd = cfg, data, hvd
        rank, size = hvd.rank(), hvd.size()
        self.out = Path(cfg["out"])
        self.seed = int(cfg["seed"])
        torch.manual_seed(self.seed)
        self.text = text = isinstance(data, TextData)
        self.batch = batch = int(cfg["batch_size"])
        per_epoch = data.steps_per_epoch(size, batch)
        if per_epoch < 1:
            raise SystemExit(f"{cfg['dataset']}: too little training data for {size} ranks x batch {batch} "
                             f"(each rank gets {(len(data.train_ids) if text else data.train_size) // size} "
                             f"{'tokens' if text else 'samples'}); "
                             "lower --batch-size or use more data")
        if cfg.get("steps_per_epoch"):
            per_epoch = min(per_epoch, int(cfg["steps_per_epoch"]))
        self.per_epoch = per_epoch
        total = per_epoch * int(cfg["epochs"])
        if cfg.get("max_steps"):
            total = min(total, int(cfg["max_steps"]))
        self.total = total
        self.model = model = build_model(cfg["model"], cfg["dataset"], data.num_classes,
                                         width=float(cfg.get("width", 1.0)), image_size=cfg.get("image_size"),
                                         tie_weights=bool(cfg.get("tie_weights", False)),
                                         in_channels=None if text else data.shape[0],
                                         context=int(cfg.get("seq_len") or 35))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        method = parse_compression(cfg["compression"])
        window = cfg.get("gravac_window")
        opts = CompressionOptions(total_steps=total, gravac_epsilon=cfg.get("gravac_epsilon"),
                                  gravac_window=None if window is None else int(window),
                                  gravac_cf_min=cfg.get("gravac_cf_min"), gravac_cf_max=cfg.get("gravac_cf_max"),
                                  min_compress_numel=cfg.get("min_compress_numel"), seed=self.seed,
                                  log_csv=str(self.out / "policy.csv") if rank == 0 else None)
        self.compression = make_compression(method, opts)
        self.base_lr = float(cfg["lr"])
        self.schedule = str(cfg.get("lr_schedule") or "constant")
        lr_factor(self.schedule, 0, total)  # an unknown schedule fails here, before any step
        self.inner = build_optimizer(str(cfg.get("optimizer") or "sgd"), model.parameters(), lr=self.base_lr,
                                     momentum=float(cfg.get("momentum") or 0.0),
                                     weight_decay=float(cfg.get("weight_decay") or 0.0))
        self._index = index
        self.opt: Any = None  # attach_optimizer()
        self.counter = ByteCounter(method, self.compression, model)
        self.clip = float(cfg.get("clip") or 0.0)
        self.eval_every = int(cfg.get("eval_every") or 0)
        self.eval_batch = int(cfg.get("eval_batch_size") or batch)
        self.me = rank == 0
        if self.me:
            self.out.mkdir(parents=True, exist_ok=True)
            log.info("%s; %s on %d ranks, %.2f M parameters, %d steps (%d per epoch), %s, %s lr %g (%s)", data.info,
                     cfg["model"], size, count_parameters(model) / 1e6, total, per_epoch, cfg["compression"],
                     cfg.get("optimizer") or "sgd", self.base_lr, self.schedule)
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.meta = {"rank0_host": os.environ.get("HOROVOD_HOSTNAME", ""), "size": size,
                     "parameters": count_parameters(model), "gradient_bytes_dense": self.counter.dense_per_step,
                     "steps_per_epoch": per_epoch, "total_steps": total, "data_info": data.info,
                     "num_classes": data.num_classes, "text": text, "metric": metric_of(cfg["model"]),
                     "job": os.environ.get("CROSSOVER_JOB", ""),
                     "gravac_window": window if method.kind == "gravac" else None}
        self.step = 0
        self.epoch = 0
        self.train_s = 0.0
        self.wall_s = 0.0  # this training's own time, evaluations included
        self.first_step_at: float | None = None  # wall time when the first step began (the progress clock)
        self._batches: Any = None
        self._in_epoch = 0
        self._state: Any = None  # the LSTM's hidden state, carried across windows of an epoch

    def attach_optimizer(self) -> None:
        """Horovod's DistributedOptimizer (under crossover scheduling, building it takes the device)."""
        # Parameter names are the collectives' names: trainings sharing a process need their own.
        named = [(f"t{self._index}.{n}" if self._index else n, p) for n, p in self.model.named_parameters()]
        self.opt = self.hvd.DistributedOptimizer(self.inner, named_parameters=named, compression=self.compression)

    @property
    def done(self) -> bool:
        return self.step >= self.total

    def save(self, done: bool) -> None:
        if self.me:
            _write_atomic(self.out / "raw.json", json.dumps({"meta": {**self.meta, "finished": done},
                                                             "steps": self.steps, "evals": self.evals}))

    def _evaluate(self) -> None:
        t = time.perf_counter()
        res = evaluate(self.model, self.data, self.text, self.eval_batch, self.hvd)
        took = time.perf_counter() - t
        self.wall_s += took
        self.evals.append({"epoch": self.epoch, "step": self.step, "train_s": self.train_s, "wall_s": self.wall_s,
                           "eval_s": took, **res})
        if self.me:
            metric = (f"loss {res['eval_loss']:.4f}, perplexity {res['perplexity']:.2f}" if self.text
                      else f"accuracy {res['accuracy']:.4f}")
            log.info("%s epoch %d step %d: %s (train %.1f s)", self.cfg["compression"], self.epoch, self.step,
                     metric, self.train_s)
        self.save(False)

    def _new_epoch(self) -> None:
        """Evaluate at the end of an epoch (not on the clock), then start the next one."""
        if self._batches is not None:
            self._evaluate()
        self.epoch += 1
        self._batches = iter(self.data.train_batches(self.epoch, self.hvd.rank(), self.hvd.size(), self.batch,
                                                     self.seed))
        self._in_epoch, self._state = 0, None

    def _next_batch(self) -> tuple[Any, float]:
        """(the next training batch, the time its clock starts): the data loading counts, evaluations do not."""
        if self._batches is None or self._in_epoch >= self.per_epoch:
            self._new_epoch()
        while True:
            t_data = time.perf_counter()
            try:
                batch = next(self._batches)
                self._in_epoch += 1
                return batch, t_data
            except StopIteration:  # fewer batches than steps_per_epoch said: the epoch ends here
                self._new_epoch()

    def run_steps(self, n: int) -> None:
        """Up to ``n`` more steps (fewer at the end), each timed from the request of its batch."""
        for _ in range(n):
            if self.done:
                return
            if self.first_step_at is None:
                self.first_step_at = time.time()
            (x, y), t_data = self._next_batch()
            t0 = time.perf_counter()
            if self.schedule != "constant":
                set_lr(self.inner, self.base_lr * lr_factor(self.schedule, self.step, self.total))
            self.opt.zero_grad()
            if self.text:
                if self._state is not None:
                    self._state = (self._state[0].detach(), self._state[1].detach())
                logits, self._state = self.model(x, self._state)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            else:
                loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            if self.clip > 0:
                self.opt.synchronize()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
                with self.opt.skip_synchronize():
                    self.opt.step()
            else:
                self.opt.step()
            t1 = time.perf_counter()
            loss_v = loss.item()
            self.step += 1
            self.train_s += t1 - t_data
            self.wall_s += t1 - t_data
            sent, dense, cf, bits = self.counter.step()
            if self.me:
                self.steps.append({"step": self.step, "epoch": self.epoch, "t": round(self.train_s, 6),
                                   "time": round(time.time(), 6), "step_s": round(t1 - t0, 6),
                                   "data_s": round(t0 - t_data, 6), "loss": loss_v, "bytes_sent": sent,
                                   "bytes_dense": dense, "cf": cf, "bits": bits,
                                   "lr": self.inner.param_groups[0]["lr"]})
                write_progress(self.out / "progress",
                               Reading(self.step, self.total, loss_v, self.first_step_at, time.time()))
            if self.eval_every and self.step % self.eval_every == 0 and not self.done:
                self._evaluate()

    def finish(self) -> None:
        self._evaluate()
        self.meta["wall_s"] = self.wall_s
        self.meta["train_s"] = self.train_s
        if hasattr(self.compression, "stats"):
            st = self.compression.stats()
            self.meta["compression_stats"] = {k: v for k, v in st.items() if not k.startswith("policy/")}
        self.save(True)


def _start(cfgs: list[dict[str, Any]]) -> tuple[Any, list[_Training], float]:
    """Horovod, the data set (shared: the configs differ only in the method) and one training per config."""
    if cfgs[0].get("pin"):
        _pin()
    setup_start = time.time()
    import horovod.torch as hvd

    from .datasets import load_dataset

    hvd.init()
    cfg = cfgs[0]
    torch.set_num_threads(int(cfg.get("threads", 1)))
    seed = int(cfg["seed"])
    torch.manual_seed(seed)
    data = load_dataset(cfg["dataset"], cfg["data"], image_size=cfg.get("image_size"),
                        num_classes=cfg.get("num_classes"), synthetic_size=cfg.get("synthetic_size"),
                        eval_samples=cfg.get("eval_samples"), vocab_size=cfg.get("vocab_size"),
                        seq_len=int(cfg.get("seq_len", 35)), augment=bool(cfg.get("augment", True)),
                        noise=float(cfg.get("synthetic_noise", 3.0)), seed=seed)
    runs = [_Training(c, data, hvd, i) for i, c in enumerate(cfgs)]
    return hvd, runs, setup_start


def run(cfg: dict[str, Any]) -> None:
    """Train as configured by the CLI; rank 0 writes raw.json (steps, evaluations, metadata) to cfg['out']."""
    hvd, (tr,), setup_start = _start([cfg])
    _gate()  # with --crossover: both jobs start training together (before the optimizer takes the device)
    tr.attach_optimizer()
    hvd.allreduce(torch.zeros(1), name="bench.ready")  # start the clock together
    tr.meta["setup_s"] = time.time() - setup_start
    tr.model.train()
    tr.run_steps(tr.total)
    tr.finish()


def run_side_by_side(cfgs: list[dict[str, Any]], block: int) -> None:
    """Train every config in one job, in turns of ``block`` steps each (the same batches, each its own clock):
    a slow phase of the machine then falls on all of them alike, and their times compare within one run.
    An adaptive method sees each turn of the others as a pause between two of its steps (as it sees an
    evaluation); its policy leaves such pauses out of its step times."""
    hvd, runs, setup_start = _start(cfgs)
    for tr in runs:
        tr.attach_optimizer()
    hvd.allreduce(torch.zeros(1), name="bench.ready")
    for tr in runs:
        tr.meta.update(setup_s=time.time() - setup_start, side_by_side={"block": block, "with": len(runs)})
        tr.model.train()
    while not all(tr.done for tr in runs):
        for tr in runs:
            tr.run_steps(block)
    for tr in runs:
        tr.finish()


def main(argv: list[str] | None = None) -> int:
    """Entry point on each rank: read the JSON config(s) named on the command line and train (several configs:
    side by side, in turns of ``--block`` steps)."""
    args = sys.argv[1:] if argv is None else argv
    block = 0
    if len(args) >= 2 and args[0] == "--block":
        block, args = int(args[1]), args[2:]
    if not args or (len(args) > 1 and block < 1):
        sys.stderr.write("usage: python -m benchmarks.trainer [--block N CONFIG.json ...] CONFIG.json "
                         "(written by crossover-bench)\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cfgs = [json.loads(Path(a).read_text()) for a in args]
    if len(cfgs) == 1:
        run(cfgs[0])
    else:
        run_side_by_side(cfgs, block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
