"""Issue 46's transformer recipe: the byte-level decoder-only LM, CPython's pydoc text, the recipe's defaults, the
loss-type metric, the tta-lm section, and one real 2-rank crossover-bench run (about 20 s, Horovod's start-up)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import cli, registry, report, run_all
from benchmarks.datasets import DataError, WindowText, check_data, load_dataset, read_pydoc
from benchmarks.models import TransformerLM, build_model, count_parameters

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ model


def test_the_transformer_maps_windows_to_logits_over_the_bytes() -> None:
    torch.manual_seed(0)
    model = build_model("transformer", "pydoc", 256, context=64)
    assert isinstance(model, TransformerLM) and count_parameters(model) == 437_760
    assert model.decoder.weight is model.embed.weight  # tied: counted once
    logits, state = model(torch.randint(0, 256, (3, 64)))
    assert logits.shape == (3, 64, 256) and state is None and torch.isfinite(logits).all()
    assert model(torch.randint(0, 256, (2, 5)))[0].shape == (2, 5, 256)  # shorter windows too
    with pytest.raises(ValueError, match="longer than the model's context"):
        model(torch.randint(0, 256, (1, 65)))
    half = build_model("transformer", "pydoc", 256, width=0.5, context=64)
    assert half.embed.weight.shape == (256, 64) and half.blocks[0].heads == 2


def test_a_tokens_logits_do_not_depend_on_later_tokens() -> None:
    torch.manual_seed(0)
    model = build_model("transformer", "pydoc", 256, context=32).eval()
    x = torch.randint(0, 256, (2, 32))
    y = x.clone()
    y[:, 20:] = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        a, b = model(x)[0], model(y)[0]
    assert torch.equal(a[:, :20], b[:, :20])  # causal: positions 0..19 see nothing of 20..31
    assert not torch.allclose(a[:, 20:], b[:, 20:])
    # and the other way: an earlier token changes the logits after it
    z = x.clone()
    z[:, 3] = (z[:, 3] + 1) % 256
    with torch.no_grad():
        c = model(z)[0]
    assert torch.equal(a[:, :3], c[:, :3]) and not torch.allclose(a[:, 3:], c[:, 3:])


def test_the_same_seed_builds_the_same_model() -> None:
    def weights(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return [p.detach().clone() for p in build_model("transformer", "pydoc", 256, context=16).parameters()]

    assert all(torch.equal(a, b) for a, b in zip(weights(1), weights(1)))
    assert not all(torch.equal(a, b) for a, b in zip(weights(1), weights(2)))


# ------------------------------------------------------------------ data


def test_the_pydoc_split_is_fixed_and_covers_the_text() -> None:
    from pydoc_data.topics import topics

    train, valid = read_pydoc()
    again = read_pydoc()
    assert torch.equal(train, again[0]) and torch.equal(valid, again[1])
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    assert len(train) + len(valid) == len(text) and 0.08 < len(valid) / len(text) < 0.12
    assert int(train.min()) >= 0 and int(max(train.max(), valid.max())) < 256
    assert bytes(valid[:4096].tolist()) == text[9 * 4096:10 * 4096]  # the 10th block is the first held out


def test_batches_repeat_with_the_seed_and_differ_by_rank_seed_and_epoch() -> None:
    data = load_dataset("pydoc", None, seq_len=32, eval_samples=2048)
    assert isinstance(data, WindowText) and data.num_classes == 256 and "validation" in data.info
    assert data.steps_per_epoch(2, 8) == (len(data.train_ids) // 2 // 8 - 1) // 32

    def first(epoch: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return next(data.train_batches(epoch, rank, 2, 8, seed))

    x, y = first(1, 0, 0)
    assert x.shape == y.shape == (8, 32) and torch.equal(x[:, 1:], y[:, :-1])  # targets: the next byte
    assert torch.equal(x, first(1, 0, 0)[0])
    for other in (first(1, 1, 0), first(1, 0, 1), first(2, 0, 0)):
        assert not torch.equal(x, other[0])
    # evaluation: a fixed set, the heads of the validation blocks, the same whatever the seed
    assert len(data.eval_ids) == 2048
    again = load_dataset("pydoc", None, seq_len=32, eval_samples=2048, seed=5)
    assert torch.equal(data.eval_ids, again.eval_ids)
    rows = sum(yb.numel() for _, yb in data.eval_batches(0, 2, 4)) + sum(
        yb.numel() for _, yb in data.eval_batches(1, 2, 4))
    assert 0.9 * 2048 < rows <= 2048


def test_pydoc_takes_no_data_folder() -> None:
    with pytest.raises(DataError, match="takes no --data"):
        check_data("pydoc", "synthetic")
    check_data("pydoc", None)


# ------------------------------------------------------------------ command line and registry


@pytest.mark.parametrize("model,dataset,message", [
    ("lstm", "pydoc", "use --model transformer"),
    ("transformer", "cifar10", "use --dataset ptb or pydoc"),
    ("cnn", "pydoc", "use --model lstm or transformer"),
])
def test_incompatible_pairs_are_refused_with_what_to_change(model: str, dataset: str, message: str) -> None:
    why = registry.compatible(model, dataset)
    assert why is not None and message in why
    with pytest.raises(ValueError, match=message):
        build_model(model, dataset, 256)
    assert registry.compatible("transformer", "pydoc") is None


@pytest.mark.parametrize("argv,message", [
    (["--model", "lstm", "--dataset", "pydoc"], "use --model transformer"),
    (["--model", "transformer", "--dataset", "pydoc", "--data", "synthetic"], "takes no --data"),
    (["--model", "transformer", "--dataset", "pydoc", "--momentum", "0.9"], "--momentum applies to --optimizer sgd"),
])
def test_bad_transformer_command_lines_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                              message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_transformer_recipe_is_the_default_and_options_override_it() -> None:
    def config(*extra: str) -> dict:
        a = cli.build_parser().parse_args(["--model", "transformer", "--dataset", "pydoc", *extra])
        cli.validate(cli.build_parser(), a)
        return cli.make_config(a, Path("/tmp/unused"))

    cfg = config()
    assert (cfg["optimizer"], cfg["lr"], cfg["weight_decay"], cfg["lr_schedule"], cfg["clip"]) == (
        "adamw", 1e-3, 0.01, "warmup-cosine", 1.0)
    assert (cfg["batch_size"], cfg["seq_len"], cfg["momentum"]) == (16, 64, 0.0)
    cfg = config("--optimizer", "sgd", "--lr-schedule", "cosine", "--seq-len", "32", "--clip", "0")
    assert (cfg["optimizer"], cfg["lr"], cfg["momentum"], cfg["lr_schedule"], cfg["seq_len"], cfg["clip"]) == (
        "sgd", 0.1, 0.9, "cosine", 32, 0.0)
    # the other workloads keep theirs
    lstm = cli.make_config(cli.build_parser().parse_args(["--model", "lstm", "--dataset", "ptb"]), Path("/x"))
    assert (lstm["optimizer"], lstm["lr_schedule"], lstm["seq_len"]) == ("sgd", "constant", 35)


def test_the_transformer_is_judged_by_validation_loss_within_2_percent() -> None:
    assert registry.metric_of("transformer") == "eval_loss" and registry.metric_of("lstm") == "perplexity"
    assert report.lower_is_better("eval_loss") and report.better("eval_loss", 2.0, 2.1)
    assert report.dense_target("eval_loss", 2.5) == pytest.approx(2.55)
    assert report.tolerance_text("eval_loss") == "2%" and report.tolerance_text("accuracy") == "1 point"


def test_compare_times_each_method_to_dense_loss_plus_2_percent(tmp_path: Path) -> None:
    """Lower is better: a method reaches the target when its loss falls to dense's final loss x 1.02."""
    paths = []
    for method, losses in (("none", [3.0, 2.0, 2.0, 2.0]), ("fp16", [3.0, 2.03, 2.03, 2.02]),
                           ("gravac", [3.0, 2.5, 2.3, 2.25])):
        evals = [{"epoch": 1, "step": 10 * (i + 1), "train_s": float(i + 1), "eval_loss": v,
                  "perplexity": math.exp(v)} for i, v in enumerate(losses)]
        out = tmp_path / method.replace(":", "")
        out.mkdir()
        summary = {"method": method, "model": "transformer", "dataset": "pydoc", "ranks": 2, "bandwidth": "100mbit",
                   "metric": "eval_loss", "median_step_s": 0.1, "samples_per_s": 1.0, "compression_ratio": 1.0,
                   "final_metric": losses[-1], "train_s": 4.0}
        (out / "results.json").write_text(json.dumps({"config": {"seed": 0}, "summary": summary, "epochs": evals,
                                                      "steps": []}))
        paths.append(out / "results.json")
    rows = {r["method"]: r for r in report.compare(paths, tmp_path / "cmp", judge=None)["rows"]}
    assert rows["none"]["dense_target"] == pytest.approx(2.04)
    # read on a moving mean of 3 evaluations: reached at the fourth (its mean and the two before it)
    assert rows["none"]["time_to_dense_final_s"] == 4.0 and rows["fp16"]["time_to_dense_final_s"] == 4.0
    assert rows["gravac"]["time_to_dense_final_s"] is None
    assert rows["gravac"]["final_minus_dense"] > 0
    text = (tmp_path / "cmp" / "compare.md").read_text()
    assert "within 2% = 2.04" in text and "| +12.50 % |" in text  # gravac's last loss against dense's


