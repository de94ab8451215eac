"""Settings of the compression objects, checked at construction."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from crossover.adaptive.dqsgd import DqsgdPolicy
from crossover.compression.checks import check_flag
from crossover.driver.sparse import CfPolicy

__all__ = ["DQSGD_DEFAULTS", "DQSGD_PARAMS", "UNKNOWN_MOMENTUM", "check_min_numel", "check_momentum",
           "dqsgd_settings", "gravac_or_dense", "keras_optimizer_momentum", "lr_at", "momentum_value",
           "optimizer_momentum", "reported_momentum"]


def check_min_numel(min_compress_numel: object) -> int:
    """`min_compress_numel` validated: an int >= 1."""
    if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) or min_compress_numel < 1:
        raise ValueError(f"min_compress_numel must be an int >= 1, got {min_compress_numel!r}")
    return min_compress_numel


#: The momentum a host that cannot see the optimizer (a DDP hook, a gradient tape) reports when ``momentum=`` is not
#: given: SGD's 0.9 and Adam's beta1 0.9 are the commonest recipes, and uncapped they lost 2 points (docs/accuracy.md).
UNKNOWN_MOMENTUM = 0.9


def reported_momentum(setting: float | None) -> float:
    """The momentum a host that cannot read the optimizer reports: its ``momentum=`` setting, else
    ``UNKNOWN_MOMENTUM`` (the safe side: the CF stays where momentum 0.9 keeps accuracy; ``momentum=0`` lifts it)."""
    return UNKNOWN_MOMENTUM if setting is None else float(setting)


def check_momentum(momentum: object) -> float | None:
    """`momentum` validated: None (read from the optimizer where the glue sees it) or a number in [0, 1]."""
    if momentum is None:
        return None
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum must be None (the optimizer's, where it can be read) or a number in [0, 1] "
                         f"(your optimizer's momentum; 0 for none), got {momentum!r}")
    return float(momentum)


def momentum_value(value: object) -> float | None:
    """An optimizer's momentum hyperparameter as a float, or None when it cannot be read as one.

    Any real number reads: int, float, a numpy scalar, a one-element tensor (torch's or TensorFlow's eager ones:
    ``float()`` reads them without importing either). A momentum above 1 (torch accepts it) counts as 1, the lowest
    cap. Unreadable: a bool, a string, NaN or infinity, a negative number, a schedule or any other object, and
    anything whose ``__float__`` raises.
    """
    kind = type(value)
    if isinstance(value, (bool, str, bytes)) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")):
        return None
    try:
        m = float(value)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - whatever a foreign __float__ raises: unreadable
        return None
    if not (math.isfinite(m) and m >= 0.0):
        return None
    return min(m, 1.0)


def _group_momenta(group: object) -> list[float | None]:
    """The momenta of one torch parameter group: its ``momentum`` and ``betas[0]`` where present (None: unreadable)."""
    if not isinstance(group, Mapping):
        return [None]
    found: list[float | None] = []
    if group.get("momentum") is not None:
        found.append(momentum_value(group["momentum"]))
    betas = group.get("betas")
    if betas is not None:
        try:
            first = betas[0]  # a tuple, a list or a tensor
        except Exception:  # noqa: BLE001 - empty, or not indexable
            first = None
        found.append(None if first is None else momentum_value(first))
    return found


def optimizer_momentum(opt: Any) -> float:
    """The largest momentum among a torch optimizer's parameter groups (0 when it has none).

    SGD-style ``momentum`` (SGD, RMSprop) and the first moment's decay ``betas[0]`` (Adam, AdamW, NAdam...) count
    alike: uncapped, the defaults under AdamW ended 2 points under dense in the recipe matrix (docs/accuracy.md).
    Numbers of any kind read (:func:`momentum_value`: numpy scalars, 0-dim tensors; 1.0 is a momentum). A value that
    cannot be read, or an object without readable ``param_groups``, counts as ``UNKNOWN_MOMENTUM`` (the safe side,
    as :func:`keras_optimizer_momentum`'s caller keeps), never as 0: that would lift the cap.
    """
    try:
        groups = list(opt.param_groups)
    except Exception:  # noqa: BLE001 - not an optimizer, or a property that raises
        return UNKNOWN_MOMENTUM
    best = 0.0
    for group in groups:
        for m in _group_momenta(group):
            best = max(best, UNKNOWN_MOMENTUM if m is None else m)
    return best


def keras_optimizer_momentum(opt: Any) -> float | None:
    """The momentum of a Keras optimizer (tf-keras, read by duck typing: nothing here imports TensorFlow), or None
    when it has one that cannot be read as a number (the caller then keeps the safe ``UNKNOWN_MOMENTUM``).

    SGD-style ``momentum`` (SGD, RMSprop) and Adam's ``beta_1`` (Adam, AdamW, Nadam, Adamax) count alike, as in
    :func:`optimizer_momentum` (numbers of any kind, :func:`momentum_value`); a mixed-precision ``LossScaleOptimizer``
    is read through its ``inner_optimizer``; an optimizer with neither attribute (Adagrad, Ftrl) has none (0).
    Never raises: whatever reading the optimizer raises (a property, ``__float__``, ``numpy()``) reads as None.
    """
    try:
        return _keras_momentum(opt)
    except Exception:  # noqa: BLE001 - a foreign object's attribute or conversion failed: unreadable
        return None


def _keras_momentum(opt: Any) -> float | None:
    inner = getattr(opt, "inner_optimizer", None)
    if inner is not None and inner is not opt:
        opt = inner
    best = 0.0
    for name in ("momentum", "beta_1"):
        value = getattr(opt, name, None)
        if value is None:
            continue
        if hasattr(value, "numpy"):  # a tf.Variable or an eager tensor (symbolic inside a graph: raises)
            value = value.numpy()
        m = momentum_value(value)
        if m is None:
            return None
        best = max(best, m)
    return best


def gravac_or_dense(enabled: bool, **params: Any) -> CfPolicy:
    """AdaptiveCompression's policy: GraVAC with `params`, or CF 1 (dense) when not `enabled`."""
    import inspect

    from crossover.adaptive.gravac import GravacPolicy
    from crossover.adaptive.static import StaticPolicy

    check_flag("enabled", enabled)
    known = [p for p in inspect.signature(GravacPolicy.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"unknown GraVAC setting(s) {', '.join(unknown)}; the settings are {', '.join(known)}")
    return GravacPolicy(**params) if enabled else StaticPolicy(cf=1.0)


DQSGD_PARAMS = ("total_steps, lr, error_budget, target_bits, b_min, b_max, decay, error_feedback, "
                "min_compress_numel, seed, transport, tensorboard")
#: The defaults of DqsgdCompression's DQ-SGD settings (both frameworks'): what `dqsgd_settings` checks when a setting
#: is not given (`crossover.AdaptiveCompression(policy="dqsgd", ...)` before the framework is known).
DQSGD_DEFAULTS: dict[str, Any] = {"lr": None, "error_budget": None, "target_bits": 6, "b_min": 2, "b_max": 8,
                                  "decay": 0.999}


def dqsgd_settings(*, total_steps: object, lr: object, error_budget: float | None, target_bits: object,
                   b_min: int, b_max: int, decay: float) -> dict[str, Any]:
    """DQ-SGD's settings, validated at construction (for `QuantStepDriver(dqsgd=...)`)."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an int >= 1 (the training horizon DQ-SGD plans bits for), "
                         f"got {total_steps!r}")
    if lr is not None and not callable(lr) and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                                                or not lr > 0):
        raise ValueError(f"lr must be a number > 0, a callable step -> lr, or None (read from the "
                         f"optimizer), got {lr!r}")
    # validates b_min, b_max, decay, error_budget
    DqsgdPolicy(error_budget=1.0 if error_budget is None else error_budget, total_steps=total_steps,
                b_min=b_min, b_max=b_max, decay=decay)
    if isinstance(target_bits, bool) or not isinstance(target_bits, int) or not b_min <= target_bits <= b_max:
        raise ValueError(f"target_bits must be an int in [b_min, b_max] = [{b_min}, {b_max}], got {target_bits!r}")
    return {"total_steps": total_steps, "error_budget": error_budget, "target_bits": target_bits,
            "b_min": b_min, "b_max": b_max, "decay": decay}


def lr_at(lr: object, step: int, optimizer_lr: Callable[[], float | None]) -> float | None:
    """The learning rate DQ-SGD uses at `step`: a number, a callable step -> lr, else the optimizer's."""
    if callable(lr):
        return float(lr(step))
    if lr is not None:
        return float(lr)  # type: ignore[arg-type]
    return optimizer_lr()
