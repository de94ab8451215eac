"""`make bench`: run the benchmark matrix that fits this machine and regenerate reports/BENCHMARKS.md from it.

    python -m benchmarks.run_all                 # the default matrix (about 2 h 45 min on 2 cores; root for netem)
    python -m benchmarks.run_all --quick         # tiny sizes: checks that every piece runs (a few minutes)
    python -m benchmarks.run_all --only tta,crossover --report reports/BENCHMARKS.md
    python -m benchmarks.run_all --only tta-lstm --merge   # re-run one section into the last run's outputs
    python -m benchmarks.run_all --large --data-root /data   # 4 hosts, 10 Gbit/s, real data sets (hours)

Every figure in the report comes from this run: each section records its exact command, its printed
output and its plots (copied to reports/img/bench/). Sections that need the emulated network are skipped,
with the reason, when it is unavailable (not root, no `tc`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .report import FINAL_WINDOW

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent  # this package's folder
IMG = Path("reports/img/bench")
HISTORY = Path("reports/history/early-benchmarks.md")  # the hand-written analysis of earlier runs


def image_dir(report: Path) -> Path:
    """Where a report's plots go: reports/img/bench for BENCHMARKS.md, reports/img/<report name> for another report in
    reports/, <report name>-img beside a report kept elsewhere (a scratch report under results/ then leaves nothing in
    reports/ to commit by accident)."""
    if (REPO / report).resolve().parent != (REPO / IMG.parent.parent).resolve():
        return report.parent / f"{report.stem}-img"
    return IMG if report.name == "BENCHMARKS.md" else IMG.parent / report.stem

#: the time-to-accuracy matrix (issue 12): what a user could fix by hand, and the adaptive methods with
#: their defaults (`gravac` is `AdaptiveCompression()` exactly as the README writes it; `dqsgd` is
#: `AdaptiveCompression(policy="dqsgd", total_steps=T)`)
TTA_METHODS = ["none", "fp16", "topk:10", "topk:100", "topk:1000", "dqsgd", "gravac"]
#: the recipe sections (issue 33): the oracle's candidates and AdaptiveCompression() with no settings
RECIPE_METHODS = ["none", "fp16", "topk:10", "topk:100", "topk:1000", "powersgd:10", "gravac"]
#: seeds of every time-to-accuracy section (issue 33: a final accuracy is a median over at least 3 seeds)
SEEDS = 3
#: steps each method runs per turn in a side-by-side section
SIDE_BY_SIDE_BLOCK = 10


@dataclass(frozen=True)
class TtaTask:
    """One workload of the time-to-accuracy matrix: a task, a link, and how long and how often to evaluate."""

    key: str
    title: str
    args: tuple[str, ...]
    hosts: int
    rate: str
    length: tuple[str, ...]  # --epochs N [--max-steps M]
    eval_every: int
    repeats: int = 1
    note: str = ""
    compute_bound: bool = False  # compression cannot pay here: issue 12 also asks for <= 1.05x dense's time
    side_by_side: bool = False  # every method of a repeat in one job, in turns (crossover-bench --side-by-side)
    methods: tuple[str, ...] = tuple(TTA_METHODS)
    minutes: float = 0.0  # estimated minutes of the whole section at full size on 2 quiet cores


def tta_tasks(quick: bool) -> list[TtaTask]:
    """The workloads: digits MLP (2 hosts at 100 Mbit/s and 1 Gbit/s, 4 hosts at 1 Gbit/s), an LSTM language
    model and VGG-16 on learnable synthetic data at 1 Gbit/s, ResNet-18 CIFAR (compute-bound here)."""
    mlp = ("--model", "mlp", "--dataset", "digits", "--lr", "0.2", "--momentum", "0")
    synth = ("--data", "synthetic")
    digits_len = ("--epochs", "2", "--steps-per-epoch", "4") if quick else ("--epochs", "20")
    short = ("--epochs", "1", "--max-steps", "6") if quick else None
    # Repeats (each on its own seed, tta_runs): one run per method let a slow phase of this shared 2-core machine
    # decide a section. In the run of commit 4c786ca the single AdaptiveCompression() runs of the LSTM and
    # ResNet-18 sections ran their steps 15 to 20 % slower than the static runs at the same CF, and an A/B
    # right after, in alternating order, showed no such gap (reports/history/gravac-runs.md, "Run F").
    return [
        TtaTask("tta-100mbit", "digits MLP (width 1), 2 emulated hosts at 100 Mbit/s", (*mlp, "--width", "1"), 2,
                "100mbit", digits_len, 5, repeats=1 if quick else SEEDS, minutes=10),
        TtaTask("tta-1gbit", "digits MLP (width 4), 2 emulated hosts at 1 Gbit/s", (*mlp, "--width", "4"), 2,
                "1gbit", digits_len, 5, repeats=1 if quick else SEEDS, minutes=19),
        # Side by side (every method of a repeat in one job, in turns of 10 steps): run by run, with 4 ranks on 2
        # cores, the adaptive runs took 0.70x to 1.49x static top-k 100x's time over four seeds while sending the
        # same CF on the same steps (reports/history/gravac-runs.md, "Runs G and H"): separate runs compared the
        # machine's phases.
        TtaTask("tta-1gbit-4hosts", "digits MLP (width 4), 4 emulated hosts at 1 Gbit/s (2 cores: 2 ranks share "
                "a core), methods side by side", (*mlp, "--width", "4"), 4, "1gbit", digits_len, 5,
                repeats=1 if quick else SEEDS, side_by_side=True, minutes=33),
        # 300 steps with a cosine learning rate: at a constant rate, cut at 150 steps, every curve still fell 4 %
        # per 10 steps at the end (dense: 9.45, 8.64, 8.20, 7.89), so a run one evaluation behind missed dense's
        # final perplexity. Decayed over 300 steps (seed 0, one trial run), dense held within 1 % of its final
        # perplexity for its last 50 steps.
        TtaTask("tta-lstm", "2-layer LSTM language model (half width), synthetic text (a 100-word random walk), "
                "300 steps with a cosine learning rate, 2 emulated hosts at 1 Gbit/s",
                ("--model", "lstm", "--dataset", "ptb", "--width", "0.5", "--vocab-size", "100", *synth,
                 "--eval-samples", "4096", "--lr-schedule", "cosine"), 2,
                "1gbit", short or ("--epochs", "1", "--max-steps", "300"), 10, repeats=1 if quick else SEEDS,
                minutes=23),
        # One whole epoch (156 steps) with a cosine learning rate: at a constant rate, cut at 120 steps, every
        # method's accuracy still swung by up to 38 points between evaluations 5 steps apart at the end (dense:
        # 0.99, 0.61, 0.78, ..., 0.99, 0.89), so "dense's final accuracy" was one sample of a swinging curve
        # and the same method reached the target in one repeat and not in the other. Decayed, every curve
        # settles (dense: 1.00 from step 100 on) and the target is one dense holds. Three repeats: two runs of
        # two repeats gave 0.98x and 1.54x, the second with one repeat in a slow phase of the machine (steps of
        # 144 ms to 1.4 s at one CF); the median of three is not decided by one such phase.
        TtaTask("tta-vgg16", "VGG-16 (ImageNet head, 32x32 inputs, quarter width), synthetic images (noise 0.5), "
                "one epoch with a cosine learning rate, 2 emulated hosts at 1 Gbit/s",
                ("--model", "vgg16", "--dataset", "imagenet", "--image-size", "32", "--width", "0.25",
                 "--num-classes", "10", "--batch-size", "32", "--lr", "0.01", "--lr-schedule", "cosine", *synth,
                 "--synthetic-noise", "0.5", "--eval-samples", "512"), 2, "1gbit",
                short or ("--epochs", "1"), 5, repeats=1 if quick else SEEDS, minutes=25),
        # Side by side: its target (<= 1.05x dense) is finer than the spread of separate runs here (dense alone
        # took 16.6 to 25.6 s over three seeds in run H, its 20-step medians 176 to 272 ms). A cosine learning
        # rate: at a constant rate cut at 100 steps, dense's accuracy still rose from 0.908 to 0.959 and from 0.807
        # to 0.900 over the last 10 steps on seeds 1 and 3 (2026-11-23), so the target sat on a steep slope at the
        # last evaluation and a run one step behind missed it (as the LSTM and VGG-16 sections found before).
        TtaTask("tta-resnet18", "ResNet-18 (CIFAR shape, quarter width), synthetic images (noise 0.5), 100 steps "
                "with a cosine learning rate, 2 emulated hosts at 1 Gbit/s: compute-bound here, compression cannot "
                "pay; methods side by side",
                ("--model", "resnet18", "--dataset", "cifar10", "--width", "0.25", *synth, "--synthetic-noise", "0.5",
                 "--eval-samples", "512", "--lr-schedule", "cosine"), 2, "1gbit",
                # every 4 steps: the target falls near step 90, so a time to it is resolved to about 4 %
                short or ("--epochs", "1", "--max-steps", "100"), 4,
                repeats=1 if quick else SEEDS, compute_bound=True, side_by_side=True, minutes=13),
        *recipe_tasks(quick),
        lowrank_task(quick),
        lm_task(quick),
    ]


#: seeds of the transformer LM section: issue 33's verdicts need 3
LM_SEEDS = 3


def lm_task(quick: bool) -> TtaTask:
    """Issue 46's transformer recipe: the small decoder-only byte-level LM (d_model 128, 2 layers, 438 k parameters)
    with crossover-bench's transformer defaults (AdamW lr 0.001, weight decay 0.01, warm-up over 5 % of the steps
    then cosine to 0, clipping at norm 1), on CPython's documentation text, each method its own job. 100 steps of
    16 windows of 64 bytes per rank: dense takes 17 to 21 s of training at 100 Mbit/s."""
    return TtaTask("tta-lm", "byte-level transformer LM (d_model 128, 2 layers) on CPython's pydoc topics with AdamW, "
                   "warm-up then cosine, clipping at 1; 100 steps, 2 emulated hosts at 100 Mbit/s, each method its "
                   "own job", ("--model", "transformer", "--dataset", "pydoc", "--eval-samples", "8192"), 2,
                   "100mbit", ("--epochs", "1", "--max-steps", "6" if quick else "100"), 5,
                   repeats=1 if quick else LM_SEEDS, minutes=6,
                   methods=("none", "fp16", "gravac", "topk:10", "powersgd:10", "powersgd:30"))


def lowrank_task(quick: bool) -> TtaTask:
    """Low rank (StaticCompression("powersgd")) against the fixed choices under momentum SGD, each method its own
    job (as users run them), on the MNIST CNN recipe at 100 Mbit/s (the recipe whose top-k 100x lost accuracy)."""
    momentum = ("--optimizer", "sgd", "--lr", "0.02", "--momentum", "0.9", "--weight-decay", "5e-4")
    return TtaTask("tta-lowrank-mnist-cnn", "CNN on the MNIST sample with SGD momentum 0.9 and weight decay 5e-4 "
                   "(lr 0.02), 2 emulated hosts at 100 Mbit/s, each method its own job",
                   ("--model", "cnn", "--dataset", "mnist", *momentum), 2, "100mbit",
                   ("--epochs", "1", "--max-steps", "6") if quick else ("--epochs", "3"), 10,
                   repeats=1 if quick else SEEDS, minutes=15,
                   methods=("none", "fp16", "topk:10", "topk:100", "gravac", "powersgd:10", "powersgd:30",
                            "powersgd:50"))


def recipe_tasks(quick: bool) -> list[TtaTask]:
    """Issue 33's recipes, each side by side on 3 seeds with the oracle's candidates and AdaptiveCompression():
    the digits MLP 64-1024-1024-10 (width 2, 1.1 M parameters) with momentum SGD and weight decay, with AdamW, and
    with momentum SGD under a step schedule, at 300 Mbit/s; the CNN on the MNIST sample with momentum SGD at
    100 Mbit/s. Every link is one where compression pays (dense's step is mostly communication)."""
    mlp = ("--model", "mlp", "--dataset", "digits", "--width", "2")

    def momentum(lr: str) -> tuple[str, ...]:
        return ("--optimizer", "sgd", "--lr", lr, "--momentum", "0.9", "--weight-decay", "5e-4")

    # 20 epochs (440 steps): momentum SGD reaches dense's accuracy less 1 point near epoch 8, so the rest of the
    # run is where a gap that opens after the target shows; evaluations every 5 steps: the final window (last
    # 10 %) averages 9 of them
    digits_len = ("--epochs", "2", "--steps-per-epoch", "4") if quick else ("--epochs", "20")
    # 3 epochs (186 steps): the CNN ends near 95 %; every 10 steps: the final window averages 2 or 3
    # evaluations of the 1 000 test images
    mnist_len = ("--epochs", "1", "--max-steps", "6") if quick else ("--epochs", "3")
    reps = 1 if quick else SEEDS
    common = {"repeats": reps, "side_by_side": True, "methods": tuple(RECIPE_METHODS)}
    return [
        TtaTask("tta-recipe-momentum", "digits MLP (width 2) with SGD momentum 0.9 and weight decay 5e-4 (lr 0.05), "
                "2 emulated hosts at 300 Mbit/s, methods side by side", (*mlp, *momentum("0.05")), 2, "300mbit",
                digits_len, 5, minutes=7, **common),
        TtaTask("tta-recipe-adamw", "digits MLP (width 2) with AdamW (crossover-bench's defaults: lr 0.001, weight "
                "decay 0.01), 2 emulated hosts at 300 Mbit/s, methods side by side",
                (*mlp, "--optimizer", "adamw"), 2, "300mbit", digits_len, 5, minutes=7, **common),
        TtaTask("tta-recipe-step", "digits MLP (width 2) with SGD momentum 0.9 and weight decay 5e-4 (lr 0.05), "
                "the learning rate x0.1 at 50 % and 75 % of the steps, 2 emulated hosts at 300 Mbit/s, methods "
                "side by side", (*mlp, *momentum("0.05"), "--lr-schedule", "step"), 2, "300mbit", digits_len, 5,
                minutes=7, **common),
        TtaTask("tta-recipe-mnist-cnn", "CNN (421 642 parameters) on the MNIST sample (4 000 train / 1 000 test "
                "images) with SGD momentum 0.9 and weight decay 5e-4 (lr 0.02), 2 emulated hosts at 100 Mbit/s, "
                "methods side by side", ("--model", "cnn", "--dataset", "mnist", *momentum("0.02")), 2, "100mbit",
                mnist_len, 10, minutes=8, **common),
    ]


def tta_runs(out: Path, task: TtaTask) -> list[Run]:
    """Every method of the matrix on one workload: same task, steps, learning rate and evaluation points."""
    common = [*task.args, "--hosts", str(task.hosts), "--bandwidth", task.rate, *task.length, "--warmup", "5",
              "--eval-every", str(task.eval_every)]
    runs = []
    if task.side_by_side:
        from .cli import method_dir

        for rep in range(1, task.repeats + 1):
            sbs = out / f"side-by-side-{rep}"
            argv = [sys.executable, "-m", f"{__package__}.cli", *common, "--seed", str(rep - 1), "--side-by-side",
                    ",".join(task.methods), "--block", str(SIDE_BY_SIDE_BLOCK), "--out", str(sbs)]
            runs.append(Run(argv, [sbs / method_dir(m) / "results.json" for m in task.methods]))
        return runs
    for rep in range(1, task.repeats + 1):
        # Repeat N runs with seed N-1 (model, data order, synthetic data): repeats with one seed would sample only
        # the machine's timing noise, and a method's luck on one seed (VGG-16: 1.04x the oracle on seed 0, 1.17x
        # on seed 2) would pass for its behaviour. Every method of a repeat shares its seed.
        for m in task.methods:
            label = m if task.repeats == 1 else f"{m}@{rep}"
            runs.append(_bench(out, *common, "--seed", str(rep - 1), "--compression", m, label=label))
    return runs


@dataclass
class Run:
    """One command of a section; ``results``: the results.json files it writes (crossover-bench runs: one, or one
    per method side by side)."""

    argv: list[str]
    results: list[Path] = field(default_factory=list)


@dataclass
class Section:
    """A part of the report: what it shows, the commands that measure it, and how to render it."""

    key: str
    title: str
    about: str
    runs: list[Run]
    needs_netem: bool = False
    render: Callable[[Section, Path], str] | None = None
    images: list[Path] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    status: str = "not run"
    seconds: float = 0.0
    minutes: float = 0.0  # estimated minutes at full size on 2 quiet cores (from the last measured runs)


def _bench(out: Path, *args: str, label: str | None = None) -> Run:
    run_dir = out / (label or args[args.index("--compression") + 1]).replace(":", "").replace("@", "-")
    argv = [sys.executable, "-m", f"{__package__}.cli", *args, "--out", str(run_dir)]
    if label:
        argv += ["--label", label]
    return Run(argv, [run_dir / "results.json"])


def sections(out: Path, quick: bool, large: bool, data_root: str | None) -> list[Section]:
    """The matrix: micro-benchmarks, time to accuracy at 100 Mbit/s and 1 Gbit/s, workloads, crossover."""
    py = sys.executable
    small = ["--numel", "2000000"] if quick else []
    s = [
        Section("compressors", "Compressor cost on one core",
                "Compress + decompress time of each compressor relative to one read pass over the gradient "
                "(25 M float32 elements, a ResNet-50 gradient). A compressor costing more CPU than the "
                "communication it saves is a regression. The targets (top-k class <= 6x, fp16 round trip "
                "<= 2x a read pass) are checked in the output; an fp16 round trip moves 12 bytes per element "
                "against the read pass's 4, so its 2x target is hard on a CPU.",
                [Run(["taskset", "-c", "0", py, str(HERE / "bench_compressors.py"), "--no-fallback", "--json",
                      str(out / "compressors.json"), *small])], minutes=0.5),
        Section("quantizer", "Quantizer cost on one core",
                "QSGD-style stochastic quantization (C kernels) against a read pass and a naive torch version.",
                [Run(["taskset", "-c", "0", py, str(HERE / "bench_quantize.py"), "--json", str(out / "quantize.json"),
                      *small])], minutes=0.5),
        Section("step", "Training-step time on an emulated 1 Gbit/s link, 2 hosts",
                "One process per emulated host, every method in the same processes, interleaved in blocks of 10 "
                "steps; a 12 M parameter MLP (communication-bound). `adaptive` is `AdaptiveCompression()` with its "
                "defaults; "
                "`adaptive-off` measures the overhead of the hook with compression off. `adaptive`'s step ms is "
                "the median of all its steps, searches included; the settled columns give the steps it ran "
                "settled, the CF it settled on most and their median, to compare with the static row of that "
                "CF (its policy times the wall time between its own steps: one step in each block of 10 "
                "includes the other methods' turns).",
                [Run([py, "-m", f"{__package__}.bench_step", "--methods",
                      "dense,hvd-fp16,fp16,topk:100,adaptive,adaptive-off",
                      "--params", "2000000" if quick else "12000000", "--steps", "5" if quick else "60",
                      "--rate", "1gbit", "--json", str(out / "step.json")])], needs_netem=True, minutes=3),
        Section("breakdown", "Horovod path vs DDP hook, per-step breakdown, 2 emulated hosts at 300 Mbit/s",
                "Issue 30: a small CNN (420 k parameters) trained by every method in the same two processes (one "
                "per emulated host), Horovod and torch.distributed side by side, in turns of 10 steps that rotate "
                "every round: the median step and its phases, crossover's own work, the collectives after "
                "Horovod's fusion and its negotiation (timeline), and the targets as per-round paired ratios. "
                "Also written to reports/hvd-breakdown.md.",
                [Run([py, "-m", f"{__package__}.bench_breakdown", "--rounds", "2" if quick else "40",
                      "--warmup", "10" if quick else "60", "--json", str(out / "breakdown.json"),
                      *(["--md", ""] if quick else [])])],
                needs_netem=True, minutes=3),
        Section("dqsgd", "DQ-SGD on the digits task",
                "Dense, DQ-SGD and static QSGD train the digits MLP for the same epochs (loopback, 2 ranks).",
                [Run([py, "-m", f"{__package__}.bench_dqsgd", "--epochs", "3" if quick else "20",
                      "--out", str(out / "dqsgd")])], images=[out / "dqsgd.png"], minutes=0.5),
    ]
    for task in tta_tasks(quick):
        s.append(Section(
            task.key, f"Time to accuracy: {task.title}",
            "Every method trains the same model for the same steps with the same optimizer and learning rate; "
            "a run's final accuracy (perplexity, validation loss) is the mean of its evaluations over the last "
            f"{100 * FINAL_WINDOW:.0f} % of its steps; the target is the dense fp32 run's final accuracy less 1 "
            f"point (perplexity: plus 1%; validation loss: plus 2%), checked every {task.eval_every} steps. "
            + ("`gravac` and `dqsgd` run with their defaults. " if "dqsgd" in task.methods
               else "`gravac` runs with its defaults. ")
            + "The oracle static choice is the fastest to the target of the fixed choices (dense, fp16, static top-k, "
            "low rank) that kept dense's accuracy on this workload"
            + (f"; {task.repeats} repeats of each method, repeat N on seed N-1 (medians; the spread in brackets), "
               "the final accuracy of each method beside dense's own seed-to-seed spread." if task.repeats > 1
               else ".")
            + (f" Side by side: each repeat is one job that trains every method in turns of {SIDE_BY_SIDE_BLOCK} "
               "steps on the same batches, each on its own clock (its own steps and data loading), so that a slow "
               "phase of the machine falls on every method alike; an adaptive method sees the others' turns as "
               "pauses between two of its steps, which its policy leaves out of its step times."
               if task.side_by_side else ""),
            tta_runs(out / task.key, task), needs_netem=True, render=render_compare, minutes=task.minutes))
    s.append(Section(
        "ddp", "PyTorch DDP communication hooks at 1 Gbit/s, 2 emulated hosts",
        "The digits MLP (width 4: 4.3 M parameters) trained by PyTorch DDP with no hook (dense), PyTorch's "
        "fp16_compress_hook and powerSGD_hook (rank 1 and 4, one bucket, vanilla allreduce for the first 10 % "
        "of the steps), crossover's adaptive_hook with the defaults told the plain SGD's momentum "
        "(AdaptiveState(momentum=0)) and with static top-k 100, "
        "and Horovod with AdaptiveCompression() defaults: same task, link, epochs and "
        "learning rate (SGD 0.2); the DDP methods train side by side in one job. "
        "Wire bytes are measured on the emulated links; the target is DDP dense's final accuracy, checked once "
        "per epoch (docs/ddp.md).",
        [Run([py, "-m", f"{__package__}.bench_ddp", "--rate", "1gbit", "--hosts", "2",
              "--epochs", "1" if quick else "12", "--out", str(out / "ddp"), "--json", str(out / "ddp.json")])],
        needs_netem=True, minutes=3))
    psgd = "none,fp16,powersgd1,powersgd2,powersgd4,adaptive"
    ddp_common = ["--own-jobs", "--methods", psgd, "--seeds", "0" if quick else "0,1,2"]
    s.append(Section(
        "ddp-momentum", "PyTorch DDP under momentum SGD and AdamW: AdaptiveState() against PyTorch's PowerSGD",
        "Issue 46 (c): the DDP hook with the defaults (AdaptiveState(), shown the optimizer) against PyTorch's "
        "powerSGD_hook at ranks 1, 2 and 4 (one bucket, vanilla allreduce for the first 10 % of the steps), the "
        "fp16 hook and dense, each method its own job, 3 seeds: the CNN on the MNIST sample with SGD momentum 0.9 "
        "(100 Mbit/s), the digits MLP (width 2) with AdamW and with SGD momentum 0.9 (300 Mbit/s). Time to target "
        "reads a moving mean of 3 evaluations.",
        [Run([py, "-m", f"{__package__}.bench_ddp", "--model", "cnn", "--dataset", "mnist", "--momentum", "0.9",
              "--weight-decay", "5e-4", "--lr", "0.02", "--rate", "100mbit", "--epochs", "1" if quick else "3",
              "--eval-every", "10", *ddp_common, "--out", str(out / "ddp-momentum" / "cnn")]),
         Run([py, "-m", f"{__package__}.bench_ddp", "--model", "mlp", "--width", "2", "--optimizer", "adamw",
              "--lr", "0.001", "--weight-decay", "0.01", "--rate", "300mbit", "--epochs", "1" if quick else "20",
              "--eval-every", "5", *ddp_common, "--out", str(out / "ddp-momentum" / "mlp-adamw")]),
         Run([py, "-m", f"{__package__}.bench_ddp", "--model", "mlp", "--width", "2", "--momentum", "0.9",
              "--weight-decay", "5e-4", "--lr", "0.05", "--rate", "300mbit", "--epochs", "1" if quick else "20",
              "--eval-every", "5", *ddp_common, "--out", str(out / "ddp-momentum" / "mlp-momentum")])],
        needs_netem=True, minutes=20))
    s.append(Section(
        "crossover", "Crossover scheduling: two jobs sharing two emulated hosts",
        "Two identical 2-rank jobs, one rank per emulated host, each host's device one pinned core; one "
        "after the other, both at once without the scheduler, both under crossover (interleaved repeats).",
        [Run([py, str(HERE / "bench_crossover.py"), "--repeat", "1" if quick else "2", "--steps", "5" if quick
              else "20", "--params", "1000000" if quick else "4000000", "--json", str(out / "crossover.json")]),
         _bench(out / "crossover-timeline", "--model", "mlp", "--dataset", "digits", "--width", "4", "--hosts", "2",
                "--bandwidth", "300mbit", "--epochs", "1", "--max-steps", "12" if quick else "40", "--crossover",
                "--compression", "none")],
        needs_netem=True, images=[out / "crossover-timeline" / "none" / "timeline.png"], minutes=6))
    if large:
        root = data_root or "synthetic"
        for rate in ("1gbit", "10gbit"):
            for name, task in (
                ("cifar10-resnet18", ["--model", "resnet18", "--dataset", "cifar10",
                                      "--data", f"{root}/cifar-10-batches-py" if data_root else "synthetic"]),
                ("imagenet-resnet50", ["--model", "resnet50", "--dataset", "imagenet",
                                       "--data", f"{root}/imagenet" if data_root else "synthetic"]),
                ("ptb-lstm", ["--model", "lstm", "--dataset", "ptb", "--data", f"{root}/ptb" if data_root
                              else "synthetic"]),
            ):
                big = TtaTask(f"large-{name}-{rate}", f"{name} on 4 emulated hosts at {rate}", tuple(task), 4, rate,
                              ("--epochs", "1"), 50)
                s.append(Section(big.key, big.title,
                                 "The larger matrix (--large): real data sets when --data-root is given.",
                                 tta_runs(out / big.key, big), needs_netem=True, render=render_compare))
    return s


#: --quick: most of a tiny command's time is starting Python, torch and Horovod (and the emulated hosts)
QUICK_MINUTES_PER_COMMAND = 0.5


def _estimate(secs: list[Section], quick: bool) -> str:
    """The estimated time of ``secs`` on 2 quiet cores, as a phrase."""
    if quick:
        return f"about {QUICK_MINUTES_PER_COMMAND * sum(len(s.runs) for s in secs):.0f} min (--quick)"
    known = sum(s.minutes for s in secs)
    unknown = [s.key for s in secs if not s.minutes]
    text = f"about {known:.0f} min" if known >= 1 else "under a minute" if known else "unknown"
    return text + (f" plus {', '.join(unknown)} (no estimate)" if unknown and known else "")


def render_compare(section: Section, img_dir: Path) -> str:
    """The comparison table of a section's crossover-bench runs, and its plots."""
    from . import report

    paths = [p for r in section.runs for p in r.results if p.is_file()]
    if not paths:
        return "_no run finished_\n"
    res = report.compare(paths, _compare_dir(section))
    section.images += [Path(f) for f in res["files"] if f.endswith(".png")]
    return res["table"] + "\n"


def run_section(sec: Section, log_dir: Path, netem_reason: str | None) -> None:
    """Run every command of a section, keeping each one's output."""
    if sec.needs_netem and netem_reason:
        sec.status = f"skipped: {netem_reason}"
        return
    t0 = time.monotonic()
    failed = 0
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for i, run in enumerate(sec.runs):
        print(f"\n[{sec.key} {i + 1}/{len(sec.runs)}] $ {shlex.join(_show(run.argv))}", flush=True)
        proc = subprocess.run(run.argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, stdin=subprocess.DEVNULL)
        text = proc.stdout
        (log_dir / f"{sec.key}-{i}.log").write_text(text)
        tail = "\n".join(text.rstrip().splitlines()[-12:])
        print(tail, flush=True)
        if proc.returncode != 0:
            failed += 1
            text += f"\n(exit status {proc.returncode})"
        sec.outputs.append(text)
    sec.seconds = time.monotonic() - t0
    sec.status = "ok" if not failed else f"{failed} of {len(sec.runs)} command(s) failed"


def _show(argv: list[str]) -> list[str]:
    """A command as a user would type it (repo-relative paths, `python` for this interpreter, other absolute
    paths by their name only: a report holds no path of the machine it ran on)."""
    shown = []
    for a in argv:
        if a == sys.executable:
            a = "python"
        elif a.startswith(str(REPO) + "/"):
            a = os.path.relpath(a, REPO)
        elif os.path.isabs(a):  # a path elsewhere on this machine: only its name
            a = ".../" + os.path.basename(a)
        shown.append(a)
    return shown


def _excerpt(text: str, limit: int = 60) -> str:
    """The part of a benchmark's output worth printing in the report (its last lines, progress bars out,
    paths inside the repository shown relative to it: a report holds no path of the machine it ran on)."""
    text = text.replace(str(REPO) + os.sep, "")
    lines = [ln for ln in text.rstrip().splitlines() if "\r" not in ln and "it/s]" not in ln]
    return "\n".join(lines[-limit:])


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    def version(mod: str) -> str:
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing framework is just reported
            return "not installed"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    return {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), "commit": commit,
            "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": version("torch"), "horovod": version("horovod"), "load": os.getloadavg()[0]}


