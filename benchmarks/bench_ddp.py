"""DDP communication hooks side by side on an emulated network: time to dense accuracy, step time, bytes.

    python -m benchmarks.bench_ddp --rate 1gbit --hosts 2 --epochs 12      # the make-bench run (root)
    python -m benchmarks.bench_ddp --methods none,fp16,adaptive --epochs 2  # a smaller comparison

Every method trains the same digits MLP (benchmarks.models, --width 4: hidden 2048, 4.3 M parameters) from
the same initial weights on the same batches, learning rate and epochs, one process per emulated host
(benchmarks.netem: one network namespace per host, full-duplex links of --rate; needs root). The DDP
methods train side by side in one job, one step of each in turn (who goes first rotates), so that a
shared machine's changing load hits them alike; each method's clock runs only during its own steps (its
training time, and the step time GraVAC sees through AdaptiveState(clock=...)). Each Horovod method runs
in a job of its own afterwards (Horovod's hook times steps by wall clock).

  none           PyTorch DDP, no hook (dense fp32): its final accuracy is the target
  fp16           DDP with PyTorch's fp16_compress_hook
  powersgd1/4    DDP with PyTorch's powerSGD_hook, rank 1 / 4, one bucket (it fails on Gloo with several),
                 vanilla allreduce for the first 10 % of the steps (--powersgd-start; PyTorch's advice)
  adaptive       DDP with crossover's adaptive_hook, AdaptiveState(momentum=0) (GraVAC defaults; plain SGD)
  adaptive-demo  the same with GraVAC's paper search and hand-tuned settings (cf_min 30, epsilon 0.15,
                 window 100: the defaults before issue 12), for comparison only; not in the default list
  hvd-adaptive   Horovod DistributedOptimizer with crossover's AdaptiveCompression() defaults
  topk100        DDP with adaptive_hook, AdaptiveState(policy="static", cf=100) (top-k at 1 %)
  topk100-counts the same with gather="counts" (counts exchanged before the allgather)
  hvd-none       Horovod, no compression

Per method the table gives the median step time, bytes per step as counted by the hook (dense/sent)
and as measured on the emulated links (what every host sent during the method's steps, headers included), the final
accuracy and the training time until the dense run's final accuracy was first reached (evaluated
every epoch). Results: OUT/<method>/results.json (benchmarks.report format), OUT/compare/ (table and
plots), OUT/ddp.json (everything, with the targets of issue 13 checked).
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
METHODS = ("none", "fp16", "powersgd1", "powersgd4", "adaptive", "adaptive-demo", "hvd-adaptive", "topk100",
           "topk100-counts", "hvd-none")
DEFAULT_METHODS = "none,fp16,powersgd1,powersgd4,adaptive,topk100,hvd-adaptive"
#: The paper search with the settings the demo once hand-tuned (before the ladder defaults of issue 12); a
#: row for comparison only: the targets are checked on `adaptive`, the defaults
DEMO_GRAVAC = {"search": "paper", "gain": "norm", "cf_min": 30, "epsilon": 0.15, "window": 100}
NAMES = {"none": "DDP dense (no hook)", "fp16": "DDP fp16_compress_hook", "powersgd1": "DDP PowerSGD rank 1",
         "powersgd4": "DDP PowerSGD rank 4", "adaptive": "DDP adaptive_hook, defaults",
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


def _ddp_method(name: str, model: Any, cfg: dict[str, Any]) -> _Method:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from crossover.ddp import AdaptiveState, adaptive_hook

    clock = _Clock()
    one_bucket = name.startswith("powersgd")
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024 if one_bucket else None)
    state: Any = None
    if name == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif one_bucket:
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(name[-1]),
                                            start_powerSGD_iter=max(2, int(cfg["powersgd_start"])))
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name == "adaptive":
        state = AdaptiveState(clock=clock, momentum=0.0)  # the optimizer's momentum (plain SGD), as DDP users say it
    elif name == "adaptive-demo":
        state = AdaptiveState(clock=clock, momentum=0.0, **DEMO_GRAVAC)
    elif name.startswith("topk100"):
        state = AdaptiveState(policy="static", cf=100, gather="counts" if name.endswith("counts") else "pad",
                              clock=clock)
    if isinstance(state, AdaptiveState):
        net.register_comm_hook(state, adaptive_hook)
    lr = float(cfg["lr"])
    return _Method(name, net, net.module, torch.optim.SGD(net.parameters(), lr=lr), state, clock,
                   sum(p.numel() * 4 for p in model.parameters()), lr)


def _hvd_method(name: str, model: Any, cfg: dict[str, Any]) -> _Method:
    import horovod.torch as hvd
    import torch

    from crossover import AdaptiveCompression

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    comp = AdaptiveCompression() if name == "hvd-adaptive" else None
    kw = {} if comp is None else {"compression": comp}
    lr = float(cfg["lr"])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()], **kw)
    return _Method(name, model, model, opt, comp, _Clock(), sum(p.numel() * 4 for p in model.parameters()), lr)


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
    data = load_dataset("digits", None, seed=seed)
    batch = int(cfg["batch_size"])
    per_epoch = data.steps_per_epoch(size, batch)
    methods = []
    for name in cfg["methods"]:
        torch.manual_seed(seed)  # the same initial weights for every method
        model = build_model("mlp", "digits", data.num_classes, width=float(cfg["width"]), in_channels=data.shape[0])
        methods.append((_ddp_method if host == "ddp" else _hvd_method)(name, model, cfg))
    me = rank == 0
    comm.allreduce(torch.zeros(1), name="bench.ready")  # start the clocks together
    t_start = time.perf_counter()
    step = 0
    for epoch in range(1, int(cfg["epochs"]) + 1):
        for x, y in data.train_batches(epoch, rank, size, batch, seed):
            k = step % len(methods)
            for m in methods[k:] + methods[:k]:
                m.step(x, y, epoch, me)
            step += 1
        for m in methods:
            t = time.perf_counter()
            res = evaluate(m.eval_model, data, False, batch, comm)
            m.evals.append({"epoch": epoch, "step": m.count, "train_s": m.clock.total,
                            "wall_s": time.perf_counter() - t_start, "eval_s": time.perf_counter() - t, **res})
            if me:
                log.info("%s epoch %d: accuracy %.4f (train %.1f s)", m.name, epoch, res["accuracy"], m.clock.total)
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
    """The DDP methods side by side in one job, then each Horovod method in its own; results to args.out."""
    from . import netem, report

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    steps_total = (1437 // args.hosts // args.batch_size) * args.epochs  # digits: 1437 training images
    powersgd_start = args.powersgd_start if args.powersgd_start is not None else max(2, steps_total // 10)
    ddp = [m for m in methods if not m.startswith("hvd-")]
    jobs = ([("ddp", ddp)] if ddp else []) + [("horovod", [m]) for m in methods if m.startswith("hvd-")]
    common = {"model": "mlp", "dataset": "digits", "data": None, "width": args.width, "epochs": args.epochs,
              "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "warmup": args.warmup,
              "hosts": args.hosts, "np": 1, "bandwidth": args.rate, "target": None, "powersgd_start": powersgd_start}
    results: dict[str, Any] = {}
    paths = []
    with netem.EmulatedCluster(args.hosts, args.rate) as cluster:
        for j, (host, names) in enumerate(jobs):
            outs = {m: str(out / m) for m in names}
            for m in names:
                (out / m).mkdir(parents=True, exist_ok=True)
                (out / m / "raw.json").unlink(missing_ok=True)
            cfg = {**common, "host": host, "methods": names, "outs": outs}
            cfg_path = out / f"job{j}-{host}.json"
            cfg_path.write_text(json.dumps(cfg, indent=1))
            cmd = [sys.executable, "-m", f"{__package__}.bench_ddp", "--worker", str(cfg_path)]
            t0 = time.monotonic()
            load = os.getloadavg()[0]
            print(f"[job {j + 1}/{len(jobs)}] {host}: {', '.join(names)} (side by side; load average {load:.1f})",
                  flush=True)
            if host == "ddp":
                rc, text = _run_ddp(cluster, cmd, env, 29500 + j, args.timeout)
            else:
                rc, text = _run_horovod(cluster, cmd, env, args.timeout)
            (out / f"job{j}-{host}.log").write_text(text)
            for m in names:
                raw_path = out / m / "raw.json"
                if rc or not raw_path.exists():
                    results[m] = {"name": NAMES[m], "failed": rc or "no result"}
                    continue
                raw = json.loads(raw_path.read_text())
                mcfg = {**common, "method": m, "host": host, "label": m, "compression": m, "out": outs[m]}
                res = report.write_run(raw, mcfg, out / m, plots=False)
                s = res["summary"]
                steps = len(raw["steps"])
                wire = raw["meta"]["wire_bytes"]
                results[m] = {"name": NAMES[m], "job": f"{host} job {j + 1}", "median_step_s": s["median_step_s"],
                              "final_accuracy": s["final_metric"], "bytes_ratio": s["compression_ratio"],
                              "wire_bytes": wire, "wire_bytes_per_step": wire / max(1, steps), "steps": steps,
                              "train_s": s["train_s"], "cf_final": s["cf_final"], "load_average": load,
                              "compression_stats": raw["meta"].get("compression_stats")}
                paths.append(out / m / "results.json")
                print(f"  {m}: median step {1e3 * (s['median_step_s'] or 0):.1f} ms, final accuracy "
                      f"{s['final_metric']:.4f}, wire {wire / max(1, steps) / 1e6:.2f} MB/step", flush=True)
            if rc:
                print(f"  job failed (exit {rc}); last lines:\n" + "\n".join(text.splitlines()[-25:]), flush=True)
            print(f"  {time.monotonic() - t0:.0f} s", flush=True)
    cmp = report.compare(paths, out / "compare") if paths else {"rows": []}
    for row in cmp["rows"]:
        if row["method"] in results:
            results[row["method"]].update(time_to_dense_s=row["time_to_dense_final_s"], target=row["dense_target"],
                                          tta_vs_dense=row["tta_speedup_vs_dense"],
                                          tta_vs_fp16=row["tta_speedup_vs_fp16"])
    summary = {"command": "python -m benchmarks.bench_ddp " + shlex.join(sys.argv[1:]), "rate": args.rate,
               "hosts": args.hosts, "epochs": args.epochs, "width": args.width, "lr": args.lr,
               "batch_size": args.batch_size, "powersgd_start": powersgd_start, "methods": results,
               "targets": targets(results)}
    (out / "ddp.json").write_text(json.dumps(summary, indent=1))
    return summary


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 13's targets, checked on this run's figures (None: a run missing or the target not reached)."""
    ours = r.get("adaptive", {})
    t_ours = ours.get("time_to_dense_s")
    out = []

    def speedup(other: str) -> float | None:
        t = r.get(other, {}).get("time_to_dense_s")
        return None if not (t and t_ours) else t / t_ours

    s = speedup("fp16")
    out.append({"target": "adaptive_hook (defaults) reaches dense accuracy >= 1.3x faster than the DDP fp16 hook",
                "measured": s, "pass": bool(s and s >= 1.3)})
    for k in ("powersgd1", "powersgd4"):
        if k in r:
            s = speedup(k)
            t_other = r[k].get("time_to_dense_s")
            out.append({"target": f"adaptive_hook (defaults) reaches dense accuracy faster than {NAMES[k]}",
                        "measured": s, "pass": bool(t_ours and (t_other is None or t_ours < t_other))})
    d = None
    if ours.get("final_accuracy") is not None and r.get("none", {}).get("final_accuracy") is not None:
        d = ours["final_accuracy"] - r["none"]["final_accuracy"]
    out.append({"target": "adaptive_hook (defaults) final accuracy within 1 point of DDP dense", "measured": d,
                "pass": d is not None and d >= -0.01})
    return out


