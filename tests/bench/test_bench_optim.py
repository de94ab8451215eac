"""crossover-bench's optimizers and learning-rate schedules (benchmarks/optim.py) and the per-workload defaults the
command line fills in for them (benchmarks/cli.py). No Horovod: the end-to-end run is in test_bench_cli.py."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import cli
from benchmarks.optim import build_optimizer, lr_factor, set_lr, warmup_steps


def test_step_schedule_drops_tenfold_at_half_and_three_quarters() -> None:
    f = [lr_factor("step", s, 100) for s in range(100)]
    assert f[:50] == [1.0] * 50
    assert f[50:75] == pytest.approx([0.1] * 25)
    assert f[75:] == pytest.approx([0.01] * 25)
    assert lr_factor("step", 4, 10) == 1.0 and lr_factor("step", 5, 10) == pytest.approx(0.1)


def test_warmup_cosine_warms_up_linearly_over_5_percent_then_decays_to_zero() -> None:
    total = 200
    w = warmup_steps(total)
    assert w == 10
    f = [lr_factor("warmup-cosine", s, total) for s in range(total)]
    assert f[:w] == pytest.approx([(s + 1) / w for s in range(w)])
    assert f[w] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[w:], f[w + 1:]))  # decreasing after the warm-up
    assert f[w + (total - w) // 2] == pytest.approx(0.5, abs=0.01)
    assert 0 < f[-1] < 0.001
    assert warmup_steps(3) == 1 and lr_factor("warmup-cosine", 0, 1) == 1.0


def test_constant_and_cosine_keep_their_meaning() -> None:
    assert {lr_factor("constant", s, 7) for s in range(7)} == {1.0}
    for s in (0, 13, 50, 99):
        assert lr_factor("cosine", s, 100) == pytest.approx(0.5 * (1 + math.cos(math.pi * s / 100)))


def test_unknown_schedule_or_optimizer_is_refused() -> None:
    with pytest.raises(ValueError, match="choose one of constant, cosine, step, warmup-cosine"):
        lr_factor("linear", 0, 10)
    with pytest.raises(ValueError, match="total >= 1"):
        lr_factor("step", 0, 0)
    with pytest.raises(ValueError, match="choose one of sgd, adam, adamw"):
        build_optimizer("rmsprop", [torch.zeros(1, requires_grad=True)], lr=0.1)


def test_build_optimizer_makes_what_was_asked() -> None:
    p = [torch.zeros(3, requires_grad=True)]
    sgd = build_optimizer("sgd", p, lr=0.1, momentum=0.9, weight_decay=5e-4)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    adam = build_optimizer("adam", p, lr=1e-3)
    assert type(adam) is torch.optim.Adam and adam.defaults["lr"] == 1e-3
    adamw = build_optimizer("adamw", p, lr=1e-3, weight_decay=0.01)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["weight_decay"] == 0.01
    set_lr(adamw, 5e-4)
    assert adamw.param_groups[0]["lr"] == 5e-4


def _config(*extra: str) -> dict:
    p = cli.build_parser()
    a = p.parse_args(["--model", "mlp", "--dataset", "digits", *extra])
    return cli.make_config(a, cli.Path("/tmp/unused"))


def test_defaults_per_optimizer_and_workload() -> None:
    sgd = _config()
    assert (sgd["optimizer"], sgd["lr"], sgd["momentum"], sgd["weight_decay"]) == ("sgd", 0.02, 0.9, 0.0)
    adam = _config("--optimizer", "adam")
    assert (adam["optimizer"], adam["lr"], adam["momentum"], adam["weight_decay"]) == ("adam", 1e-3, 0.0, 0.0)
    adamw = _config("--optimizer", "adamw")
    assert (adamw["lr"], adamw["weight_decay"]) == (1e-3, 0.01)
    assert _config("--optimizer", "adamw", "--weight-decay", "0.1", "--lr", "3e-4")["weight_decay"] == 0.1
    assert _config("--lr-schedule", "warmup-cosine")["lr_schedule"] == "warmup-cosine"
    for model, dataset, lr in (("cnn", "mnist", 0.02), ("resnet18", "cifar10", 0.05), ("lstm", "ptb", 20.0)):
        a = cli.build_parser().parse_args(["--model", model, "--dataset", dataset])
        assert cli.make_config(a, cli.Path("/tmp/unused"))["lr"] == lr
        a = cli.build_parser().parse_args(["--model", model, "--dataset", dataset, "--optimizer", "adam"])
        assert cli.make_config(a, cli.Path("/tmp/unused"))["lr"] == 1e-3
    cnn = cli.make_config(cli.build_parser().parse_args(["--model", "cnn", "--dataset", "mnist"]), cli.Path("/x"))
    assert (cnn["momentum"], cnn["weight_decay"], cnn["batch_size"]) == (0.9, 5e-4, 32)
