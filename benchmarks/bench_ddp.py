"""DDP communication hooks on an emulated network: time to dense accuracy, step time, bytes.

    python -m benchmarks.bench_ddp --rate 1gbit --hosts 2 --epochs 12      # the make-bench run (root)
    python -m benchmarks.bench_ddp --methods none,fp16,adaptive --epochs 2  # a smaller comparison
    python -m benchmarks.bench_ddp --model cnn --dataset mnist --momentum 0.9 --weight-decay 5e-4 --lr 0.02 \
        --rate 100mbit --epochs 3 --eval-every 10 --seeds 0,1,2 --own-jobs \
        --methods none,fp16,powersgd1,powersgd2,powersgd4,adaptive              # under momentum, as users run it

Every method trains the same model (benchmarks.models: by default the digits MLP, --width 4: hidden 2048,
4.3 M parameters) from the same initial weights on the same batches, optimizer, learning rate and epochs, one
process per emulated host (benchmarks.netem: one network namespace per host, full-duplex links of --rate; needs
root). By default the DDP methods train side by side in one job, one step of each in turn (who goes first
rotates), so that a shared machine's changing load hits them alike; each method's clock runs only during its own
steps (its training time, and the step time GraVAC sees through AdaptiveState(clock=...)). With --own-jobs each
method trains in a job of its own, as users run them. Each Horovod method always runs in a job of its own
(Horovod's hook times steps by wall clock).

  none           PyTorch DDP, no hook (dense fp32): its final accuracy is the target
  fp16           DDP with PyTorch's fp16_compress_hook
  powersgd1/2/4  DDP with PyTorch's powerSGD_hook, rank 1 / 2 / 4, one bucket (it fails on Gloo with several),
                 vanilla allreduce for the first 10 % of the steps (--powersgd-start; PyTorch's advice)
  adaptive       DDP with crossover's adaptive_hook, AdaptiveState() shown the optimizer (the defaults)
  adaptive-demo  the same with GraVAC's paper search and hand-tuned settings (cf_min 30, epsilon 0.15,
                 window 100: the defaults before issue 12), for comparison only; not in the default list
  hvd-adaptive   Horovod DistributedOptimizer with crossover's AdaptiveCompression() defaults
  topk100        DDP with adaptive_hook, AdaptiveState(policy="static", cf=100) (top-k at 1 %)
  topk100-counts the same with gather="counts" (counts exchanged before the allgather)
  hvd-none       Horovod, no compression

Per method the table gives (medians over seeds) the step time, bytes per step as counted by the hook (dense/sent)
and as measured on the emulated links (what every host sent during the method's steps, headers included), the final
accuracy and the training time until the dense run's final accuracy on the same seed less 1 point was first
reached (evaluated at every epoch end and every --eval-every steps, read on benchmarks.report's moving mean).
Results: OUT/<method>[@SEED]/results.json (benchmarks.report format), OUT/compare/ (table and plots),
OUT/ddp.json (everything, with the targets of issues 13 and 46 (c) checked).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
METHODS = ("none", "fp16", "powersgd1", "powersgd2", "powersgd4", "adaptive", "adaptive-demo", "hvd-adaptive",
           "topk100", "topk100-counts", "hvd-none")
DEFAULT_METHODS = "none,fp16,powersgd1,powersgd4,adaptive,topk100,hvd-adaptive"
#: The paper search with the settings the demo once hand-tuned (before the ladder defaults of issue 12); a
#: row for comparison only: the targets are checked on `adaptive`, the defaults
DEMO_GRAVAC = {"search": "paper", "gain": "norm", "cf_min": 30, "epsilon": 0.15, "window": 100}
NAMES = {"none": "DDP dense (no hook)", "fp16": "DDP fp16_compress_hook", "powersgd1": "DDP PowerSGD rank 1",
         "powersgd2": "DDP PowerSGD rank 2", "powersgd4": "DDP PowerSGD rank 4",
         "adaptive": "DDP adaptive_hook, defaults",
         "adaptive-demo": "DDP adaptive_hook, paper search, hand-tuned",
         "hvd-adaptive": "Horovod AdaptiveCompression, defaults", "topk100": "DDP adaptive_hook, static top-k 100",
         "topk100-counts": "DDP adaptive_hook, top-k 100, gather=counts", "hvd-none": "Horovod dense"}

log = logging.getLogger("benchmarks.bench_ddp")


# --------------------------------------------------------------------------- one rank


class _DistShim:
    """The few Horovod calls benchmarks.trainer.evaluate makes, over torch.distributed."""

    Sum = "sum"
    Average = "average"

    @staticmethod
    def rank() -> int:
        import torch.distributed as dist

        return dist.get_rank()

    @staticmethod
    def size() -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def allreduce(self, tensor: Any, op: str = "average", name: str | None = None) -> Any:
        import torch.distributed as dist

        out = tensor.clone()
        dist.all_reduce(out)
        return out if op == self.Sum else out / self.size()

    def grouped_allreduce(self, tensors: list[Any], op: str = "average", name: str | None = None) -> list[Any]:
        return [self.allreduce(t, op) for t in tensors]


class _Clock:
    """Seconds spent in one method's steps only: it runs while that method steps and stops in between.

    Several methods train side by side in the same processes; each method's train time and the step
    time its policy sees (AdaptiveState(clock=...)) must not include the other methods' steps.
    """

    def __init__(self) -> None:
        self.total = 0.0
        self._start: float | None = None

    def __call__(self) -> float:
        return self.total + (time.perf_counter() - self._start if self._start is not None else 0.0)

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> float:
        """End the step; return its duration."""
        assert self._start is not None
        d = time.perf_counter() - self._start
        self.total += d
        self._start = None
        return d


def _wire_tx() -> int:
    """Bytes this emulated host sent on its link so far (its veth end: all of this rank's traffic)."""
    try:
        return int(Path(f"/sys/class/net/{os.environ.get('GLOO_SOCKET_IFNAME', 'eth0')}/statistics/tx_bytes")
                   .read_text())
    except OSError:
        return 0


class _Method:
    """One method training side by side with the others: its model, optimizer, hook state and records."""

    def __init__(self, name: str, train_model: Any, eval_model: Any, opt: Any, hook_state: Any, clock: _Clock,
                 dense_per_step: int, lr: float) -> None:
        self.name, self.train_model, self.eval_model, self.opt = name, train_model, eval_model, opt
        self.hook_state, self.clock, self.dense_per_step, self.lr = hook_state, clock, dense_per_step, lr
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.last = (0, 0)
        self.wire = 0
        self.count = 0

    def counted(self) -> tuple[int, int, float | None, int | None]:
        """(bytes sent, bytes dense, CF, bits) of the step just taken, as the method counts them."""
        m, st = self.name, self.hook_state
        cf: float | None = None
        bits = None
        if m.startswith("powersgd"):
            sent, dense = 4 * st.total_numel_after_compression, 4 * st.total_numel_before_compression
            if dense == self.last[1]:  # vanilla allreduce before start_powerSGD_iter: PowerSGD counts nothing
                return self.dense_per_step, self.dense_per_step, 1.0, None
        elif st is not None and hasattr(st, "stats"):
            s = st.stats()
            sent, dense, cf, bits = int(s["bytes_sent"]), int(s["bytes_dense"]), s.get("compression_factor"), \
                s.get("bits")
        else:  # no counters: dense, or the fp16 hook's half
            half = m == "fp16"
            return (self.dense_per_step // 2 if half else self.dense_per_step), self.dense_per_step, \
                (2.0 if half else 1.0), None
        d_sent, d_dense = sent - self.last[0], dense - self.last[1]
        self.last = (sent, dense)
        if m.startswith("powersgd"):
            cf = d_dense / d_sent if d_sent else None
        return d_sent, d_dense, None if cf is None else float(cf), bits

    def step(self, x: Any, y: Any, epoch: int, me: bool) -> None:
        import torch

        tx = _wire_tx()
        self.clock.start()
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.train_model(x), y)
        loss.backward()
        self.opt.step()
        d = self.clock.stop()
        self.wire += _wire_tx() - tx
        self.count += 1
        sent, dense, cf, bits = self.counted()
        if me:
            self.steps.append({"step": self.count, "epoch": epoch, "t": round(self.clock.total, 6),
                               "time": round(time.time(), 6), "step_s": round(d, 6), "data_s": 0.0,
                               "loss": loss.item(), "bytes_sent": sent, "bytes_dense": dense, "cf": cf, "bits": bits,
                               "lr": self.lr})


def _optimizer(params: Any, cfg: dict[str, Any]) -> Any:
    from .optim import build_optimizer

    return build_optimizer(cfg.get("optimizer", "sgd"), params, lr=float(cfg["lr"]),
                           momentum=float(cfg.get("momentum", 0.0)), weight_decay=float(cfg.get("weight_decay", 0.0)))


def _ddp_method(name: str, model: Any, cfg: dict[str, Any]) -> _Method:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from crossover.ddp import AdaptiveState, adaptive_hook

    clock = _Clock()
    one_bucket = name.startswith("powersgd")
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024 if one_bucket else None)
    opt = _optimizer(net.parameters(), cfg)
    state: Any = None
    if name == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif one_bucket:
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(name[-1]),
                                            start_powerSGD_iter=max(2, int(cfg["powersgd_start"])))
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name == "adaptive":
        state = AdaptiveState(clock=clock, optimizer=opt)  # the defaults, shown the optimizer as docs/ddp.md says
    elif name == "adaptive-demo":
        state = AdaptiveState(clock=clock, optimizer=opt, **DEMO_GRAVAC)
    elif name.startswith("topk100"):
        state = AdaptiveState(policy="static", cf=100, gather="counts" if name.endswith("counts") else "pad",
                              clock=clock)
    if isinstance(state, AdaptiveState):
        net.register_comm_hook(state, adaptive_hook)
    return _Method(name, net, net.module, opt, state, clock, sum(p.numel() * 4 for p in model.parameters()),
                   float(cfg["lr"]))