def targets(secs: list[Section]) -> list[str]:
    """The issues' performance targets, checked against what this run measured."""
    lines = []
    by_key = {s.key: s for s in secs}
    for sec in secs:
        if sec.key.startswith("tta") and sec.status == "ok":
            lines += _tta_targets(sec)
    ddp = by_key.get("ddp")
    if ddp is not None and ddp.status == "ok" and "--json" in ddp.runs[0].argv:
        path = Path(ddp.runs[0].argv[ddp.runs[0].argv.index("--json") + 1])
        if path.is_file():
            for t in json.loads(path.read_text())["targets"]:
                m = t["measured"]
                shown = "-" if m is None else (f"{100 * m:+.2f} points" if "within" in t["target"] else f"{m:.2f}x")
                lines.append(f"| DDP: {t['target']} | {shown} ({'PASS' if t['pass'] else 'FAIL'}) |")
    bd = by_key.get("breakdown")
    if bd is not None and bd.status == "ok":
        path = Path(bd.runs[0].argv[bd.runs[0].argv.index("--json") + 1])
        if path.is_file():
            for t in json.loads(path.read_text())["summary"]["targets"]:
                if t.get("ratio") is None:
                    lines.append(f"| {t['target']} (<= {t['bound']:.2f}x) | {t.get('note', 'not measured')} |")
                else:
                    lines.append(f"| {t['target']} (<= {t['bound']:.2f}x) | {t['ratio']:.2f}x, rounds "
                                 f"{t['min']:.2f} to {t['max']:.2f} ({_verdict(t['pass'])}) |")
    cx = by_key.get("crossover")
    if cx is not None and cx.status == "ok" and "--json" in cx.runs[0].argv:
        path = Path(cx.runs[0].argv[cx.runs[0].argv.index("--json") + 1])
        if path.is_file():
            res = json.loads(path.read_text())
            lines += _crossover_targets(res)
    return lines


