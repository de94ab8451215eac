"""Policy wiring shared by the torch and TensorFlow glue (framework-free: plain numbers in and out).

The compression objects differ per framework in how tensors move; how they build and feed the
policies of crossover/adaptive is the same, and lives here once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from crossover.adaptive.dqsgd import DqsgdPolicy, DqsgdStats, error_budget_for_bits
from crossover.adaptive.gravac import GravacPolicy
from crossover.adaptive.static import StaticPolicy

__all__ = ["gravac_or_dense", "dqsgd_instead", "dqsgd_observe"]

DQSGD_PARAMS = ("total_steps, lr, error_budget, target_bits, b_min, b_max, decay, error_feedback, "
                "min_compress_numel, seed, transport")


def gravac_or_dense(enabled: bool, policy: str, **params: Any) -> GravacPolicy | StaticPolicy:
    """AdaptiveCompression's policy: GraVAC with `params`, or CF 1 (dense) when not `enabled`."""
    if policy != "gravac":
        raise ValueError(f"policy must be 'gravac' or 'dqsgd', got {policy!r}")
    return GravacPolicy(**params) if enabled else StaticPolicy(cf=1.0)


def dqsgd_instead(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """`AdaptiveCompression(policy="dqsgd", ...)`: build the framework's DqsgdCompression, with clear errors."""
    if args:
        raise ValueError("policy='dqsgd' quantizes: it takes no compressor name")
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f"policy='dqsgd': {exc} (DQ-SGD takes {DQSGD_PARAMS})") from None


def dqsgd_observe(policy: DqsgdPolicy | None, *, sq_norm: float, world: int, numel: int, lr: float | None,
                  step: int, bits: int, target_bits: int, total_steps: int,
                  policy_kw: Mapping[str, Any]) -> DqsgdPolicy | None:
    """Feed one finished step to DQ-SGD, calibrating the policy's budget on the first usable step.

    `sq_norm` is the rank-summed ||x||^2; the variance bound wants the average over `world`
    independently quantized ranks. Returns the policy (new after calibration, None until then).
    """
    g = sq_norm / (world * world)
    if policy is None:
        if not (g > 0 and lr):
            return None
        budget = error_budget_for_bits(target_bits, grad_sq_norm=g, numel=numel, lr=lr, total_steps=total_steps)
        policy = DqsgdPolicy(error_budget=budget, **policy_kw)
    policy.observe(DqsgdStats(grad_sq_norm=g, numel=numel, lr=lr if lr else float("nan"), step=step, bits=bits))
    return policy