def _hvd_method(name: str, model: Any, cfg: dict[str, Any]) -> _Method:
    import horovod.torch as hvd

    from crossover import AdaptiveCompression

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    comp = AdaptiveCompression() if name == "hvd-adaptive" else None
    kw = {} if comp is None else {"compression": comp}
    opt = hvd.DistributedOptimizer(_optimizer(model.parameters(), cfg),
                                   named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()], **kw)
    return _Method(name, model, model, opt, comp, _Clock(), sum(p.numel() * 4 for p in model.parameters()),
                   float(cfg["lr"]))


def worker(cfg: dict[str, Any]) -> None:
    """Train every method of cfg['methods'] side by side, one step of each in turn (rotating who goes
    first), on the same batches; rank 0 writes each method's raw.json (benchmarks.trainer's format)."""
    import torch

    from .datasets import load_dataset
    from .models import build_model, count_parameters
    from .trainer import evaluate

    host = cfg["host"]
    torch.set_num_threads(1)
    if host == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        comm: Any = _DistShim()
    else:
        import horovod.torch as hvd

        hvd.init()
        comm = hvd
    rank, size = comm.rank(), comm.size()
    seed = int(cfg["seed"])
    data = load_dataset(cfg["dataset"], None, seed=seed)
    batch = int(cfg["batch_size"])
    per_epoch = data.steps_per_epoch(size, batch)
    eval_every = int(cfg.get("eval_every") or 0)
    methods = []
    for name in cfg["methods"]:
        torch.manual_seed(seed)  # the same initial weights for every method
        model = build_model(cfg["model"], cfg["dataset"], data.num_classes, width=float(cfg["width"]),
                            in_channels=data.shape[0])
        methods.append((_ddp_method if host == "ddp" else _hvd_method)(name, model, cfg))
    me = rank == 0

    def evaluate_all(epoch: int) -> None:
        for m in methods:
            t = time.perf_counter()
            res = evaluate(m.eval_model, data, False, batch, comm)
            m.evals.append({"epoch": epoch, "step": m.count, "train_s": m.clock.total,
                            "wall_s": time.perf_counter() - t_start, "eval_s": time.perf_counter() - t, **res})
            if me:
                log.info("%s epoch %d step %d: accuracy %.4f (train %.1f s)", m.name, epoch, m.count,
                         res["accuracy"], m.clock.total)

    comm.allreduce(torch.zeros(1), name="bench.ready")  # start the clocks together
    t_start = time.perf_counter()
    step = 0
    for epoch in range(1, int(cfg["epochs"]) + 1):
        for i, (x, y) in enumerate(data.train_batches(epoch, rank, size, batch, seed)):
            if i >= per_epoch:
                break
            k = step % len(methods)
            for m in methods[k:] + methods[:k]:
                m.step(x, y, epoch, me)
            step += 1
            if eval_every and step % eval_every == 0 and i + 1 < per_epoch:
                evaluate_all(epoch)
        evaluate_all(epoch)
    for m in methods:
        wire = comm.allreduce(torch.tensor([float(m.wire)], dtype=torch.float64), op=comm.Sum, name="bench.wire")
        meta = {"size": size, "parameters": count_parameters(m.eval_model), "gradient_bytes_dense": m.dense_per_step,
                "steps_per_epoch": per_epoch, "total_steps": m.count, "data_info": data.info,
                "num_classes": data.num_classes, "text": False, "metric": "accuracy", "job": "", "host": host,
                "wall_s": time.perf_counter() - t_start, "train_s": m.clock.total, "wire_bytes": int(wire.item()),
                "methods_side_by_side": [x.name for x in methods]}
        if m.hook_state is not None and hasattr(m.hook_state, "stats"):
            meta["compression_stats"] = {k: v for k, v in m.hook_state.stats().items()
                                             if not k.startswith("policy/")}
        if me:
            out = Path(cfg["outs"][m.name])
            out.mkdir(parents=True, exist_ok=True)
            (out / "raw.json").write_text(json.dumps({"meta": {**meta, "finished": True}, "steps": m.steps,
                                                      "evals": m.evals}))
    if host == "ddp":
        import gc

        import torch.distributed as dist

        methods.clear()
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        # torch 2.13 + Gloo: even plain DDP aborts now and then in interpreter teardown ("terminate called
        # without an active exception"); the results are written, so leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# --------------------------------------------------------------------------- launching