def _compare_dir(sec: Section) -> Path | None:
    """Where a section's comparison goes: next to its run folders (the folder they all share)."""
    dirs = [str(p.parent) for r in sec.runs for p in r.results]
    return Path(os.path.commonpath(dirs)) / "compare" if dirs else None


def _compare_rows(sec: Section) -> dict[str, dict[str, Any]]:
    cmp = _compare_dir(sec)
    cmp = cmp / "compare.json" if cmp is not None else None
    if cmp is None or not cmp.is_file():
        return {}
    return {r["method"]: r for r in json.loads(cmp.read_text())["rows"]}


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _tta_targets(sec: Section) -> list[str]:
    """The targets on one workload: issue 33's two for AdaptiveCompression() with its defaults (final accuracy
    within dense's seed-to-seed spread, time to dense less 1 point <= 1.0x the oracle static:
    report.method_targets), and issue 12's where they still add something (compute-bound workloads, the stretch
    and bytes targets of tta-1gbit)."""
    from . import report

    rows = _compare_rows(sec)
    g, dense = rows.get("gravac"), rows.get("none")
    if not g or not dense:
        return []
    where = sec.key
    lines = [f"| {where}: {c['target']} | {c['measured']} ({_verdict(c['pass'])}) |"
             for c in report.method_targets(list(rows.values()), "gravac")]
    t, t_dense = g.get("time_to_dense_final_s"), dense.get("time_to_dense_final_s")
    compute_bound = any(task.key == where and task.compute_bound for task in tta_tasks(False))
    if t and compute_bound and t_dense:
        lines.append(f"| {where}: compression cannot pay (compute-bound): AdaptiveCompression() time <= 1.05x "
                     f"dense's | {t / t_dense:.2f}x ({_verdict(t <= 1.05 * t_dense)}) |")
    if where == "tta-1gbit":
        k10 = rows.get("topk:10", {}).get("time_to_dense_final_s")
        if t and k10:
            lines.append(f"| {where}: stretch: AdaptiveCompression() >= 1.5x faster than static top-k 10x | "
                         f"{k10 / t:.2f}x ({_verdict(k10 >= 1.5 * t)}) |")
        ratio = g.get("compression_ratio")
        if ratio:
            lines.append(f"| {where}: AdaptiveCompression() sends >= 10x fewer bytes than dense | {ratio:.1f}x "
                         f"({_verdict(ratio >= 10)}) |")
    return lines


