"""Crossover scheduling benchmark: two identical 2-rank Horovod jobs sharing two emulated hosts.

    python benchmarks/bench_crossover.py                      # about 5 minutes; needs root (netem)
    python benchmarks/bench_crossover.py --params 4000000 --batch 1024 --steps 20 --rate auto
    python benchmarks/bench_crossover.py --local --params 25000000    # on this machine's GPU (docs/gpu.md)

Set-up: ``benchmarks.netem.EmulatedCluster`` with 2 hosts joined by full-duplex links; each job's rank i
runs on host i, and each emulated host's "device" is one CPU core: every rank on host i pins itself to
core i (``os.sched_setaffinity``), so job A's and job B's rank i share core i. The model is an MLP of
``--params`` parameters trained on synthetic data; the link rate is chosen (``--rate auto``) so that
communication per step is about compute per step.

Three ways to run the two jobs, in one invocation, printed side by side:

* ``sequential``: job A alone, then job B alone (aggregate throughput = 1 / (C + M) per step);
* ``uncoordinated``: both at once, no scheduler (the cores are time-shared by the OS);
* ``crossover``: both at once, each started as ``python -m horovod_ext.launch`` with the stock
  ``hvd.DistributedOptimizer`` and one scheduler daemon per emulated host
  (``CROSSOVER_SCHED_DIR=<tmp>/{host}``).

C (compute: forward, backward, update) and M (exposed communication: time in ``synchronize()``) are
medians of the sequential runs; the ideal period for one step of each job is ``max(2C, C + M)``
(links not shared) and ``max(2C, 2M)`` with both jobs' traffic on the same links, as here. Also
printed: the scheduler's acquire/release round trip (p50/p99), and the CPU used by other processes
during each run (this machine is shared: that load lowers and scatters every figure).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if not __package__:  # run as a file: its relative imports resolve in the package it belongs to
    __package__ = Path(__file__).resolve().parent.name

MODES = ("sequential", "uncoordinated", "crossover")


# --------------------------------------------------------------------------- the job (runs on each rank)


def build_model(params: int) -> Any:
    """An MLP with about ``params`` parameters: 1024 -> h -> h -> 10."""
    import torch

    h = int((-(1024 + 10) + ((1024 + 10) ** 2 + 4 * params) ** 0.5) / 2)
    return torch.nn.Sequential(torch.nn.Linear(1024, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                               torch.nn.ReLU(), torch.nn.Linear(h, 10))


def pin_to_host_core() -> int:
    """Pin this rank to core ``cross_rank`` (its emulated host's device); return the core."""
    if os.environ.get("BENCH_DEVICE") == "cuda":
        return -1  # the shared device is the GPU: every rank keeps the whole CPU
    core = int(os.environ.get("HOROVOD_CROSS_RANK", "0")) % (os.cpu_count() or 1)
    os.sched_setaffinity(0, {core})
    return core


def worker(args: argparse.Namespace) -> None:
    """One rank of one job: train ``warmup + steps`` steps, rank 0 writes per-step timings."""
    pin_to_host_core()
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dev = os.environ.get("BENCH_DEVICE", "cpu")
    model = build_model(args.params).to(dev)
    gen = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(args.batch, 1024, generator=gen).to(dev)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(dev)
    done = torch.cuda.synchronize if dev == "cuda" else (lambda: None)  # timestamps after the queued work ran
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.allreduce(torch.zeros(1), name="ready")
    ready = time.time()
    t0 = float(os.environ.get("BENCH_T0", "0"))
    if t0 > time.time():
        time.sleep(t0 - time.time())  # both jobs start stepping together (before taking the device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001),
                                   named_parameters=model.named_parameters())
    rows = []
    for _ in range(args.warmup + args.steps):
        a = time.time()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        done()
        b = time.time()
        opt.synchronize()  # under crossover: release, wait for the allreduces, re-acquire
        c = time.time()
        with opt.skip_synchronize():
            opt.step()
        done()
        rows.append((a, b, c, time.time()))
    if hvd.rank() == 0:
        Path(args.result).write_text(json.dumps({"ready": ready, "t0": t0, "rows": rows, "warmup": args.warmup}))


def calibrate(args: argparse.Namespace) -> None:
    """Compute time of one step on one pinned core (or the GPU), no Horovod (prints seconds)."""
    import torch

    dev = os.environ.get("BENCH_DEVICE", "cpu")
    if dev == "cpu":
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    model = build_model(args.params).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x, y = torch.randn(args.batch, 1024, device=dev), torch.randint(0, 10, (args.batch,), device=dev)
    done = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        done()
        times.append(time.perf_counter() - t)
    print(json.dumps({"compute_s": statistics.median(times[1:])}))


