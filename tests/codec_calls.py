"""Unit tests call a codec as the step session does: the transport decided first (crossover/driver/transport.py)."""

from __future__ import annotations

from typing import Any

import torch

from crossover.driver import transport


def sparse_encode(codec: Any, key: str, grad: torch.Tensor, plan: Any, step_time: float, comm: Any,
                  momentum: float = 0.0) -> tuple[torch.Tensor, Any, int]:
    """`SparseCodec.encode` with the transport the session would decide for `plan`."""
    kind, _ = transport.sparse_route(grad.numel(), comm.size(), plan.sent_cf, tuple(plan.probes),
                                     getattr(plan, "transport", None), codec.selector.shared_indices,
                                     hasattr(comm, "alltoall_async"))
    return codec.encode(key, grad, plan, step_time, comm, kind, momentum=momentum)


def quant_encode(codec: Any, key: str, grad: torch.Tensor, bits: int, step: int, comm: Any,
                 setting: str = "auto") -> tuple[torch.Tensor, Any, int]:
    """`QuantCodec.encode` with the transport the session would decide for `setting`."""
    kind = transport.quant_route(setting, grad.numel(), bits, comm.size())
    return codec.encode(key, grad, bits, step, comm, kind)