def _crossover_targets(res: dict[str, Any]) -> list[str]:
    import statistics

    runs = res["runs"]
    if not all(runs.get(m) for m in ("sequential", "uncoordinated", "crossover")):
        return []
    agg = {m: statistics.median(e["aggregate_steps_per_s"] for e in r) for m, r in runs.items()}
    c = statistics.median(j["median_compute_s"] for e in runs["sequential"] for j in e["jobs"].values())
    m = statistics.median(j["median_sync_s"] for e in runs["sequential"] for j in e["jobs"].values())
    ideal = 2 / max(2 * c, c + m)
    p99 = res.get("rtt", {}).get("p99_us")
    out = [
        f"| crossover vs one after the other (>= 1.3x) | {agg['crossover'] / agg['sequential']:.2f}x "
        f"({'PASS' if agg['crossover'] >= 1.3 * agg['sequential'] else 'FAIL'}) |",
        f"| crossover vs uncoordinated (>= 1.15x) | {agg['crossover'] / agg['uncoordinated']:.2f}x "
        f"({'PASS' if agg['crossover'] >= 1.15 * agg['uncoordinated'] else 'FAIL'}) |",
        f"| crossover vs ideal max(2C, C+M) (>= 90%) | {100 * agg['crossover'] / ideal:.0f}% "
        f"({'PASS' if agg['crossover'] >= 0.9 * ideal else 'FAIL'}) |",
    ]
    if p99 is not None:
        verdict = "PASS" if p99 <= 200 else "FAIL"
        out.append(f"| acquire/release round trip p99 (<= 200 us) | {p99:.0f} us ({verdict}) |")
    return out


