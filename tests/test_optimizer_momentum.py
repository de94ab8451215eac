"""What the torch glue reads as the optimizer's momentum (the cap of the ladder, docs/accuracy.md)."""

from __future__ import annotations

import pytest
import torch

from crossover.driver import optimizer_momentum


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("make, expected", [
    (lambda p: torch.optim.SGD(p, lr=0.1), 0.0),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 0.9),
    (lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.5), 0.5),
    (lambda p: torch.optim.Adam(p, lr=0.1), 0.9),
    (lambda p: torch.optim.AdamW(p, lr=0.1, betas=(0.8, 0.99)), 0.8),
    (lambda p: torch.optim.Adagrad(p, lr=0.1), 0.0),
])
def test_momentum_and_beta1_count(make, expected):
    assert optimizer_momentum(make(_params())) == pytest.approx(expected)


def test_the_largest_group_counts_and_odd_values_are_ignored():
    opt = torch.optim.SGD([{"params": _params(), "momentum": 0.5}, {"params": _params(), "momentum": 0.95}], lr=0.1)
    assert optimizer_momentum(opt) == pytest.approx(0.95)
    opt.param_groups[1]["momentum"] = float("nan")
    opt.param_groups[0]["betas"] = "x"
    assert optimizer_momentum(opt) == pytest.approx(0.5)
    opt.param_groups[0]["momentum"] = 1.5
    assert optimizer_momentum(opt) == 0.0
    assert optimizer_momentum(object()) == 0.0



def test_hosts_that_cannot_see_the_optimizer_assume_the_commonest_momentum():
    # A DDP hook and a gradient tape report UNKNOWN_MOMENTUM unless told (tests/test_ddp_hook.py runs it in a real
    # job): uncapped, the commonest recipes (SGD momentum 0.9, Adam's beta1 0.9) lost 2 points; momentum=0 is how a
    # plain-SGD user lifts the cap.
    from crossover.adaptive.gravac.ladder import momentum_cap
    from crossover.driver import UNKNOWN_MOMENTUM, reported_momentum

    assert reported_momentum(None) == UNKNOWN_MOMENTUM == 0.9
    assert reported_momentum(0.0) == 0.0 and reported_momentum(0.5) == 0.5
    assert momentum_cap(10.0, 100.0, reported_momentum(None)) == pytest.approx(10.0)