# --------------------------------------------------------------------------- measurement helpers


def cpu_busy_jiffies() -> int:
    with open("/proc/stat", encoding="ascii") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]  # minus idle and iowait


def children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class CpuMeter:
    """CPU used by everything on the machine and by our own children between start() and stop()."""

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        self.t, self.busy, self.mine = time.monotonic(), cpu_busy_jiffies(), children_cpu_s()

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self.t
        busy = (cpu_busy_jiffies() - self.busy) / self.hz
        mine = children_cpu_s() - self.mine
        return {"wall_s": wall, "all_cores": busy / wall, "ours_cores": mine / wall,
                "others_cores": max(0.0, busy - mine) / wall}


def job_window(result: dict[str, Any]) -> tuple[list[float], list[dict[str, float]]]:
    """Ends of the measured steps, and per-step compute / sync times."""
    rows = result["rows"][result["warmup"]:]
    ends = [r[3] for r in rows]
    steps = [{"compute": (r[1] - r[0]) + (r[3] - r[2]), "sync": r[2] - r[1], "step": r[3] - r[0]} for r in rows]
    return ends, steps


def rate_in(ends: list[float], lo: float, hi: float) -> float:
    """Steps per second of a job between times lo and hi (from its step ends inside)."""
    inside = [t for t in ends if lo <= t <= hi]
    if len(inside) < 2:
        return 0.0
    return (len(inside) - 1) / (inside[-1] - inside[0])