def write_report(path: Path, secs: list[Section], runs: list[dict[str, Any]], rerendered: bool = False) -> None:
    """BENCHMARKS.md: machine, targets, then every section with its commands, output, tables and plots.

    ``runs``: the run_all invocations that measured the sections (more than one after ``--merge``), each with
    its command line, machine, minutes and the keys of the sections it measured."""
    img = image_dir(path)
    img_root = REPO / img
    if img_root.exists():  # the report owns this folder: no plot from an older run survives
        shutil.rmtree(img_root)
    img_root.mkdir(parents=True)
    info = runs[-1]["machine"]
    several = len(runs) > 1
    history = os.path.relpath(REPO / HISTORY, (REPO / path).parent)  # a link that works from the report's folder
    which = {key: i + 1 for i, r in enumerate(runs) for key in r["sections"]}
    out = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`python -m benchmarks.run_all`); every figure below was measured by the "
        + ("runs" if several else "run") + " described here, with the commands shown. Re-run it to regenerate "
        "this file on your machine.",
        "",
    ]
    for i, r in enumerate(runs, 1):
        m = r["machine"]
        cmd = shlex.join(["python", "-m", f"{__package__}.run_all", *_show(r["argv"])])
        out.append(f"- run{f' {i}' if several else ''}: `{cmd}`, {m['date']}, commit {m['commit']}, "
                   f"{r['wall_s'] / 60:.0f} minutes, load average {m['load']:.2f} at the start"
                   + (f"; sections {', '.join(r['sections'])}" if several else ""))
    if rerendered:
        out.append("- this file was re-rendered later from the saved outputs with `--report-only`")
    out += [
        f"- machine: {info['cores']} cores, Linux {info['kernel']}, Python {info['python']}, torch {info['torch']}, "
        f"Horovod {info['horovod']} (a shared machine: other processes lower and scatter the figures)",
        "- emulated network: `benchmarks.netem` (network namespaces, `tc tbf` full-duplex links; no added delay: "
        "this kernel lacks `sch_netem`)",
        "- analysis of earlier runs (why GraVAC's epsilon 0.9 stays dense "
        f"on these models): [{history}]({history})",
        "",
    ]
    body: list[str] = []
    for sec in secs:  # rendered first: the targets read the comparisons the rendering writes
        when = [f"{sec.seconds / 60:.1f} min"] if sec.seconds else []
        when += [f"run {which[sec.key]}"] if several and sec.key in which else []
        body += [f"## {sec.title}", "", sec.about, "", f"Status: {sec.status}"
                 + (f" ({'; '.join(when)})" if when else "") + ".", ""]
        if not sec.outputs:
            continue
        body += ["Commands:", "", "```"] + [shlex.join(_show(r.argv)) for r in sec.runs] + ["```", ""]
        if sec.render is not None:
            body.append(sec.render(sec, img_root))
        else:
            for text in sec.outputs:
                body += ["```", _excerpt(text), "```", ""]
        for img in sec.images:
            if img.is_file():
                dest = img_root / f"{sec.key}-{img.name}"
                shutil.copyfile(img, dest)
                body += [f"![{sec.key} {img.stem}]({os.path.relpath(img_root / dest.name, (REPO / path).parent)})", ""]
    tgt = targets(secs)
    if tgt:
        out += ["## Targets from the issues, as measured in this run", "", "| target | measured |", "|---|---|",
                *tgt, ""]
    out += body
    path.write_text("\n".join(out) + "\n")


