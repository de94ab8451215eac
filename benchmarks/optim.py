"""The optimizers and learning-rate schedules of ``crossover-bench`` (``--optimizer``, ``--lr-schedule``).

    opt = build_optimizer("adamw", model.parameters(), lr=1e-3, weight_decay=0.01)
    for step in range(total):
        set_lr(opt, base_lr * lr_factor("warmup-cosine", step, total))

``lr_factor`` is a pure function of the step (0-based, before the step is taken) and the run's steps, so
every rank and every method of a side-by-side job follows the same schedule.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from .registry import OPTIMIZERS, SCHEDULES

__all__ = ["OPTIMIZERS", "SCHEDULES", "build_optimizer", "lr_factor", "set_lr", "warmup_steps"]

#: step schedule: the learning rate is multiplied by STEP_GAMMA at each of these fractions of the run
STEP_MILESTONES = (0.5, 0.75)
STEP_GAMMA = 0.1
#: warmup-cosine: linear warm-up over this fraction of the steps, then cosine decay to 0
WARMUP_FRACTION = 0.05


def build_optimizer(name: str, params: Iterable[Any], *, lr: float, momentum: float = 0.0,
                    weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """``sgd`` (with ``momentum``; L2 ``weight_decay``), ``adam`` (L2 ``weight_decay``, as torch's Adam adds it to
    the gradient) or ``adamw`` (decoupled ``weight_decay``); Adam's betas and eps are torch's defaults."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


def warmup_steps(total: int) -> int:
    """Steps of warmup-cosine's linear warm-up: 5 % of the run, at least 1."""
    return max(1, math.ceil(WARMUP_FRACTION * total))


def lr_factor(schedule: str, step: int, total: int) -> float:
    """The multiplier of the base learning rate for 0-based ``step`` of a run of ``total`` steps.

    ``constant``: 1. ``cosine``: 0.5 (1 + cos(pi step / total)), from 1 towards 0. ``step``: 1, then 0.1 from
    50 % of the steps and 0.01 from 75 %. ``warmup-cosine``: (step + 1) / W over the first W = 5 % of the
    steps, then cosine from 1 towards 0 over the rest.
    """
    if total < 1 or step < 0:
        raise ValueError(f"lr_factor needs total >= 1 and step >= 0, got step {step} of {total}")
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    if schedule == "step":
        return STEP_GAMMA ** sum(step >= m * total for m in STEP_MILESTONES)
    if schedule == "warmup-cosine":
        w = warmup_steps(total)
        if step < w:
            return (step + 1) / w
        rest = max(1, total - w)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - w, rest) / rest))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate."""
    for g in opt.param_groups:
        g["lr"] = lr
