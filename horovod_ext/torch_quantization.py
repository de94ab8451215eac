"""Quantized compression for `horovod.torch`: DQ-SGD (bits chosen per step) and static QSGD.

Use:  hvd.DistributedOptimizer(opt, named_parameters=..., compression=AdaptiveCompression(
          policy="dqsgd", total_steps=T))          # or QSGDCompression(bits=4)

Each compressed gradient is stochastically quantized to `bits` bits per element (crossover/compression/
quant_codec.py: packed codes by allgather, fp16 values by allreduce, or dense, by bytes). A small
statistics vector `[1, ||x||^2]` rides the stock allreduce; its reduced value gives every rank the same
global gradient norm, from which the step driver (crossover/driver/, `QuantStepDriver`)
picks the next step's bits (docs/dqsgd.md). Steps, keys and pass-through: horovod_ext/_torch_host.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Union

import horovod.torch as hvd

from crossover.compression.quant_codec import QuantCodec
from crossover.driver import QuantStepDriver, dqsgd_settings
from crossover.driver.session import QuantSession
from horovod_ext._torch_host import TorchHookBase

__all__ = ["DqsgdCompression", "QSGDCompression"]

log = logging.getLogger(__name__)
LR = Union[float, Callable[[int], float], None]


class _QuantizedCompression(TorchHookBase):
    """A bits-per-step driver and a quantizing codec (a `QuantSession`): the shared body of DQ-SGD and QSGD."""

    def __init__(self, driver: QuantStepDriver, *, error_feedback: bool, min_compress_numel: int, seed: int,
                 transport: str, lr: Any = None) -> None:
        session = QuantSession(QuantCodec(error_feedback=error_feedback, seed=seed), driver,
                               transport_setting=transport, lr=lr)
        super().__init__(session, min_compress_numel=min_compress_numel)
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self.transport = transport


class QSGDCompression(_QuantizedCompression):
    """Static QSGD: `bits` per element (2 = TernGrad-style ternary), stochastic rounding, max-norm scale.
    `tensorboard`: as DqsgdCompression's."""

    def __init__(self, bits: int = 8, *, error_feedback: bool = False, min_compress_numel: int = 16384,
                 seed: int = 0, transport: str = "auto", tensorboard: Any = None) -> None:
        self.fixed_bits = bits
        super().__init__(QuantStepDriver(bits=bits, tensorboard=tensorboard, rank=hvd.rank),
                         error_feedback=error_feedback, min_compress_numel=min_compress_numel, seed=seed,
                         transport=transport)


class DqsgdCompression(_QuantizedCompression):
    """DQ-SGD: the bits of each step from the gradient norm, learning rate, step and horizon.

    total_steps (required): the training horizon T. lr: a number, a callable step -> lr, or None to
    read the optimizer's `param_groups[0]["lr"]` each step. error_budget: the bound's quantization
    budget; None calibrates it on the first step so that the last step would use `target_bits`
    at the first step's gradient norm and learning rate (docs/dqsgd.md). tensorboard: a directory (rank 0
    writes) or a SummaryWriter that gets per-step scalars under `crossover/` (docs/compression.md).
    """

    def __init__(self, *, total_steps: int, lr: LR = None, error_budget: float | None = None,
                 target_bits: int = 6, b_min: int = 2, b_max: int = 8, decay: float = 0.999,
                 error_feedback: bool = False, min_compress_numel: int = 16384, seed: int = 0,
                 transport: str = "auto", tensorboard: Any = None) -> None:
        settings = dqsgd_settings(total_steps=total_steps, lr=lr, error_budget=error_budget, target_bits=target_bits,
                                  b_min=b_min, b_max=b_max, decay=decay)
        self.total_steps, self.lr, self.target_bits = total_steps, lr, target_bits
        super().__init__(QuantStepDriver(bits=target_bits, dqsgd=settings, tensorboard=tensorboard, rank=hvd.rank),
                         error_feedback=error_feedback, min_compress_numel=min_compress_numel, seed=seed,
                         transport=transport, lr=lr)