def _run_ddp(cluster: Any, cmd: list[str], env: dict[str, str], port: int, timeout: float) -> tuple[int, str]:
    """One process per emulated host joined by torch.distributed (Gloo over the shaped links)."""
    n = len(cluster.hosts)
    procs, files = [], []
    for i in range(n):
        f = tempfile.TemporaryFile(mode="w+")
        files.append(f)
        rank_env = dict(env, MASTER_ADDR=cluster.addresses[0], MASTER_PORT=str(port), RANK=str(i),
                        WORLD_SIZE=str(n), GLOO_SOCKET_IFNAME=cluster.iface)
        procs.append(cluster.popen(i, cmd, env=rank_env, stdin=subprocess.DEVNULL, stdout=f,
                                   stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    rc = 0
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            time.sleep(3.0)  # give the others a moment to fail by themselves
            for p in procs:
                if p.poll() is None:
                    p.kill()
            rc = 124 if time.monotonic() > deadline else 1
            break
        time.sleep(0.1)
    rc = rc or next((p.wait() for p in procs if p.wait()), 0)
    text = ""
    for i, f in enumerate(files):
        f.seek(0)
        text += f"--- rank {i} ---\n{f.read()}"
        f.close()
    return rc, text


def _run_horovod(cluster: Any, cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    from . import netem

    try:
        res = netem.launch_horovod(cluster, 1, cmd, env=env, timeout=timeout)
        rc = next((r.returncode for r in res if r.returncode), 0)
    except netem.HorovodTimeout as exc:
        res, rc = exc.results, 124
    return rc, netem.format_rank_output(res)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The DDP methods side by side in one job (or each in its own with --own-jobs), then each Horovod method in
    its own, once per seed; results to args.out."""
    from . import netem, report
    from .datasets import load_dataset

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    seeds = [int(x) for x in str(args.seeds).split(",")]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    steps_total = load_dataset(args.dataset, None, seed=seeds[0]).steps_per_epoch(args.hosts, args.batch_size) \
        * args.epochs
    powersgd_start = args.powersgd_start if args.powersgd_start is not None else max(2, steps_total // 10)
    ddp = [m for m in methods if not m.startswith("hvd-")]
    ddp_jobs = [[m] for m in ddp] if args.own_jobs else ([ddp] if ddp else [])
    jobs = [(seed, host, names) for seed in seeds
            for host, names in [("ddp", n) for n in ddp_jobs] + [("horovod", [m]) for m in methods
                                                                  if m.startswith("hvd-")]]
    common = {"model": args.model, "dataset": args.dataset, "data": None, "width": args.width, "epochs": args.epochs,
              "batch_size": args.batch_size, "lr": args.lr, "optimizer": args.optimizer, "momentum": args.momentum,
              "weight_decay": args.weight_decay, "eval_every": args.eval_every, "warmup": args.warmup,
              "hosts": args.hosts, "np": 1, "bandwidth": args.rate, "target": None, "powersgd_start": powersgd_start}
    results: dict[str, Any] = {}
    paths = []
    with netem.EmulatedCluster(args.hosts, args.rate) as cluster:
        for j, (seed, host, names) in enumerate(jobs):
            labels = {m: m if len(seeds) == 1 else f"{m}@{seed}" for m in names}
            outs = {m: str(out / labels[m]) for m in names}
            for m in names:
                (out / labels[m]).mkdir(parents=True, exist_ok=True)
                (out / labels[m] / "raw.json").unlink(missing_ok=True)
            cfg = {**common, "seed": seed, "host": host, "methods": names, "outs": outs}
            cfg_path = out / f"job{j}-{host}.json"
            cfg_path.write_text(json.dumps(cfg, indent=1))
            cmd = [sys.executable, "-m", f"{__package__}.bench_ddp", "--worker", str(cfg_path)]
            t0 = time.monotonic()
            load = os.getloadavg()[0]
            print(f"[job {j + 1}/{len(jobs)}] {host}, seed {seed}: {', '.join(names)} (load average {load:.1f})",
                  flush=True)
            if host == "ddp":
                rc, text = _run_ddp(cluster, cmd, env, 29500 + j, args.timeout)
            else:
                rc, text = _run_horovod(cluster, cmd, env, args.timeout)
            (out / f"job{j}-{host}.log").write_text(text)
            for m in names:
                label = labels[m]
                raw_path = out / label / "raw.json"
                if rc or not raw_path.exists():
                    results[label] = {"name": NAMES[m], "failed": rc or "no result"}
                    continue
                raw = json.loads(raw_path.read_text())
                mcfg = {**common, "seed": seed, "method": m, "host": host, "label": label, "compression": m,
                        "out": outs[m]}
                res = report.write_run(raw, mcfg, out / label, plots=False)
                s = res["summary"]
                steps = len(raw["steps"])
                wire = raw["meta"]["wire_bytes"]
                results[label] = {"name": NAMES[m], "job": f"{host} job {j + 1}", "median_step_s": s["median_step_s"],
                                  "final_accuracy": s["final_metric"], "bytes_ratio": s["compression_ratio"],
                                  "wire_bytes": wire, "wire_bytes_per_step": wire / max(1, steps), "steps": steps,
                                  "train_s": s["train_s"], "cf_final": s["cf_final"], "load_average": load,
                                  "compression_stats": raw["meta"].get("compression_stats")}
                paths.append(out / label / "results.json")
                print(f"  {label}: median step {1e3 * (s['median_step_s'] or 0):.1f} ms, final accuracy "
                      f"{s['final_metric']:.4f}, wire {wire / max(1, steps) / 1e6:.2f} MB/step", flush=True)
            if rc:
                print(f"  job failed (exit {rc}); last lines:\n" + "\n".join(text.splitlines()[-25:]), flush=True)
            print(f"  {time.monotonic() - t0:.0f} s", flush=True)
    cmp = report.compare(paths, out / "compare", judge=None) if paths else {"rows": []}
    rows = {row["method"]: row for row in cmp["rows"]}
    summary = {"command": "python -m benchmarks.bench_ddp " + shlex.join(sys.argv[1:]), "rate": args.rate,
               "hosts": args.hosts, "epochs": args.epochs, "model": args.model, "dataset": args.dataset,
               "width": args.width, "optimizer": args.optimizer, "momentum": args.momentum,
               "weight_decay": args.weight_decay, "lr": args.lr, "batch_size": args.batch_size, "seeds": seeds,
               "own_jobs": args.own_jobs, "powersgd_start": powersgd_start, "runs": results, "methods": rows,
               "targets": targets(rows)}
    (out / "ddp.json").write_text(json.dumps(summary, indent=1))
    return summary


def targets(rows: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 13's and issue 46 (c)'s targets, checked on the compared rows (medians over seeds; None: a run missing
    or the target not reached)."""
    ours = rows.get("adaptive", {})
    t_ours = ours.get("time_to_dense_final_s")
    out = []

    def speedup(other: str) -> float | None:
        t = rows.get(other, {}).get("time_to_dense_final_s")
        return None if not (t and t_ours) else t / t_ours

    s = speedup("fp16")
    out.append({"target": "adaptive_hook (defaults) reaches dense accuracy >= 1.3x faster than the DDP fp16 hook",
                "measured": s, "pass": bool(s and s >= 1.3)})
    ranks = [k for k in ("powersgd1", "powersgd2", "powersgd4") if k in rows]
    for k in ranks:
        s = speedup(k)
        t_other = rows[k].get("time_to_dense_final_s")
        out.append({"target": f"adaptive_hook (defaults) reaches dense accuracy faster than {NAMES[k]}",
                    "measured": s, "pass": bool(t_ours and (t_other is None or t_ours < t_other))})
    reached = {k: rows[k]["time_to_dense_final_s"] for k in ranks if rows[k].get("time_to_dense_final_s")}
    if reached:
        best = min(reached, key=reached.get)
        s = speedup(best)
        out.append({"target": f"adaptive_hook (defaults) ahead of PyTorch's best PowerSGD rank ({NAMES[best]})",
                    "measured": s, "pass": bool(s and s > 1.0)})
    d = ours.get("final_minus_dense")
    out.append({"target": "adaptive_hook (defaults) final accuracy within 1 point of DDP dense (same seed)",
                "measured": d, "pass": d is not None and d >= -0.01})
    return out


def format_table(summary: dict[str, Any]) -> str:
    """The methods' table (markdown; medians over seeds) and the targets."""
    import statistics

    from .report import base_method

    rows, runs = summary["methods"], summary["runs"]
    target = next((v.get("dense_target") for v in rows.values() if v.get("dense_target") is not None), None)
    opt = summary["optimizer"] + (f" momentum {summary['momentum']:g}" if summary["momentum"] else "") + \
        (f" weight decay {summary['weight_decay']:g}" if summary["weight_decay"] else "")
    lines = [f"{summary['model']} on {summary['dataset']} (width {summary['width']:g}), {summary['hosts']} emulated "
             f"hosts at {summary['rate']}, {summary['epochs']} epochs, {opt}, lr {summary['lr']}, batch "
             f"{summary['batch_size']} per rank, seeds {','.join(map(str, summary['seeds']))}, "
             f"{'each method its own job' if summary['own_jobs'] else 'the DDP methods side by side in one job'}; "
             "target = DDP dense's final accuracy on the same seed less 1 point"
             + (f" (median {target:.4f})" if target is not None else ""),
             "",
             "| method | runs | step ms | bytes dense/sent (counted) | wire MB/step | final accuracy (min..max) | "
             "vs dense | time to target s | TTA vs DDP dense | TTA vs DDP fp16 | family, CF |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]

    def f(v: Any, spec: str, none: str = "-") -> str:
        return none if v is None else format(v, spec)

    for label, v in runs.items():
        if "failed" in v:
            lines.append(f"| {label} | failed ({v['failed']}) | | | | | | | | | |")
    for m, r in rows.items():
        wire = [v["wire_bytes_per_step"] for k, v in runs.items() if base_method(k) == m and "failed" not in v]
        fin = f(r["final_metric"], ".4f") + (f" ({r['final_min']:.4f}..{r['final_max']:.4f})" if r["repeats"] > 1
                                            and r["final_min"] is not None else "")
        gap = r.get("final_minus_dense")
        step = r["median_step_s"] and 1e3 * r["median_step_s"]
        mb = statistics.median(wire) / 1e6 if wire else 0.0
        lines.append(f"| {NAMES.get(m, m)} | {r['repeats']} | {f(step, '.1f')} | {f(r['compression_ratio'], '.1f')} | "
                     f"{mb:.2f} | "
                     f"{fin} | {f(gap if gap is None else 100 * gap, '+.2f')} pt | "
                     f"{f(r['time_to_dense_final_s'], '.1f', 'not reached')} ({r['reached_in']}) | "
                     f"{f(r.get('tta_speedup_vs_dense'), '.2f')}x | {f(r.get('tta_speedup_vs_fp16'), '.2f')}x | "
                     f"{r.get('compressor') or '-'} {f(r.get('cf_final'), '.3g', '')} |")
    lines += ["", "| target (issues 13, 46 (c)) | measured | |", "|---|---:|---|"]
    for t in summary["targets"]:
        meas = t["measured"]
        shown = "-" if meas is None else (f"{100 * meas:+.2f} points" if "within" in t["target"] else f"{meas:.2f}x")
        lines.append(f"| {t['target']} | {shown} | {'PASS' if t['pass'] else 'FAIL'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, from {', '.join(METHODS)} "
                   "(default %(default)s; `none` sets the accuracy target)")
    p.add_argument("--rate", default="1gbit", help="emulated link rate of every host, tc units (default %(default)s)")
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts, one rank each (default %(default)s)")
    p.add_argument("--epochs", type=int, default=12, help="epochs of every run (default %(default)s)")
    p.add_argument("--model", default="mlp", choices=("mlp", "cnn"), help="default %(default)s")
    p.add_argument("--dataset", default="digits", choices=("digits", "mnist"), help="default %(default)s")
    p.add_argument("--width", type=float, default=None, help="width multiplier (default: 4 for the MLP, hidden 2048; "
                   "1 for the CNN)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"), help="default %(default)s")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="default %(default)s")
    p.add_argument("--lr", type=float, default=0.2, help="learning rate (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default %(default)s)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, each a run of every method (default 0)")
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (default: epoch ends)")
    p.add_argument("--own-jobs", action="store_true", help="each DDP method in a job of its own (as users run "
                   "them) instead of side by side in one job")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the step-time median")
    p.add_argument("--powersgd-start", type=int, default=None,
                   help="PowerSGD's start_powerSGD_iter (default: 10%% of the steps, at least 2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per method before its job is killed")
    p.add_argument("--out", default="results/bench/ddp", help="results folder (default %(default)s)")
    p.add_argument("--json", default=None, help="also write the summary JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.width is None:
        args.width = 4.0 if args.model == "mlp" else 1.0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return 0
    unknown = [m for m in args.methods.split(",") if m.strip() and m.strip() not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    from . import netem

    reason = netem.netem_unavailable_reason()
    if reason:
        p.error(f"the emulated network is unavailable here: {reason}")
    print("command: python -m benchmarks.bench_ddp " + shlex.join(sys.argv[1:] if argv is None else argv), flush=True)
    t0 = time.monotonic()
    summary = run(args)
    print()
    print(format_table(summary))
    print(f"\ntotal {time.monotonic() - t0:.0f} s; results in {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    failed = [m for m, v in summary["runs"].items() if "failed" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