def format_table(summary: dict[str, Any]) -> str:
    """The side-by-side table (markdown) and the targets."""
    rows = summary["methods"]
    target = next((v.get("target") for v in rows.values() if v.get("target") is not None), None)
    lines = [f"digits MLP (width {summary['width']}), {summary['hosts']} emulated hosts at {summary['rate']}, "
             f"{summary['epochs']} epochs, SGD lr {summary['lr']}, batch {summary['batch_size']} per rank; "
             "target = DDP dense's final accuracy less 1 point" + (f" = {target:.4f}" if target is not None else ""),
             "",
             "| method | step ms | bytes dense/sent (counted) | wire MB/step | final accuracy | time to target s | "
             "TTA vs DDP dense | TTA vs DDP fp16 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v: Any, spec: str, none: str = "-") -> str:
        return none if v is None else format(v, spec)

    for v in rows.values():
        if "failed" in v:
            lines.append(f"| {v['name']} | failed ({v['failed']}) | | | | | | |")
            continue
        tta = v.get("time_to_dense_s")
        lines.append(f"| {v['name']} | {f(v['median_step_s'] and 1e3 * v['median_step_s'], '.1f')} | "
                     f"{f(v['bytes_ratio'], '.1f')} | {v['wire_bytes_per_step'] / 1e6:.2f} | "
                     f"{f(v['final_accuracy'], '.4f')} | {f(tta, '.1f', 'not reached')} | "
                     f"{f(v.get('tta_vs_dense'), '.2f')}x | {f(v.get('tta_vs_fp16'), '.2f')}x |")
    lines += ["", "| target (issue 13) | measured | |", "|---|---:|---|"]
    for t in summary["targets"]:
        meas = t["measured"]
        shown = "-" if meas is None else (f"{100 * meas:+.2f} points" if "points" in t["target"] or "within" in
                                          t["target"] else f"{meas:.2f}x")
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
    p.add_argument("--width", type=float, default=4.0, help="MLP width multiplier: hidden 512 x width (default 4)")
    p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate, no momentum (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the step-time median")
    p.add_argument("--powersgd-start", type=int, default=None,
                   help="PowerSGD's start_powerSGD_iter (default: 10%% of the steps, at least 2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per method before its job is killed")
    p.add_argument("--out", default="results/bench/ddp", help="results folder (default %(default)s)")
    p.add_argument("--json", default=None, help="also write the summary JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
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
    failed = [m for m, v in summary["methods"].items() if "failed" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
