"""DDP communication hooks side by side on an emulated network: time to dense accuracy, step time, bytes.

    python -m benchmarks.bench_ddp --rate 1gbit --hosts 2 --epochs 12      # the make-bench run (root)
    python -m benchmarks.bench_ddp --methods none,fp16,adaptive --epochs 2  # a smaller comparison

Every method trains the same digits MLP (benchmarks.models, --width 4: hidden 2048, 4.3 M parameters) on
the same shards, learning rate and epochs, one process per emulated host (crossover.netem: one network
namespace per host, full-duplex links of --rate; needs root):

  none           PyTorch DDP, no hook (dense fp32): its final accuracy is the target
  fp16           DDP with PyTorch's fp16_compress_hook
  powersgd1/4    DDP with PyTorch's powerSGD_hook, rank 1 / 4, one bucket (it fails on Gloo with several),
                 vanilla allreduce for the first 10 % of the steps (--powersgd-start; PyTorch's advice)
  adaptive       DDP with crossover's adaptive_hook, AdaptiveState() defaults (GraVAC)
  hvd-adaptive   Horovod DistributedOptimizer with crossover's AdaptiveCompression() defaults
  topk100        DDP with adaptive_hook, AdaptiveState(policy="static", cf=100) (top-k at 1 %)
  topk100-counts the same with gather="counts" (counts exchanged before the allgather)
  hvd-none       Horovod, no compression

Per method the table gives the median step time, bytes per step as counted by the hook (dense/sent)
and as measured on the emulated links (both directions of every host, headers included), the final
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
METHODS = ("none", "fp16", "powersgd1", "powersgd4", "adaptive", "hvd-adaptive", "topk100", "topk100-counts",
           "hvd-none")
DEFAULT_METHODS = "none,fp16,powersgd1,powersgd4,adaptive,hvd-adaptive,topk100"
NAMES = {"none": "DDP dense (no hook)", "fp16": "DDP fp16_compress_hook", "powersgd1": "DDP PowerSGD rank 1",
         "powersgd4": "DDP PowerSGD rank 4", "adaptive": "DDP adaptive_hook, defaults",
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


def _hook_bytes(method: str, hook_state: Any, dense_per_step: int) -> tuple[int, int, float | None, int | None]:
    """Cumulative (bytes sent, bytes dense, CF, bits) of this rank so far, as the method counts them."""
    if hook_state is None:
        return 0, 0, None, None
    if method.startswith("powersgd"):
        before, after = hook_state.total_numel_before_compression, hook_state.total_numel_after_compression
        return 4 * after, 4 * before, (before / after if after else 1.0), None
    st = hook_state.stats()
    cf = st.get("compression_factor")
    return int(st["bytes_sent"]), int(st["bytes_dense"]), (None if cf is None else float(cf)), st.get("bits")


def worker(cfg: dict[str, Any]) -> None:
    """Train as configured; rank 0 writes raw.json (benchmarks.trainer's format) into cfg['out']."""
    import torch

    from benchmarks.datasets import load_dataset
    from benchmarks.models import build_model, count_parameters
    from benchmarks.trainer import evaluate

    method, host = cfg["method"], cfg["host"]
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
    torch.manual_seed(seed)
    data = load_dataset("digits", None, seed=seed)
    batch = int(cfg["batch_size"])
    per_epoch = data.steps_per_epoch(size, batch)
    total = per_epoch * int(cfg["epochs"])
    model = build_model("mlp", "digits", data.num_classes, width=float(cfg["width"]), in_channels=data.shape[0])
    dense_per_step = sum(p.numel() * 4 for p in model.parameters())
    lr = float(cfg["lr"])
    hook_state: Any = None
    if host == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        from crossover.ddp import AdaptiveState, adaptive_hook

        one_bucket = method.startswith("powersgd")
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024 if one_bucket else None)
        if method == "fp16":
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif one_bucket:
            hook_state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(method[-1]),
                                                     start_powerSGD_iter=max(2, int(cfg["powersgd_start"])))
            net.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
        elif method == "adaptive":
            hook_state = AdaptiveState()
        elif method.startswith("topk100"):
            hook_state = AdaptiveState(policy="static", cf=100,
                                       gather="counts" if method.endswith("counts") else "pad")
        if isinstance(hook_state, AdaptiveState):
            net.register_comm_hook(hook_state, adaptive_hook)
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        train_model, eval_model = net, net.module
    else:
        import horovod.torch as hvd

        from crossover import AdaptiveCompression

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hook_state = AdaptiveCompression() if method == "hvd-adaptive" else None
        kw = {} if hook_state is None else {"compression": hook_state}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                       named_parameters=model.named_parameters(), **kw)
        train_model = eval_model = model
    me = rank == 0
    out = Path(cfg["out"])
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    meta = {"size": size, "parameters": count_parameters(model), "gradient_bytes_dense": dense_per_step,
            "steps_per_epoch": per_epoch, "total_steps": total, "data_info": data.info,
            "num_classes": data.num_classes, "text": False, "metric": "accuracy", "job": "", "host": host}
    comm.allreduce(torch.zeros(1), name="bench.ready")  # start the clock together
    train_s, step, last = 0.0, 0, (0, 0)
    t_start = time.perf_counter()
    for epoch in range(1, int(cfg["epochs"]) + 1):
        t_data = time.perf_counter()
        for x, y in data.train_batches(epoch, rank, size, batch, seed):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(train_model(x), y)
            loss.backward()
            opt.step()
            t1 = time.perf_counter()
            step += 1
            train_s += t1 - t_data
            sent, dense, cf, bits = _hook_bytes(method, hook_state, dense_per_step)
            if hook_state is None or (method.startswith("powersgd") and dense == last[1]):
                d_sent = dense_per_step // 2 if method == "fp16" else dense_per_step  # no counters: dense (or fp16)
                d_dense = dense_per_step
                cf = 2.0 if method == "fp16" else 1.0
            else:
                d_sent, d_dense = sent - last[0], dense - last[1]
            last = (sent, dense)
            if me:
                steps.append({"step": step, "epoch": epoch, "t": round(train_s, 6), "time": round(time.time(), 6),
                              "step_s": round(t1 - t0, 6), "data_s": round(t0 - t_data, 6), "loss": loss.item(),
                              "bytes_sent": d_sent, "bytes_dense": d_dense, "cf": cf, "bits": bits, "lr": lr})
            t_data = time.perf_counter()
        t = time.perf_counter()
        res = evaluate(eval_model, data, False, batch, comm)
        evals.append({"epoch": epoch, "step": step, "train_s": train_s, "wall_s": time.perf_counter() - t_start,
                      "eval_s": time.perf_counter() - t, **res})
        if me:
            log.info("%s epoch %d: accuracy %.4f (train %.1f s)", method, epoch, res["accuracy"], train_s)
    meta["wall_s"] = time.perf_counter() - t_start
    meta["train_s"] = train_s
    if hook_state is not None and hasattr(hook_state, "stats"):
        meta["compression_stats"] = {k: v for k, v in hook_state.stats().items() if k != "policy"}
    if me:
        out.mkdir(parents=True, exist_ok=True)
        (out / "raw.json").write_text(json.dumps({"meta": {**meta, "finished": True}, "steps": steps,
                                                  "evals": evals}))
    if host == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()


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
    from crossover import netem

    try:
        res = netem.launch_horovod(cluster, 1, cmd, env=env, timeout=timeout)
        rc = next((r.returncode for r in res if r.returncode), 0)
    except netem.HorovodTimeout as exc:
        res, rc = exc.results, 124
    return rc, netem.format_rank_output(res)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every method on one emulated cluster, one after another; results written to args.out."""
    from benchmarks import report
    from crossover import netem

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    steps_total = (1437 // args.hosts // args.batch_size) * args.epochs  # digits: 1437 training images
    powersgd_start = args.powersgd_start if args.powersgd_start is not None else max(2, steps_total // 10)
    results: dict[str, Any] = {}
    paths = []
    with netem.EmulatedCluster(args.hosts, args.rate) as cluster:
        for i, m in enumerate(methods):
            run_dir = out / m
            (run_dir / "raw.json").unlink(missing_ok=True)
            host = "horovod" if m.startswith("hvd-") else "ddp"
            cfg = {"method": m, "host": host, "label": "none" if m == "none" else m, "compression": m,
                   "model": "mlp", "dataset": "digits", "data": None, "width": args.width, "epochs": args.epochs,
                   "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "warmup": args.warmup,
                   "hosts": args.hosts, "np": 1, "bandwidth": args.rate, "target": None,
                   "powersgd_start": powersgd_start, "out": str(run_dir)}
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.json").write_text(json.dumps(cfg, indent=1))
            cmd = [sys.executable, "-m", "benchmarks.bench_ddp", "--worker", str(run_dir / "config.json")]
            before = [cluster.link_bytes(h) for h in range(args.hosts)]
            t0 = time.monotonic()
            print(f"[{i + 1}/{len(methods)}] {m}: {NAMES[m]}", flush=True)
            if host == "ddp":
                rc, text = _run_ddp(cluster, cmd, env, 29500 + i, args.timeout)
            else:
                rc, text = _run_horovod(cluster, cmd, env, args.timeout)
            after = [cluster.link_bytes(h) for h in range(args.hosts)]
            (run_dir / "job.log").write_text(text)
            raw_path = run_dir / "raw.json"
            if rc or not raw_path.exists():
                print(f"  {m} failed (exit {rc}); last lines:\n" + "\n".join(text.splitlines()[-25:]), flush=True)
                results[m] = {"failed": rc or "no result"}
                continue
            raw = json.loads(raw_path.read_text())
            res = report.write_run(raw, cfg, run_dir, plots=False)
            wire = sum(a[0] - b[0] for a, b in zip(after, before))  # every host's upload = all traffic once
            steps = len(raw["steps"])
            s = res["summary"]
            results[m] = {"name": NAMES[m], "median_step_s": s["median_step_s"], "final_accuracy": s["final_metric"],
                          "bytes_ratio": s["compression_ratio"], "wire_bytes": wire,
                          "wire_bytes_per_step": wire / max(1, steps), "steps": steps, "train_s": s["train_s"],
                          "job_s": time.monotonic() - t0, "cf_final": s["cf_final"],
                          "compression_stats": raw["meta"].get("compression_stats")}
            paths.append(run_dir / "results.json")
            print(f"  median step {1e3 * (s['median_step_s'] or 0):.1f} ms, final accuracy {s['final_metric']:.4f}, "
                  f"wire {wire / max(1, steps) / 1e6:.2f} MB/step, {time.monotonic() - t0:.0f} s", flush=True)
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
             f"target = DDP dense's final accuracy" + (f" = {target:.4f}" if target is not None else ""), "",
             "| method | step ms | bytes dense/sent (counted) | wire MB/step | final accuracy | time to target s | "
             "TTA vs DDP dense | TTA vs DDP fp16 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v: Any, spec: str, none: str = "-") -> str:
        return none if v is None else format(v, spec)

    for m, v in rows.items():
        if "failed" in v:
            lines.append(f"| {NAMES.get(m, m)} | failed ({v['failed']}) | | | | | | |")
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
    from crossover import netem

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
