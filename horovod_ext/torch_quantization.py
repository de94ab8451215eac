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
import math
from collections.abc import Callable, Mapping
from typing import Any, Union

import horovod.torch as hvd
import torch

from crossover.compression.quant_codec import TRANSPORTS, QuantCodec, choose_quant_transport
from crossover.driver import QuantStepDriver, dqsgd_settings, lr_at
from horovod_ext._torch_host import TorchHookBase

__all__ = ["DqsgdCompression", "QSGDCompression", "choose_quant_transport", "TRANSPORTS"]

log = logging.getLogger(__name__)
LR = Union[float, Callable[[int], float], None]


class _QuantizedCompression(TorchHookBase):
    """A bits-per-step driver and a quantizing codec: the shared body of DQ-SGD and QSGD."""

    def __init__(self, driver: QuantStepDriver, *, error_feedback: bool, min_compress_numel: int, seed: int,
                 transport: str) -> None:
        super().__init__(min_compress_numel=min_compress_numel)
        self.codec = QuantCodec(error_feedback=error_feedback, seed=seed, transport=transport)
        self.driver = driver
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self.transport = transport

    @property
    def _residuals(self) -> dict[str, torch.Tensor]:
        return self.codec.memory._residuals

    def _begin_step(self) -> None:
        self.driver.begin_step(self.comm.size())

    def _count(self, sent: int, dense: int) -> None:
        self.driver.count(sent, dense)

    def _compress_float(self, tensor: torch.Tensor, key: str) -> tuple[torch.Tensor, Any]:
        self.driver.add_tensor(tensor.numel())
        payload, ctx, sent = self.codec.encode(key, tensor, self.driver.bits, self.driver.step, self.comm)
        self.driver.count(sent, 0)
        return payload, ctx

    def _decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        out, (one, sq) = self.codec.decode(tensor, ctx, self.comm)
        if not math.isfinite(sq):
            self._step_keys[ctx.key] = True  # the codec reset its residual
        self.driver.add_reduced_sq(one, sq, self.comm.size())
        return out

    def _mark_nonfinite(self) -> None:
        self.driver.mark_nonfinite()

    def _step_nonfinite(self) -> bool:
        return self.driver.step_nonfinite

    def reset(self) -> None:
        """Forget the step in flight (elastic reset); policy state stays."""
        super().reset()
        self.driver.reset()

    def stats(self) -> dict[str, Any]:
        """Cumulative telemetry of this rank, with the bits of the step in flight; flat (`policy/...`)."""
        self._between_steps()
        return self.driver.stats()

    def close_tensorboard(self) -> None:
        """`tensorboard=`: log the step in flight, write everything, stop logging (done at exit anyway)."""
        self.driver.close_tensorboard()

    def state_dict(self) -> dict[str, Any]:
        """Policy (with its calibrated budget), step counter, residuals."""
        self._between_steps()
        return {**self.driver.state_dict(), "residuals": self.codec.memory.state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`: validated first (ValueError, nothing changed), then applied."""
        residuals = state.get("residuals", {}) if isinstance(state, Mapping) else {}
        self.codec.memory.validate(residuals)
        self.driver.load_state_dict(state)
        self.codec.memory.load(residuals)
        TorchHookBase.reset(self)


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
                         transport=transport)

    @property
    def policy(self) -> Any:
        return self.driver.policy

    def _optimizer_seen(self, opt: Any) -> None:
        self.driver.lr = lr_at(self.lr, self.driver.step, lambda: _optimizer_lr(opt))


def _optimizer_lr(opt: Any) -> float:
    groups = getattr(opt, "param_groups", None)
    if not groups:
        raise RuntimeError("DQ-SGD needs the learning rate: pass lr= (a number or a callable step -> lr) "
                           "when the compression is not used by hvd.DistributedOptimizer")
    return float(groups[0]["lr"])
