"""What the torch compression hooks share: which parameter a gradient belongs to, and step boundaries.

Horovod's compression hook receives a bare tensor (no name, no step number), so both the GraVAC and
the DQ-SGD glue recover the parameter name from Horovod's calling frame and infer a new step from the
first compress after a decompress, or from a name seen twice.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["param_name", "hook_caller", "GradientKeys"]

ADASUM_ERROR = ("crossover compression does not support op=hvd.Adasum (Adasum compresses parameter deltas, "
                "not gradients): use op=hvd.Average or hvd.Sum, or compression=hvd.Compression.none with Adasum")


def param_name(tensor: torch.Tensor, depth: int = 2) -> tuple[str | None, Any]:
    """Horovod's name for the parameter whose gradient is `tensor`, and the calling optimizer.

    Looks at the frames of `_allreduce_grad_async(self, p)` / `_grouped_allreduce_grad_async`
    (Horovod 0.28.1), starting `depth` frames above this function; (None, None) when called from elsewhere.
    """
    frame = sys._getframe(depth)
    param = None
    for _ in range(4):
        if frame is None:
            break
        loc = frame.f_locals
        p = loc.get("p")
        if param is None and isinstance(p, torch.Tensor) and (p.grad is tensor or loc.get("tensor") is tensor):
            param = p
        opt = loc.get("self")
        if param is not None and hasattr(opt, "_parameter_names"):
            return opt._parameter_names.get(param), opt
        frame = frame.f_back
    return None, None


def hook_caller(tensor: torch.Tensor) -> tuple[str | None, Any]:
    """`param_name` for a compression object's `compress` (its caller's caller is Horovod); rejects Adasum."""
    name, opt = param_name(tensor, depth=3)
    if opt is not None and "Adasum" in type(opt).__name__:
        raise ValueError(ADASUM_ERROR)
    return name, opt


class GradientKeys:
    """Keys for the gradients of one step: the parameter name, else the gradient's position in the step."""

    def __init__(self) -> None:
        self._ordinal = 0
        self._seen: set[str] = set()

    def begin(self) -> None:
        """A new step starts: positions restart at 0."""
        self._ordinal = 0
        self._seen.clear()

    def key(self, name: str | None) -> tuple[str, bool]:
        """The key for the next gradient, and whether it was already seen this step (a new step began)."""
        key = name if name is not None else f"#{self._ordinal}"
        self._ordinal += 1
        repeated = key in self._seen
        self._seen.add(key)
        return key, repeated
