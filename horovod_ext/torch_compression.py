"""Horovod compression objects for `horovod.torch`: adaptive (GraVAC, DQ-SGD) and static sparsification.

Use:  hvd.DistributedOptimizer(opt, named_parameters=..., compression=AdaptiveCompression())

How it fits Horovod's hook (see docs/compression.md and docs/architecture.md):
* `compress(tensor)` is called once per gradient in the backward hook; Horovod then allreduces
  what it returns with the optimizer's op and scale factors; `decompress` runs in `synchronize()`.
  Steps, keys and pass-through: horovod_ext/_torch_host.py.
* Everything per step that is not tensor movement (policy, plans, one-step-late observation, byte
  counters, CSV, state) is the framework-free step driver, crossover/driver/; selection,
  error feedback and transports are the codec, crossover/compression/sparse_codec.py. This module
  only connects them.
* Every rank decides the same: the plan for a step depends only on statistics summed over ranks
  inside earlier steps' payloads (the driver's `SparseStatsLayout` rides in every compressed payload).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import torch

from crossover.adaptive.static import StaticPolicy
from crossover.driver import ALLTOALL_DEFAULT_TRANSPORT, CfPolicy, check_transport, gravac_or_dense
from crossover.driver.session import cf_session, check_compressor
from horovod_ext._class_guard import CompressionType
from horovod_ext._facade import AdaptiveFacade
from horovod_ext._torch_host import TorchHookBase
from horovod_ext.torch_quantization import DqsgdCompression

__all__ = ["AdaptiveCompression", "FP16Compression", "GravacCompression", "StaticCompression"]

log = logging.getLogger(__name__)


class _SparseCompression(TorchHookBase):
    """A CF policy driving a sparsifying codec (a `SparseSession`): the shared body of GraVAC and static compression."""

    def __init__(self, compressor: str, policy: CfPolicy, *, error_feedback: bool, min_compress_numel: int,
                 seed: int, log_csv: str | None, transport: str, tensorboard: Any = None,
                 momentum: float | None = None, clock: Callable[[], float] | None = None) -> None:
        check_transport(transport)
        check_compressor(compressor)
        # fixed_gather: exactly k pairs per rank, so a group's allgather keeps its size while the CF does, and
        # Horovod's response cache spares it the full negotiation (a size that changes renegotiates every step)
        # dense_stats_apart: a dense payload is the gradient itself (no copy to append the statistics); the
        # statistics go by an allreduce of their own, which Horovod fuses with the step's other small tensors
        # momentum: the optimizer's, read at every step (0 until an optimizer is seen)
        session = cf_session(compressor, policy, error_feedback=error_feedback, seed=seed, log_csv=log_csv,
                             rank=hvd.rank, transport=transport, alltoall=True, fixed_gather=True,
                             dense_stats_apart=True, tensorboard=tensorboard, momentum=momentum,
                             unknown_momentum=0.0, clock=clock)
        super().__init__(session, min_compress_numel=min_compress_numel)
        self.compressor = compressor
        self.error_feedback = bool(error_feedback)
        self.log_csv = log_csv

    @property
    def seed(self) -> int:
        return self.driver.seed


class GravacCompression(_SparseCompression):
    """GraVAC: compress with `compressor`, adapting the compression factor during training.

    `compressor`: "auto" (the default) picks the family at the first step from the optimizer's momentum (SGD's, or
    Adam's beta1; `momentum=` overrides): low rank ("powersgd") with momentum, top-k without
    (crossover/driver/session.py `auto_family`; stats()["compressor"] names the choice). Or one by name: "topk",
    "powersgd", "dgc", "redsync", "randomk".

    `**gravac`: any setting of `crossover.adaptive.gravac.GravacPolicy` (cf_min, cf_max, epsilon, omega,
    window, gain, search, cf_step, reopen_drift, warmup_steps, ewma_alpha, scaling); what is not given
    keeps the policy's default, so `AdaptiveCompression()` is exactly the policy's defaults (docs/gravac.md).
    `enabled=False` turns compression off (exact dense allreduce). float32 gradients travel in DDP's buckets
    (horovod_ext/_torch_host.py); `min_compress_numel`: a smaller bucket goes dense, as on the DDP hook (every
    gradient on its own, smaller ones dense, where the model has no tensor of that size). `log_csv`: a path
    (`{rank}` allowed; one file per rank) that gets one row per step. `tensorboard`: a directory (rank 0 writes)
    or a SummaryWriter that gets per-step scalars under `crossover/` (docs/compression.md). `momentum`: None
    reads the optimizer's (SGD-style `momentum` of its param groups) at every step; the policy caps the CF by it
    (docs/accuracy.md).
    `transport` (rank-specific compressors): "auto" (the default: the sparse reduce-scatter or each rank's own
    pairs by allgather, the cost model's fewer bytes unless measured step times favour the other; the
    reduce-scatter's bytes per worker stay flat as workers are added, and on 2 ranks it is the allgather),
    "scatter" or "allgather" (always that one), "agreed" (values at an index set agreed the step before, by
    allreduce; opt-in: it lost accuracy at CF 10 on 4-8 ranks). docs/scaling.md.
    `clock`: a callable returning seconds (default `time.perf_counter`), as the DDP hook's: GraVAC's step time is
    the difference between two step starts, and a clock that stops while the process does other work between
    steps (evaluation, another model trained in the same loop) keeps that work out of the throughput it compares.
    """

    def __init__(self, compressor: str = "auto", *, error_feedback: bool = True, min_compress_numel: int = 16384,
                 enabled: bool = True, seed: int = 0, log_csv: str | None = None, tensorboard: Any = None,
                 momentum: float | None = None, transport: str = ALLTOALL_DEFAULT_TRANSPORT,
                 clock: Callable[[], float] | None = None, **gravac: Any) -> None:
        pol = gravac_or_dense(enabled, **gravac)
        super().__init__(compressor, pol, error_feedback=error_feedback, min_compress_numel=min_compress_numel,
                         seed=seed, log_csv=log_csv, transport=transport, tensorboard=tensorboard, momentum=momentum,
                         clock=clock)
        self.enabled = bool(enabled)


class StaticCompression(_SparseCompression):
    """A fixed compression factor: `StaticCompression("topk", cf=100)` is static top-k at 1 %, each rank's
    pairs by allgather; `transport="agreed"` sends values at the agreed index set instead (flat in W)."""

    def __init__(self, compressor: str = "topk", *, cf: float = 100.0, error_feedback: bool = True,
                 min_compress_numel: int = 16384, seed: int = 0, log_csv: str | None = None,
                 tensorboard: Any = None, transport: str = "allgather") -> None:
        super().__init__(compressor, StaticPolicy(cf=cf), error_feedback=error_feedback,
                         min_compress_numel=min_compress_numel, seed=seed, log_csv=log_csv, transport=transport,
                         tensorboard=tensorboard)


class AdaptiveCompression(AdaptiveFacade):
    """Adaptive compression for horovod.torch: the policy picks how hard to compress while training.

    `AdaptiveCompression()` (policy="gravac", the default): a `GravacCompression` with the given
    settings (compressor name first, then cf_min, cf_max, epsilon, ...). `AdaptiveCompression(
    policy="dqsgd", total_steps=T)`: a `DqsgdCompression` (quantization bits per step).
    See horovod_ext/_facade.py.
    """

    _gravac = GravacCompression
    _dqsgd = DqsgdCompression


class FP16Compression(metaclass=CompressionType):
    """fp16 casts (like hvd.Compression.fp16) with a counter of bytes; summable, so plain allreduce."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_dense = 0

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.bytes_dense += tensor.numel() * tensor.element_size()
        if tensor.dtype in (torch.float32, torch.float64) and not tensor.is_sparse:
            out = tensor.to(torch.float16)
            self.bytes_sent += out.numel() * 2
            return out, tensor.dtype
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)

    def stats(self, debug: bool = False) -> dict[str, Any]:
        return {"step": None, "compression_factor": 2.0, "gain": None, "bytes_sent": self.bytes_sent,
                "bytes_dense": self.bytes_dense}
