"""crossover's adaptive compression as a PyTorch DDP communication hook (no Horovod needed).

    from crossover.ddp import AdaptiveState, adaptive_hook
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = AdaptiveState()                  # GraVAC; policy="dqsgd", "static", "qsgd" or "fp16"
    ddp.register_comm_hook(state, adaptive_hook)

See crossover/ddp/hook.py and docs/ddp.md.
"""

from __future__ import annotations

from .hook import POLICIES, AdaptiveState, adaptive_hook

__all__ = ["AdaptiveState", "adaptive_hook", "POLICIES"]