def round_trip(cycles: int, pin: bool) -> dict[str, float]:
    """Acquire/release round trip in a helper process (pinned to core 0, or not) against a daemon it starts.

    Pinned, the daemon keeps the affinity of the process that starts it (``CROSSOVER_SCHED_KEEP_AFFINITY=1``), as
    in the crossover runs below.
    """
    import subprocess

    argv = [sys.executable, __file__, "--rtt", "--rtt-cycles", str(cycles)] + (["--pin"] if pin else [])
    env = {**os.environ, "CROSSOVER_SCHED_KEEP_AFFINITY": "1" if pin else "0"}
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _round_trip_here(cycles: int, pin: bool) -> dict[str, float]:
    from crossover.scheduler.client import SchedulerClient

    if pin:
        os.sched_setaffinity(0, {0})
    d = tempfile.mkdtemp(prefix="xo-rtt-", dir="/tmp")
    c = SchedulerClient("bench", "rtt", directory=d)
    try:
        if not c.connect(wait=20):
            return {}
        times = []
        for seq in range(cycles + 300):
            t0 = time.perf_counter()
            c.acquire("cpu0", seq)
            c.release("cpu0")
            times.append(time.perf_counter() - t0)
        times = sorted(times[300:])
        return {"p50_us": times[len(times) // 2] * 1e6, "p99_us": times[int(len(times) * 0.99)] * 1e6,
                "max_us": times[-1] * 1e6, "cycles": len(times)}
    finally:
        pid = c.daemon_pid
        c.close()
        if pid:
            os.kill(pid, 15)


# --------------------------------------------------------------------------- driver


def run_jobs(cluster: Any, args: argparse.Namespace, jobs: list[str], crossover: bool, workdir: Path,
             t0: float) -> dict[str, dict[str, Any]]:
    """Run the named jobs at the same time on ``cluster`` (None: on this machine); return each job's rank-0 result."""
    import subprocess

    from . import netem

    out: dict[str, dict[str, Any]] = {}
    errors: list[str] = []

    def one(name: str) -> None:
        result = workdir / f"{name}.json"
        cmd = [sys.executable, *(["-m", "horovod_ext.launch"] if crossover else []), str(Path(__file__)),
               "--worker", "--params", str(args.params), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--result", str(result)]
        env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "BENCH_T0": repr(t0)}
        if args.cycle_time_ms is not None:  # the same Horovod setting for every mode
            env["HOROVOD_CYCLE_TIME"] = f"{args.cycle_time_ms:g}"
        if crossover:
            # each emulated host's daemon stays on that host's core (the set-up measured in docs/scheduler.md)
            env.update(CROSSOVER_SCHED="1", CROSSOVER_JOB=name, CROSSOVER_SCHED_DIR=str(workdir / "sched" / "{host}"),
                       CROSSOVER_TELEMETRY_DIR=str(workdir / "telemetry"), CROSSOVER_SCHED_KEEP_AFFINITY="1")
        else:
            env["CROSSOVER_SCHED"] = "0"
        try:
            if cluster is None:  # --local: as a user starts it, horovodrun on this machine
                env["BENCH_DEVICE"] = args.device
                if crossover:
                    env["CROSSOVER_SCHED_DIR"] = str(workdir / "sched" / "local")
                hvdrun = Path(sys.executable).with_name("horovodrun")
                r = subprocess.run([str(hvdrun) if hvdrun.exists() else "horovodrun", "-np", "2", "--gloo", *cmd],
                                   env={**os.environ, **env}, capture_output=True, text=True, timeout=args.timeout)
                if r.returncode:
                    errors.append(f"{name} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
                    return
            else:
                res = netem.launch_horovod(cluster, 1, cmd, env=env, timeout=args.timeout)
                if any(r.returncode for r in res):
                    errors.append(f"{name} failed:\n{netem.format_rank_output(res)}")
                    return
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {exc}")
            return
        out[name] = json.loads(result.read_text())

    threads = [threading.Thread(target=one, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit("\n".join(errors))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=4_000_000, help="MLP parameters (default 4 M = 16 MB of gradients)")
    p.add_argument("--batch", type=int, default=None, help="batch per rank (default 1024; with --local on a GPU "
                   "chosen so that compute per step is about communication per step)")
    p.add_argument("--local", action="store_true", help="both jobs on this machine, each started by horovodrun -np 2 "
                   "--gloo, on its GPU when it has one (all four ranks on cuda:0; gradients cross host memory over "
                   "Gloo on loopback); no network emulation, no root needed")
    p.add_argument("--steps", type=int, default=20, help="measured steps per job (default %(default)s)")
    p.add_argument("--warmup", type=int, default=6, help="steps not measured (default %(default)s)")
    p.add_argument("--rate", default="auto",
                   help="link rate (tc units, e.g. 300mbit) or 'auto': communication per step ~ compute per step")
    p.add_argument("--repeat", type=int, default=1, help="run every mode this many times, interleaved; "
                                                          "medians are reported (default %(default)s)")
    p.add_argument("--cycle-time-ms", type=float, default=None,
                   help="HOROVOD_CYCLE_TIME for every rank of every mode (default: Horovod's; an idle rank's "
                        "background thread then uses about half a core)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--rtt-cycles", type=int, default=3000, help="acquire/release cycles for the round trip")
    p.add_argument("--timeout", type=float, default=900, help="seconds before a job is killed")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--trace", default=None, help="write the crossover run's Chrome trace here")
    p.add_argument("--workdir", default=None, help="keep every run's files (results, telemetry, daemon logs) here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rtt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.calibrate:
        calibrate(args)
        return 0
    if args.rtt:
        print(json.dumps(_round_trip_here(args.rtt_cycles, args.pin)))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes: choose from {', '.join(MODES)}")

    import subprocess

    from . import netem

    args.device = "cpu"
    if args.local:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        reason = netem.netem_unavailable_reason()
        if reason:
            print(f"bench_crossover: {reason}", file=sys.stderr)
            return 2
    print("command:", " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]), flush=True)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    rtt = round_trip(args.rtt_cycles, pin=True)
    rtt_x = round_trip(args.rtt_cycles, pin=False)
    print(f"acquire/release round trip, worker and daemon on core 0 (as in the runs below): p50 "
          f"{rtt.get('p50_us', 0):.0f} us, p99 {rtt.get('p99_us', 0):.0f} us, max {rtt.get('max_us', 0):.0f} us; "
          f"unpinned: p50 {rtt_x.get('p50_us', 0):.0f} us, p99 {rtt_x.get('p99_us', 0):.0f} us "
          f"({rtt.get('cycles', 0)} cycles each)", flush=True)
    if args.batch is None:
        args.batch = local_batch(args) if args.local and args.device == "cuda" else 1024
    cal = json.loads(subprocess.run([sys.executable, __file__, "--calibrate", "--params", str(args.params),
                                     "--batch", str(args.batch)], capture_output=True, text=True, check=True,
                                    env={**os.environ, "BENCH_DEVICE": args.device}).stdout.strip().splitlines()[-1])
    grad_bits = 8 * 4 * args.params
    rate = "loopback (no emulation)" if args.local else args.rate
    if rate == "auto":  # a 2-rank ring allreduce moves every gradient byte once each way, at ~88% of the rate
        rate = f"{max(10, round(grad_bits / (0.88 * cal['compute_s']) / 1e6))}mbit"
    cycle = "Horovod's default" if args.cycle_time_ms is None else f"{args.cycle_time_ms:g} ms"
    where = "on the GPU" if args.device == "cuda" else "on one core"
    print(f"model: {args.params / 1e6:.1f} M parameters, batch {args.batch}; calibrated compute "
          f"{cal['compute_s'] * 1e3:.0f} ms/step {where}; link {rate} each way; "
          f"HOROVOD_CYCLE_TIME {cycle} (all modes)", flush=True)

    results: dict[str, Any] = {"command": " ".join(sys.argv), "rate": rate, "rtt": rtt, "rtt_unpinned": rtt_x,
                               "calibrated_compute_s": cal["compute_s"], "runs": {m: [] for m in modes}}
    meter = CpuMeter()
    keep = args.workdir is not None
    if keep:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    workdir = contextlib.nullcontext(args.workdir) if keep else tempfile.TemporaryDirectory(prefix="xo-bench-")
    cluster_cm = contextlib.nullcontext(None) if args.local else netem.EmulatedCluster(2, rate)
    with workdir as tmp, cluster_cm as cluster:
        startup = [20.0]
        for rep in range(args.repeat):
            for mode in modes:  # interleaved, so that drift in the machine's load hits every mode alike
                work = Path(tmp) / f"{mode}-{rep}"
                entry = measure(cluster, args, mode, work, meter, startup)
                results["runs"][mode].append(entry)
                print(f"run {rep + 1}/{args.repeat} {mode}: {entry['aggregate_steps_per_s']:.3f} steps/s aggregate; "
                      f"others' CPU {entry['cpu']['others_cores']:.2f} cores over {entry['cpu']['wall_s']:.0f} s",
                      flush=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def local_batch(args: argparse.Namespace, trial: int = 1024) -> int:
    """Batch per rank at which one job alone computes about as long as it waits on its allreduce (--local, GPU)."""
    with tempfile.TemporaryDirectory(prefix="xo-probe-") as tmp:
        probe = argparse.Namespace(**{**vars(args), "batch": trial, "steps": 6, "warmup": 3})
        res = run_jobs(None, probe, ["probe"], False, Path(tmp), 0.0)["probe"]
    _, steps = job_window(res)
    c = statistics.median(x["compute"] for x in steps)
    m = statistics.median(x["sync"] for x in steps)
    batch = max(64, min(65536, round(trial * m / max(c, 1e-6) / 64) * 64))
    print(f"batch probe at {trial}: compute {c * 1e3:.1f} ms, communication {m * 1e3:.1f} ms per step -> "
          f"batch {batch}", flush=True)
    return batch


def measure(cluster: Any, args: argparse.Namespace, mode: str, work: Path, meter: CpuMeter,
            startup: list[float]) -> dict[str, Any]:
    """Run one mode once; return its figures."""
    from crossover.scheduler import telemetry

    (work / "sched").mkdir(parents=True)
    for h in cluster.hosts if cluster is not None else ["local"]:
        (work / "sched" / h).mkdir(mode=0o700)
    meter.start()
    launched = time.time()
    if mode == "sequential":
        res = run_jobs(cluster, args, ["jobA"], False, work, 0.0)
        startup[0] = max(startup[0], res["jobA"]["ready"] - launched)
        res.update(run_jobs(cluster, args, ["jobB"], False, work, 0.0))
    else:
        t0 = time.time() + 1.5 * startup[0] + 3.0
        res = run_jobs(cluster, args, ["jobA", "jobB"], mode == "crossover", work, t0)
    cpu = meter.stop()
    windows = {j: job_window(r) for j, r in res.items()}
    if mode == "sequential":
        agg = sum(len(e) - 1 for e, _ in windows.values()) / sum(e[-1] - e[0] for e, _ in windows.values())
        overlap = None
    else:
        lo = max(e[0] for e, _ in windows.values())
        hi = min(e[-1] for e, _ in windows.values())
        agg = sum(rate_in(e, lo, hi) for e, _ in windows.values())
        span = max(e[-1] - e[0] for e, _ in windows.values())
        overlap = max(0.0, hi - lo) / span if span > 0 else 0.0
    entry: dict[str, Any] = {
        "aggregate_steps_per_s": agg, "overlap_of_runs": overlap, "cpu": cpu,
        "jobs": {j: {"median_step_s": statistics.median(s["step"] for s in st),
                     "median_compute_s": statistics.median(s["compute"] for s in st),
                     "median_sync_s": statistics.median(s["sync"] for s in st)}
                 for j, (_, st) in windows.items()},
    }
    if mode == "crossover" and (work / "telemetry").is_dir():
        streams = telemetry.load(str(work / "telemetry"))
        entry["telemetry"] = telemetry.summarize(streams)
        if args.trace:
            Path(args.trace).write_text(json.dumps(telemetry.chrome_trace(streams)))
    return entry


def report(results: dict[str, Any]) -> None:
    """Print the side-by-side table (medians over repeats)."""
    runs = {m: r for m, r in results["runs"].items() if r}
    agg = {m: statistics.median(e["aggregate_steps_per_s"] for e in r) for m, r in runs.items()}
    c = m = None
    if "sequential" in runs:
        c = statistics.median(j["median_compute_s"] for e in runs["sequential"] for j in e["jobs"].values())
        m = statistics.median(j["median_sync_s"] for e in runs["sequential"] for j in e["jobs"].values())
    n = max(len(r) for r in runs.values())
    print()
    if c is not None and m is not None:
        print(f"measured alone: C (forward+backward+update) = {c * 1e3:.0f} ms, M (exposed communication) = "
              f"{m * 1e3:.0f} ms per step; link {results['rate']}")
        print(f"ideal period for one step of each job: max(2C, C+M) = {max(2 * c, c + m) * 1e3:.0f} ms "
              f"(links not shared), max(2C, 2M) = {max(2 * c, 2 * m) * 1e3:.0f} ms (shared links, this set-up)")
    print(f"{'mode':<14}{'agg steps/s':>12}{'runs':>22}{'step ms A/B':>13}{'vs seq':>8}{'vs uncoord':>11}"
          f"{'% max(2C,C+M)':>15}{'% max(2C,2M)':>14}{'others CPU':>12}")
    seq, unco = agg.get("sequential"), agg.get("uncoordinated")
    for mode in MODES:
        if mode not in runs:
            continue
        each = ",".join(f"{e['aggregate_steps_per_s']:.3f}" for e in runs[mode])
        steps = "/".join(f"{statistics.median(e['jobs'][j]['median_step_s'] for e in runs[mode]) * 1e3:.0f}"
                         for j in runs[mode][0]["jobs"])
        vs_seq = f"{agg[mode] / seq:.2f}x" if seq else "-"
        vs_unco = f"{agg[mode] / unco:.2f}x" if unco else "-"
        ideal1 = ideal2 = "-"
        if c is not None and m is not None:
            ideal1 = f"{100 * agg[mode] / (2 / max(2 * c, c + m)):.0f}%"
            ideal2 = f"{100 * agg[mode] / (2 / max(2 * c, 2 * m)):.0f}%"
        others = statistics.median(e["cpu"]["others_cores"] for e in runs[mode])
        print(f"{mode:<14}{agg[mode]:>12.3f}{each:>22}{steps:>13}{vs_seq:>8}{vs_unco:>11}{ideal1:>15}{ideal2:>14}"
              f"{others:>9.2f} cr")
    rtt, rtt_x = results["rtt"], results.get("rtt_unpinned", {})
    print(f"acquire/release round trip (target p99 <= 200 us): worker and daemon on one core p50 "
          f"{rtt.get('p50_us', 0):.0f} us, p99 {rtt.get('p99_us', 0):.0f} us, max {rtt.get('max_us', 0):.0f} us; "
          f"unpinned p50 {rtt_x.get('p50_us', 0):.0f} us, p99 {rtt_x.get('p99_us', 0):.0f} us")
    print(f"agg steps/s: median over {n} run(s) of each mode (runs: each run's figure); step ms: median step "
          "time of each job; others CPU: cores used by processes outside this benchmark (a shared machine)")
    cross = runs.get("crossover", [])
    if cross and "telemetry" in cross[-1]:
        from crossover.scheduler import telemetry

        print("\nlast crossover run, from the ranks' telemetry (all steps, warm-up included):")
        print(telemetry.format_summary(cross[-1]["telemetry"]))
    for mode in ("uncoordinated", "crossover"):
        for i, e in enumerate(runs.get(mode, [])):
            ov = e.get("overlap_of_runs")
            if ov is not None and ov < 0.8:
                print(f"note: in '{mode}' run {i + 1} the two jobs ran at the same time for only {100 * ov:.0f}% of "
                      "a job's measured steps; its aggregate is measured over that overlap only")


if __name__ == "__main__":
    sys.exit(main())
