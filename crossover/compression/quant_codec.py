"""Stochastic quantization (QSGD levels, DQ-SGD bits) with optional error feedback, for every host.

`QuantCodec.encode(key, tensor, bits, step, comm)` quantizes one gradient at `bits` bits per element
and returns the payload the host reduces; `decode` returns the averaged gradient and the reduced
statistics `[1, ||x||^2]` (x = gradient + residual), which feed DQ-SGD's next choice of bits.

Transports, decided by the caller per tensor (crossover/driver/transport.py, `quant_route`): packed codes by
allgather (torch allreduce has no 8-bit type; each rank's codes carry their own scale, so they cannot be
summed), or dequantized fp16 values by allreduce (summable; wins for large worlds).

Agreement (wire.py): on the allgather the float32 statistics end with the agreement checks, judged in decode
before the wait, since ranks that disagree on the shape or the bits would gather segments of other lengths and
decode garbage silently. The allreduce path issues no collective of its own: a rank at other bits still sums
correct values, and another shape or transport changes the payload's length or dtype, which Horovod and
torch.distributed refuse (their own "Mismatched" error on every rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from . import cost_model, kernels, quantize
from .checks import check_seed
from .collectives import Collectives
from .memory import ErrorFeedback
from .wire import CHECK_LEN, QUANT_STATS_LEN, Agreement, clamp_stat, levels_for_bits, shared_seed

__all__ = ["QuantCodec", "QuantCtx"]

_FP16_MEAN_SQ_MAX = 60000.0  # ||x||^2 / n travels in fp16 on the fp16 path: clamp below fp16's max


@dataclass
class QuantCtx:
    kind: str  # cost_model.ALLREDUCE (fp16 values) / cost_model.ALLGATHER (packed codes)
    key: str
    shape: torch.Size
    numel: int
    bits: int
    handle: Any = None
    seg: int = 0
    residual: torch.Tensor | None = None  # reset if the step turns out non-finite
    agreement: Agreement | None = None  # allgather: what the ranks must do alike, checked in decode before the wait


class QuantCodec:
    """Quantizer + error-feedback memory + transports for float32 gradients."""

    def __init__(self, *, error_feedback: bool = False, seed: int = 0) -> None:
        self.memory = ErrorFeedback(error_feedback)
        self.seed = check_seed(seed)
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def encode(self, key: str, tensor: torch.Tensor, bits: int, step: int, comm: Collectives,
               kind: str) -> tuple[torch.Tensor, QuantCtx, int]:
        """(payload for the host's reduction, context for `decode`, bytes this rank sends); `kind`: the tensor's
        transport, cost_model.ALLREDUCE or ALLGATHER."""
        numel = tensor.numel()
        s = levels_for_bits(bits)
        x = tensor.detach().reshape(-1)
        if not x.is_contiguous():
            x = x.contiguous()
        residual = self.memory.residual(key, x)
        if residual is not None:
            sq = kernels.ef_accumulate(x, residual)  # residual = x + residual: quantize that, in place
            x = residual
        else:
            sq = kernels.sumsq(x)
        if not math.isfinite(sq):  # inf/NaN here: send zeros and the non-finite ||x||^2, which marks the
            x = torch.zeros_like(x)  # step on every rank (decode); a rare path, so the copy is fine
        scale = quantize.absmax(x) or 1.0  # an all-zero tensor quantizes to zeros at any scale
        seed = shared_seed(self.seed, step, f"{key}:{comm.rank()}")  # independent rounding per rank
        stats = torch.tensor([1.0, clamp_stat(sq)], dtype=torch.float32, device=x.device)  # sq: float64, clamped
        ctx = QuantCtx(kind=kind, key=key, shape=tensor.shape, numel=numel, bits=bits, residual=residual)
        if kind == cost_model.ALLREDUCE:  # dequantized fp16 values sum across ranks
            vals = self._buf(key, "vals", numel, torch.float32, x.device)
            lev = self._buf(key, "lev", numel, torch.int32, x.device)
            quantize.quantize_levels(x, scale, s, seed, lev, residual_out=residual)
            quantize.dequantize_levels(lev, scale, s, vals)
            stats[1] = clamp_stat(sq / numel, _FP16_MEAN_SQ_MAX)  # a mean square: scaled back in decode
            payload = torch.cat([vals.half(), stats.half()])
            return payload, ctx, payload.numel() * 2
        seg = 4 + quantize.packed_nbytes(numel, bits)
        packed = self._buf(key, "packed", seg, torch.uint8, x.device)
        packed[:4] = torch.tensor([scale], dtype=torch.float32, device=x.device).view(torch.uint8)
        quantize.quantize_pack(x, scale, s, bits, seed, packed[4:], residual_out=residual)
        ctx.seg = seg
        ctx.agreement = Agreement.of(tensor, compressor=f"{bits}-bit quantization", sent_cf=32.0 / bits, transport=kind)
        checks = torch.tensor(ctx.agreement.values(comm.size()), dtype=torch.float32, device=x.device)
        ctx.handle = comm.allgather_async(packed, f"crossover.qallgather.{key}")
        payload = torch.cat([stats, checks])
        return payload, ctx, seg + payload.numel() * 4

    def decode(self, reduced: torch.Tensor, ctx: QuantCtx,
               comm: Collectives) -> tuple[torch.Tensor, tuple[float, float]]:
        """(the averaged gradient in the tensor's shape, the reduced (1, ||x||^2) as plain numbers).

        A non-finite reduced ||x||^2 (inf/NaN on some rank; identical on every rank) resets this
        tensor's residual and decodes to NaN everywhere, so a GradScaler-style check skips the step.
        """
        out, (one, sq) = self._decode(reduced, ctx, comm)
        if not math.isfinite(sq):
            if ctx.residual is not None:
                ctx.residual.zero_()
            out.fill_(float("nan"))
        ctx.residual = None
        return out, (one, sq)

    def _decode(self, reduced: torch.Tensor, ctx: QuantCtx,
                comm: Collectives) -> tuple[torch.Tensor, tuple[float, float]]:
        world = comm.size()
        if ctx.kind == cost_model.ALLREDUCE:  # [fp16 values, 1, ||x||^2 / numel]
            stats = reduced[-QUANT_STATS_LEN:].float()
            one, sq = float(stats[0]), float(stats[1]) * ctx.numel  # one: 1 for Average, world size for Sum
            return reduced[:ctx.numel].float().view(ctx.shape), (one, sq)
        host = reduced.tolist()  # [1, ||x||^2, agreement checks]
        one, sq = host[0], host[1]
        if ctx.agreement is not None:  # before the wait: a disagreement raises on every rank instead of garbage
            ctx.agreement.check(host[QUANT_STATS_LEN:QUANT_STATS_LEN + CHECK_LEN], one, world, ctx.key, comm.rank())
        gathered = comm.wait(ctx.handle)
        out = self._buf(ctx.key, "out", ctx.numel, torch.float32, reduced.device)
        s = levels_for_bits(ctx.bits)
        for r in range(gathered.numel() // ctx.seg):  # one decode per rank, each with its own scale
            seg = gathered[r * ctx.seg:(r + 1) * ctx.seg]
            scale = float(seg[:4].clone().view(torch.float32)[0])  # clone: the slice may be unaligned
            quantize.unpack_dequantize(seg[4:], ctx.numel, scale, s, ctx.bits, out,
                                       accumulate=r > 0, weight=one / world)
        return out.view(ctx.shape), (one, sq)

    def _buf(self, key: str, what: str, n: int, dtype: torch.dtype,
             device: torch.device | None = None) -> torch.Tensor:
        device = torch.device("cpu") if device is None else device
        buf = self._buffers.get((key, what))
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[(key, what)] = buf
        return buf[:n]
