"""What the torch glue reads as the optimizer's momentum (the cap of the ladder, docs/accuracy.md)."""

from __future__ import annotations

import numpy as np
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


def test_the_largest_group_counts():
    opt = torch.optim.SGD([{"params": _params(), "momentum": 0.5}, {"params": _params(), "momentum": 0.95}], lr=0.1)
    assert optimizer_momentum(opt) == pytest.approx(0.95)


def _with(opt: torch.optim.Optimizer, **group: object) -> torch.optim.Optimizer:
    opt.param_groups[0].update(group)
    return opt


@pytest.mark.parametrize("make, expected", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=np.float32(0.9)), 0.9),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=np.float64(0.5)), 0.5),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=torch.tensor(0.9)), 0.9),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=1), 1.0),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=1.0), 1.0),               # a valid momentum: the lowest cap
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=1.5), 1.0),               # torch accepts it: counts as 1
    (lambda p: torch.optim.Adam(p, lr=0.1, betas=(torch.tensor(0.8), torch.tensor(0.999))), 0.8),
    (lambda p: _with(torch.optim.Adam(p, lr=0.1), betas=(np.float32(0.85), 0.999)), 0.85),  # set by a schedule
])
def test_momenta_of_any_numeric_type_are_read(make, expected):
    # Issue 45: np.float32(0.9), tensor betas and momentum 1.0 read as 0, which lifted the cap
    assert optimizer_momentum(make(_params())) == pytest.approx(expected)


@pytest.mark.parametrize("momentum, betas", [
    (float("nan"), None), (float("inf"), None), (-0.5, None), ("0.9", None), (True, None), (lambda: 0.9, None),
    (torch.tensor([0.9, 0.9]), None), (0.0, "x"), (0.0, ()), (0.0, (float("nan"), 0.999)), (0.0, 5),
])
def test_a_momentum_that_cannot_be_read_is_the_safe_unknown(momentum, betas):
    from crossover.driver import UNKNOWN_MOMENTUM

    opt = torch.optim.SGD(_params(), lr=0.1)
    opt.param_groups[0]["momentum"] = momentum
    if betas is not None:
        opt.param_groups[0]["betas"] = betas
    assert optimizer_momentum(opt) == UNKNOWN_MOMENTUM
    opt.add_param_group({"params": _params(), "momentum": 0.95})  # a readable larger one still counts
    assert optimizer_momentum(opt) == pytest.approx(0.95)


class _RaisingGroups:
    @property
    def param_groups(self) -> list:
        raise RuntimeError("not readable here")


def test_an_optimizer_without_readable_groups_is_the_safe_unknown():
    from crossover.driver import UNKNOWN_MOMENTUM

    assert optimizer_momentum(object()) == UNKNOWN_MOMENTUM
    assert optimizer_momentum(_RaisingGroups()) == UNKNOWN_MOMENTUM
    assert optimizer_momentum(type("O", (), {"param_groups": ["not a dict"]})()) == UNKNOWN_MOMENTUM
    assert optimizer_momentum(type("O", (), {"param_groups": []})()) == 0.0  # no groups: nothing has momentum


def test_the_momentum_setting_takes_zero_to_one():
    from crossover.driver import check_momentum

    assert check_momentum(None) is None and check_momentum(1.0) == 1.0 and check_momentum(0) == 0.0
    for bad in (1.5, -0.1, float("nan"), "0.9", True):
        with pytest.raises(ValueError, match=r"momentum must be None .* or a number in \[0, 1\]"):
            check_momentum(bad)



def test_hosts_that_cannot_see_the_optimizer_assume_the_commonest_momentum():
    # A DDP hook and a gradient tape report UNKNOWN_MOMENTUM unless told (tests/ddp/test_ddp_hook.py runs it in a real
    # job): uncapped, the commonest recipes (SGD momentum 0.9, Adam's beta1 0.9) lost 2 points; momentum=0 is how a
    # plain-SGD user lifts the cap.
    from crossover.adaptive.gravac.ladder import momentum_cap
    from crossover.driver import UNKNOWN_MOMENTUM, reported_momentum

    assert reported_momentum(None) == UNKNOWN_MOMENTUM == 0.9
    assert reported_momentum(0.0) == 0.0 and reported_momentum(0.5) == 0.5
    assert momentum_cap(10.0, 100.0, reported_momentum(None)) == pytest.approx(10.0)


class _Keras:
    """A Keras-like optimizer: hyperparameters as attributes (tf-keras is read by duck typing, without TensorFlow)."""

    def __init__(self, **hyper: object) -> None:
        self.__dict__.update(hyper)


class _Var:
    """What a tf.Variable hyperparameter gives: a value through .numpy()."""

    def __init__(self, value: float) -> None:
        self.value = value

    def numpy(self) -> float:
        return self.value


class _Broken:
    @property
    def momentum(self) -> float:
        raise RuntimeError("not readable here")


@pytest.mark.parametrize("opt, expected", [
    (_Keras(learning_rate=0.1, momentum=0.0), 0.0),          # tf.keras SGD
    (_Keras(momentum=0.9, nesterov=True), 0.9),
    (_Keras(beta_1=0.9, beta_2=0.999), 0.9),                 # Adam, AdamW, Nadam, Adamax
    (_Keras(rho=0.9, momentum=0.5), 0.5),                    # RMSprop
    (_Keras(initial_accumulator_value=0.1), 0.0),            # Adagrad: none
    (_Keras(momentum=_Var(0.8)), 0.8),                       # a variable
    (_Keras(inner_optimizer=_Keras(momentum=0.9)), 0.9),     # mixed precision's LossScaleOptimizer
    (_Keras(beta_1=1.0), 1.0),                               # Keras takes momentum in [0, 1]
    (_Keras(momentum=np.float32(0.9)), 0.9),
    (_Keras(momentum=_Var(np.float32(0.5))), 0.5),
])
def test_a_keras_optimizer_momentum_or_beta_1_counts(opt, expected):
    from crossover.driver import keras_optimizer_momentum

    assert keras_optimizer_momentum(opt) == pytest.approx(expected)


class _RaisingInner:
    """A LossScaleOptimizer-like wrapper whose inner_optimizer property raises (not an AttributeError)."""

    momentum = 0.0

    @property
    def inner_optimizer(self) -> object:
        raise RuntimeError("no inner optimizer here")


class _BadFloat:
    def __float__(self) -> float:
        raise RuntimeError("cannot convert")


class _BadNumpy:
    def numpy(self) -> float:
        raise RuntimeError("symbolic tensor")


@pytest.mark.parametrize("opt", [_Keras(momentum=lambda: 0.9), _Keras(momentum=float("nan")), _Keras(momentum=-0.1),
                                 _Keras(momentum="0.9x"), _Keras(momentum="0.9"), _Broken(),
                                 _RaisingInner(), _Keras(momentum=10 ** 400), _Keras(beta_1=-(10 ** 400)),
                                 _Keras(momentum=_BadFloat()), _Keras(beta_1=_BadNumpy()),
                                 _Keras(inner_optimizer=_Broken()), _Keras(momentum=_Var(_BadFloat()))])
def test_a_keras_momentum_that_cannot_be_read_is_unknown(opt):
    # None: the TF object keeps UNKNOWN_MOMENTUM (0.9), the safe side, rather than reading 0 and lifting the cap
    from crossover.driver import keras_optimizer_momentum

    assert keras_optimizer_momentum(opt) is None