def _load_status(out: Path) -> dict[str, Any] | None:
    """What an earlier run left in ``out``: the runs that measured (command, machine, minutes, sections) and
    each section's status. The first format (one run) is read as a list of one."""
    path = out / "status.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    if "runs" not in saved:
        saved["runs"] = [{"machine": saved.pop("machine"), "wall_s": saved.pop("wall_s"), "argv": saved.pop("argv"),
                          "sections": list(saved["sections"])}]
    return saved


def _restore(sec: Section, st: dict[str, Any], out: Path) -> None:
    """A section as an earlier run left it: status, time and the output of each command."""
    sec.status, sec.seconds = st["status"], st["seconds"]
    sec.outputs = [(out / "logs" / f"{sec.key}-{i}.log").read_text() for i in range(st["outputs"])]


def _forget(sec: Section, out: Path) -> None:
    """Before a section is measured again (--merge): its logs and run folders from the earlier run go."""
    for log in (out / "logs").glob(f"{sec.key}-*.log"):
        if log.stem.rsplit("-", 1)[0] == sec.key:
            log.unlink()
    for run in sec.runs:
        for result in run.results:
            if result.parent.is_dir():
                shutil.rmtree(result.parent)


def main(argv: list[str] | None = None) -> int:
    """Run the selected sections and write the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/bench", help="where runs keep their files (default %(default)s)")
    p.add_argument("--report", default="reports/BENCHMARKS.md", help="report to write (default %(default)s)")
    p.add_argument("--no-report", action="store_true", help="run, but leave the report alone")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite the report from the outputs an earlier run left in --out")
    p.add_argument("--merge", action="store_true",
                   help="keep the other sections an earlier run left in --out: re-run only the selected ones and "
                        "write a report of all of them (the report names every run that measured a figure)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of every section")
    p.add_argument("--only", default=None, help="comma-separated section keys (see --list)")
    p.add_argument("--list", action="store_true", help="list the sections and exit")
    p.add_argument("--large", action="store_true", help="add the larger matrix: 4 hosts, 1 and 10 Gbit/s, ResNet-50")
    p.add_argument("--data-root", default=None,
                   help="with --large: folder with cifar-10-batches-py/, imagenet/ and ptb/ (default: synthetic)")
    args = p.parse_args(argv)
    out = (REPO / args.out).resolve()
    every = secs = sections(out, args.quick, args.large, args.data_root)
    if args.list:
        for s in secs:
            print(f"{s.key:<28}{s.title} ({len(s.runs)} command(s), {_estimate([s], args.quick)})")
        print(f"\nall: {_estimate(secs, args.quick)}")
        return 0
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = [k for k in keys if not any(s.key == k or s.key.startswith(k + "-") for s in secs)]
        if unknown:
            p.error(f"--only: unknown section(s) {', '.join(unknown)}; see --list")
        secs = [s for s in secs if any(s.key == k or s.key.startswith(k + "-") for k in keys)]
    saved = _load_status(out) if (args.report_only or args.merge) else None
    if (args.report_only or args.merge) and saved is None:
        p.error(f"--report-only/--merge: no earlier run in {args.out} (its status.json is missing)")
    if args.report_only:
        runs, ran = saved["runs"], []
        secs = [s for s in secs if s.key in saved["sections"]]
        for sec in secs:
            _restore(sec, saved["sections"][sec.key], out)
    else:
        from . import netem

        if not args.merge:
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
        (out / "logs").mkdir(exist_ok=True)
        reason = netem.netem_unavailable_reason()
        info = machine()
        t0 = time.monotonic()
        ran = secs
        print(f"{len(secs)} section(s): {', '.join(s.key for s in secs)}; estimated time {_estimate(secs, args.quick)}",
              flush=True)
        for sec in secs:
            if args.merge:
                _forget(sec, out)
            run_section(sec, out / "logs", reason)
            print(f"== {sec.key}: {sec.status} ({sec.seconds / 60:.1f} min)", flush=True)
        this = {"machine": info, "wall_s": time.monotonic() - t0, "argv": list(sys.argv[1:] if argv is None else argv),
                "sections": [s.key for s in secs]}
        done = set(this["sections"])
        runs = [dict(r, sections=[k for k in r["sections"] if k not in done])
                for r in (saved["runs"] if saved else [])]
        runs = [r for r in runs if r["sections"]] + [this]
        if saved:  # the earlier run's other sections join the report, each with the run that measured it
            kept = [s for s in every if s.key in saved["sections"] and s.key not in done]
            for sec in kept:
                _restore(sec, saved["sections"][sec.key], out)
            order = {s.key: i for i, s in enumerate(every)}
            secs = sorted(secs + kept, key=lambda s: order.get(s.key, len(order)))
        (out / "status.json").write_text(json.dumps({
            "version": 2, "runs": runs,
            "sections": {s.key: {"status": s.status, "seconds": s.seconds, "outputs": len(s.outputs)} for s in secs},
        }, indent=1))
    if not args.no_report:
        write_report(REPO / args.report, secs, runs, rerendered=args.report_only)
        print(f"\nwrote {args.report}")
    failed = [s.key for s in ran if s.status not in ("ok",) and not s.status.startswith("skipped")]
    if failed:
        print(f"failed: {', '.join(failed)}; logs in {out / 'logs'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
