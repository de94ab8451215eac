"""DQ-SGD and QSGD for `horovod.torch`: stochastic quantization with bits chosen per step.

Use:  hvd.DistributedOptimizer(opt, named_parameters=..., compression=AdaptiveCompression(
          policy="dqsgd", total_steps=T))

Per gradient, `compress` quantizes to b-bit codes with a per-rank max-norm scale; the codes travel
packed into bytes by an allgather issued inside `compress` (Horovod's torch allreduce has no 8-bit
type), or, where the cost model prefers it (large world sizes), as dequantized fp16 values that sum
by allreduce. A small statistics vector rides the stock allreduce ([1, ||x||^2]); its reduced
value gives every rank the same global gradient norm, from which the policy picks the next step's
bits (docs/dqsgd.md). Same step detection, parameter naming and telemetry as torch_compression.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import horovod.torch as hvd
import torch

from crossover.adaptive.dqsgd import (
    MAX_BITS,
    MIN_BITS,
    DqsgdPolicy,
    levels_for_bits,
)
from crossover.compression import cost_model, kernels, quantize
from horovod_ext._hook import GradientKeys, hook_caller
from horovod_ext._policies import dqsgd_observe

from .torch_compression import _mix

__all__ = ["DqsgdCompression", "QSGDCompression"]

log = logging.getLogger(__name__)
_STATE_VERSION = 1
TRANSPORTS = ("auto", "allgather", "allreduce")
LR = Union[float, Callable[[int], float], None]


def choose_quant_transport(numel: int, bits: int, world: int) -> str:
    """ALLGATHER of packed codes, ALLREDUCE of fp16 values, or DENSE fp32, whichever sends fewest bytes."""
    options = {
        cost_model.ALLGATHER: cost_model.allgather_bytes(quantize.packed_nbytes(numel, bits) + 4, world, 1),
        cost_model.ALLREDUCE: cost_model.allreduce_bytes(numel, world, 2),
        cost_model.DENSE: cost_model.allreduce_bytes(numel, world, 4),
    }
    return min(options, key=options.get)


@dataclass
class _QCtx:
    kind: str
    key: str
    shape: torch.Size
    numel: int
    bits: int
    handle: Any = None
    seg: int = 0


class _QuantizedBase:
    """Quantization machinery shared by the adaptive (DQ-SGD) and the fixed-bits (QSGD) objects."""

    def __init__(self, *, error_feedback: bool, min_compress_numel: int, seed: int, transport: str) -> None:
        if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) \
                or min_compress_numel < 1:
            raise ValueError(f"min_compress_numel must be an int >= 1, got {min_compress_numel!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
        self.error_feedback = bool(error_feedback)
        self.min_compress_numel = min_compress_numel
        self.seed = int(seed)
        self.transport = transport
        self._residuals: dict[str, torch.Tensor] = {}
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._bytes_sent = 0
        self._bytes_dense = 0
        self._step = 0
        self._keys = GradientKeys()
        self._phase = "idle"
        self._bits = self._plan_bits()
        self._sq = 0.0  # global ||x||^2 of the step in flight, summed as decompress runs
        self._have_sq = False
        self._lr_now: float | None = None
        self._numel_step = 0

    # subclass hooks
    def _plan_bits(self) -> int:
        raise NotImplementedError

    def _observe(self, sq_norm: float, numel: int, lr: float | None) -> None:
        pass

    # ------------------------------------------------------------------ step bookkeeping
    def _begin_step(self) -> None:
        if self._step > 0 and self._have_sq:
            self._observe(self._sq, self._numel_step, self._lr_now)
        self._step += 1
        self._sq, self._have_sq, self._numel_step = 0.0, False, 0
        self._bits = self._plan_bits()
        self._phase = "compress"
        self._keys.begin()

    def reset(self) -> None:
        """Forget the step in flight (elastic reset); policy state stays."""
        self._phase = "idle"
        self._have_sq = False

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Called by Horovod per gradient; returns the tensor to allreduce and a context."""
        if self._phase != "compress":
            self._begin_step()
        name, opt = hook_caller(tensor)
        self._lr_now = self._lr_from(opt)
        nbytes = tensor.numel() * tensor.element_size()
        self._bytes_dense += nbytes
        if (tensor.dtype != torch.float32 or tensor.is_sparse or tensor.numel() < self.min_compress_numel):
            self._bytes_sent += nbytes
            return tensor, None
        key, repeated = self._keys.key(name)
        if repeated:  # same parameter twice in one step: treat as a new step
            self._begin_step()
            self._keys.key(name)
        return self._compress_float(tensor, key)

    def _lr_from(self, opt: Any) -> float | None:
        return None

    def _compress_float(self, tensor: torch.Tensor, key: str) -> tuple[torch.Tensor, Any]:
        numel, bits = tensor.numel(), self._bits
        s = levels_for_bits(bits)
        x = tensor.detach().reshape(-1)
        if not x.is_contiguous():
            x = x.contiguous()
        residual = None
        if self.error_feedback:
            residual = self._residuals.get(key)
            if residual is None or residual.numel() != numel:
                residual = torch.zeros_like(x)
                self._residuals[key] = residual
            sq = kernels.ef_accumulate(x, residual)  # residual = x + residual: quantize that, in place
            x = residual
        else:
            sq = kernels.sumsq(x)
        self._numel_step += numel
        scale = quantize.absmax(x) or 1.0  # an all-zero tensor quantizes to zeros at any scale
        seed = _mix(self.seed, self._step, f"{key}:{hvd.rank()}")  # independent rounding per rank
        stats = torch.tensor([1.0, sq], dtype=torch.float32)
        kind = self.transport if self.transport != "auto" else choose_quant_transport(numel, bits, hvd.size())
        ctx = _QCtx(kind=kind, key=key, shape=tensor.shape, numel=numel, bits=bits)
        if kind == cost_model.DENSE:
            payload = torch.cat([x, stats])
            if residual is not None:
                residual.zero_()
            self._bytes_sent += payload.numel() * 4
            return payload, ctx
        if kind == cost_model.ALLREDUCE:  # dequantized fp16 values sum across ranks
            vals = self._buf(key, "vals", numel, torch.float32)
            quantize.quantize_levels(x, scale, s, seed, self._buf(key, "lev", numel, torch.int32),
                                     residual_out=residual)
            quantize.dequantize_levels(self._buf(key, "lev", numel, torch.int32), scale, s, vals)
            # fp16 stats: ||x||^2 travels as a mean square (clamped below fp16's max) and is scaled back
            stats[1] = min(sq / numel, 60000.0)
            payload = torch.cat([vals.half(), stats.half()])
            self._bytes_sent += payload.numel() * 2
            ctx.kind = "ar"
            return payload, ctx
        seg = 4 + quantize.packed_nbytes(numel, bits)
        packed = self._buf(key, "packed", seg, torch.uint8)
        packed[:4] = torch.tensor([scale], dtype=torch.float32).view(torch.uint8)
        quantize.quantize_pack(x, scale, s, bits, seed, packed[4:], residual_out=residual)
        ctx.kind, ctx.seg = "ag", seg
        ctx.handle = hvd.allgather_async(packed, name=f"crossover.qallgather.{key}")
        self._bytes_sent += seg + stats.numel() * 4
        return stats, ctx

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Called by Horovod in synchronize() with the reduced tensor; returns the averaged gradient."""
        if ctx is None:
            return tensor
        self._phase = "decompress"
        world = hvd.size()
        stats = tensor[-2:].float()
        scale_back = float(stats[0])  # 1 for Average, world size for Sum
        if scale_back > 0:
            sq = float(stats[1]) * (ctx.numel if ctx.kind == "ar" else 1)
            self._sq += sq * world / scale_back
            self._have_sq = True
        if ctx.kind == cost_model.DENSE:
            return tensor[:ctx.numel].view(ctx.shape)
        if ctx.kind == "ar":
            return tensor[:ctx.numel].float().view(ctx.shape)
        gathered = hvd.synchronize(ctx.handle)
        out = self._buf(ctx.key, "out", ctx.numel, torch.float32)
        s = levels_for_bits(ctx.bits)
        for r in range(gathered.numel() // ctx.seg):  # one decode per rank, each with its own scale
            seg = gathered[r * ctx.seg:(r + 1) * ctx.seg]
            scale = float(seg[:4].clone().view(torch.float32)[0])  # clone: the slice may be unaligned
            quantize.unpack_dequantize(seg[4:], ctx.numel, scale, s, ctx.bits, out,
                                       accumulate=r > 0, weight=scale_back / world)
        return out.view(ctx.shape)

    def _buf(self, key: str, what: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get((key, what))
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(n, dtype=dtype)
            self._buffers[(key, what)] = buf
        return buf[:n]

    def stats(self) -> dict[str, Any]:
        """Cumulative telemetry of this rank, with the bits of the step in flight."""
        return {"step": self._step, "bits": self._bits, "compression_factor": 32.0 / self._bits, "gain": None,
                "bytes_sent": self._bytes_sent, "bytes_dense": self._bytes_dense}


class QSGDCompression(_QuantizedBase):
    """Static QSGD: `bits` per element (2 = TernGrad-style ternary), stochastic rounding, max-norm scale."""

    def __init__(self, bits: int = 8, *, error_feedback: bool = False, min_compress_numel: int = 16384,
                 seed: int = 0, transport: str = "auto") -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
            raise ValueError(f"bits must be an int in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
        self.fixed_bits = bits
        super().__init__(error_feedback=error_feedback, min_compress_numel=min_compress_numel, seed=seed,
                         transport=transport)

    def _plan_bits(self) -> int:
        return self.fixed_bits


class DqsgdCompression(_QuantizedBase):
    """DQ-SGD: the bits of each step from the gradient norm, learning rate, step and horizon.

    total_steps (required): the training horizon T. lr: a number, a callable step -> lr, or None to
    read the optimizer's `param_groups[0]["lr"]` each step. error_budget: the bound's quantization
    budget; None calibrates it on the first step so that the last step would use `target_bits`
    at the first step's gradient norm and learning rate (docs/dqsgd.md).
    """

    def __init__(self, *, total_steps: int, lr: LR = None, error_budget: float | None = None,
                 target_bits: int = 6, b_min: int = 2, b_max: int = 8, decay: float = 0.999,
                 error_feedback: bool = False, min_compress_numel: int = 16384, seed: int = 0,
                 transport: str = "auto") -> None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be an int >= 1 (the training horizon DQ-SGD plans bits for), "
                             f"got {total_steps!r}")
        if lr is not None and not callable(lr) and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                                                    or not lr > 0):
            raise ValueError(f"lr must be a number > 0, a callable step -> lr, or None (read from the "
                             f"optimizer), got {lr!r}")
        self._policy_kw = {"total_steps": total_steps, "b_min": b_min, "b_max": b_max, "decay": decay}
        # validates b_min, b_max, decay, error_budget now (construction), not on the first step
        self.policy: DqsgdPolicy | None = DqsgdPolicy(error_budget=1.0 if error_budget is None else error_budget,
                                                      **self._policy_kw)
        if isinstance(target_bits, bool) or not isinstance(target_bits, int) or not b_min <= target_bits <= b_max:
            raise ValueError(f"target_bits must be an int in [b_min, b_max] = [{b_min}, {b_max}], got {target_bits!r}")
        self.total_steps, self.lr, self.target_bits = total_steps, lr, target_bits
        self._policy_kw["initial_bits"] = target_bits
        if error_budget is None:
            self.policy = None  # calibrated on the first observation
        super().__init__(error_feedback=error_feedback, min_compress_numel=min_compress_numel, seed=seed,
                         transport=transport)

    def _lr_from(self, opt: Any) -> float | None:
        if callable(self.lr):
            return float(self.lr(self._step))
        if self.lr is not None:
            return float(self.lr)
        groups = getattr(opt, "param_groups", None)
        if not groups:
            raise RuntimeError("DQ-SGD needs the learning rate: pass lr= (a number or a callable step -> lr) "
                               "when the compression is not used by hvd.DistributedOptimizer")
        return float(groups[0]["lr"])

    def _plan_bits(self) -> int:
        return self.target_bits if self.policy is None else self.policy.plan().bits

    def _observe(self, sq_norm: float, numel: int, lr: float | None) -> None:
        self.policy = dqsgd_observe(self.policy, sq_norm=sq_norm, world=hvd.size(), numel=numel, lr=lr,
                                    step=self._step - 1, bits=self._bits, target_bits=self.target_bits,
                                    total_steps=self.total_steps, policy_kw=self._policy_kw)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["policy"] = None if self.policy is None else self.policy.summary()
        return out

    def state_dict(self) -> dict[str, Any]:
        """Policy (with its calibrated budget), step counter, residuals."""
        return {"version": _STATE_VERSION, "step": self._step, "bits": self._bits,
                "policy": None if self.policy is None else self.policy.state_dict(),
                "bytes_sent": self._bytes_sent, "bytes_dense": self._bytes_dense,
                "residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported DqsgdCompression state version {state.get('version')!r}")
        self.policy = None if state["policy"] is None else DqsgdPolicy.from_state_dict(state["policy"])
        self._step, self._bits = int(state["step"]), int(state["bits"])
        self._bytes_sent, self._bytes_dense = int(state["bytes_sent"]), int(state["bytes_dense"])
        self._residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}
        self._phase, self._have_sq = "idle", False
