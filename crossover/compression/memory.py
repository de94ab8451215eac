"""Error-feedback memory: the residual of each tensor (what compression left unsent), per key.

GRACE's split: a compressor chooses what to send, the memory keeps what was not sent and adds it
back next step, a communicator moves the payload. Residuals are keyed by the host's name for the
tensor (Horovod's parameter name, a DDP bucket index) and follow the gradient's size and device.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from .checks import check_flag

__all__ = ["ErrorFeedback"]

log = logging.getLogger(__name__)


class ErrorFeedback:
    """Residuals per tensor key; `enabled=False` keeps none (`residual` returns None)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = check_flag("error_feedback", enabled)
        self._residuals: dict[str, torch.Tensor] = {}

    def residual(self, key: str, like: torch.Tensor) -> torch.Tensor | None:
        """The residual for `key` in `like`'s shape, dtype and device: zeros when new, or when the tensor's
        size changed (with a warning: what it held cannot be placed)."""
        if not self.enabled:
            return None
        res = self._residuals.get(key)
        if res is not None and res.numel() != like.numel():
            log.warning("error-feedback residual %r has %d elements, its gradient %d: the residual is dropped",
                        key, res.numel(), like.numel())
            res = None
        if res is None:
            res = self._residuals[key] = torch.zeros_like(like)
        elif res.dtype != like.dtype or res.device != like.device or res.shape != like.shape:
            # a loaded residual of another dtype or device (an fp16 or CPU copy in a checkpoint) is converted, not
            # dropped: float16/bfloat16 -> float32 is exact, float64 rounds as the gradient itself would
            res = self._residuals[key] = res.to(device=like.device, dtype=like.dtype).reshape(like.shape).contiguous()
        return res

    def get(self, key: str) -> torch.Tensor | None:
        """The residual held for `key` (the live tensor, not a copy), or None."""
        return self._residuals.get(key)

    def put(self, key: str, residual: torch.Tensor) -> None:
        """Hold `residual` (not copied) for `key`: a host that regroups its tensors (DDP rebuilding its
        buckets) moves residuals between keys with `get`/`put`/`pop`."""
        self._residuals[key] = residual

    def pop(self, key: str) -> torch.Tensor | None:
        """Remove and return the residual for `key` (None if there was none)."""
        return self._residuals.pop(key, None)

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of every residual (for checkpoints)."""
        return {k: v.clone() for k, v in self._residuals.items()}

    def load(self, residuals: Mapping[str, torch.Tensor]) -> None:
        """Replace every residual by a copy of `residuals` (call `validate` first)."""
        self._residuals = {k: v.detach().clone() for k, v in residuals.items()}

    def validate(self, residuals: object) -> None:
        """Raise ValueError unless `residuals` can be loaded: a mapping of str keys to finite floating
        tensors, each with the size of this memory's residual of the same key when it has one."""
        if not isinstance(residuals, Mapping):
            raise ValueError(f"residuals must be a mapping of key -> tensor, got {type(residuals).__name__}")
        for k, v in residuals.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor) or not v.is_floating_point():
                raise ValueError(f"residual {k!r} must be a floating tensor under a str key, got {type(v).__name__}")
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"residual {k!r} holds inf/NaN values")
            have = self._residuals.get(k)
            if have is not None and have.numel() != v.numel():
                raise ValueError(f"residual {k!r} has {v.numel()} elements; this run's tensor has {have.numel()}")

    def keys(self) -> list[str]:
        return list(self._residuals)

    def __len__(self) -> int:
        return len(self._residuals)