# ------------------------------------------------------------------ the tta-lm section


def test_the_lm_section_runs_each_method_as_its_own_job_on_three_seeds(tmp_path: Path) -> None:
    task = run_all.lm_task(quick=False)
    assert task.methods == ("none", "fp16", "gravac", "topk:10", "powersgd:10", "powersgd:30")
    assert not task.side_by_side
    assert task.repeats == run_all.LM_SEEDS == 3 and task.rate == "100mbit" and task.hosts == 2
    runs = run_all.tta_runs(tmp_path, task)
    assert len(runs) == 18
    seeds = {r.argv[r.argv.index("--label") + 1]: r.argv[r.argv.index("--seed") + 1] for r in runs}
    assert seeds["none@1"] == seeds["gravac@1"] == "0" and seeds["none@2"] == seeds["powersgd:10@2"] == "1"
    argv = runs[0].argv
    a = cli.build_parser().parse_args(argv[argv.index("benchmarks.cli") + 1:])
    assert a.model == "transformer" and a.dataset == "pydoc" and a.optimizer is None  # the recipe's defaults
    assert "tta-lm" in [t.key for t in run_all.tta_tasks(quick=False)]


# ------------------------------------------------------------------ a real 2-rank job


def test_a_short_two_rank_run_reports_a_finite_validation_loss(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cli", "--model", "transformer", "--dataset", "pydoc",
                           "--width", "0.5", "--seq-len", "32", "--batch-size", "8", "--compression", "topk:10",
                           "--min-compress-numel", "1024", "--max-steps", "8", "--eval-every", "4",
                           "--eval-samples", "1024", "--warmup", "1", "--no-plots", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((out / "results.json").read_text())
    s, cfg = res["summary"], res["config"]
    assert s["finished"] and s["steps"] == 8 and s["ranks"] == 2 and s["metric"] == "eval_loss"
    assert (cfg["optimizer"], cfg["lr_schedule"], cfg["clip"]) == ("adamw", "warmup-cosine", 1.0)
    assert [e["step"] for e in res["epochs"]] == [4, 8]
    # 1 024 validation bytes; each rank's rows lose their last byte (it has no next one to predict)
    assert all(math.isfinite(e["eval_loss"]) and 1000 <= e["eval_count"] <= 1024 for e in res["epochs"])
    assert s["final_metric"] < math.log(256) + 0.5  # about uniform over the bytes at the start, and falling
    assert res["steps"][-1]["loss"] < res["steps"][0]["loss"]
    assert s["compression_ratio"] > 2 and "final eval_loss" in proc.stdout
