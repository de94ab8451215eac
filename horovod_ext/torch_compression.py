"""Horovod compression objects for `horovod.torch`: adaptive (GraVAC) and static sparsification.

Use:  hvd.DistributedOptimizer(opt, named_parameters=..., compression=AdaptiveCompression())

How it fits Horovod's hook (see docs/compression.md):
* `compress(tensor)` is called once per gradient in the backward hook; Horovod then allreduces
  what it returns with the optimizer's op and scale factors; `decompress` runs in `synchronize()`.
* Per-parameter state (error-feedback residuals) is keyed by Horovod's parameter name, read from
  the optimizer frame that calls `compress` (Horovod does not pass it); the step boundary is the
  first `compress` after a `decompress`.
* Every rank decides the same: the plan for a step depends only on statistics summed over ranks
  inside earlier steps' payloads (a small stats vector rides in every compressed payload).
  Its first element is 1.0 on every rank; after the reduction it tells the scale Horovod applied
  (1 for Average, world size for Sum), which is how allgathered values get averaged correctly.
* Rank-specific selections (top-k, DGC, RedSync) travel by an allgather issued inside `compress`;
  shared-index random-k and dense sends go in the allreduced payload itself.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import horovod.torch as hvd
import torch

from crossover.adaptive.gravac import StepStats
from crossover.adaptive.static import StaticPolicy
from crossover.compression import cost_model, kernels
from crossover.compression.selectors import Selector, apply_mask, k_for, make_selector
from horovod_ext._hook import GradientKeys, hook_caller
from horovod_ext._policies import dqsgd_instead, gravac_or_dense

__all__ = ["AdaptiveCompression", "FP16Compression", "StaticCompression"]

log = logging.getLogger(__name__)
_STATE_VERSION = 1


@dataclass
class _Ctx:
    kind: str  # "ag" (allgather), "ar" (shared-index allreduce) or "dense" (with stats)
    key: str
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    nprobes: int
    handle: Any = None
    idx: torch.Tensor | None = None
    k: int = 0


@dataclass
class _StepAccum:
    """Global statistics of one step, summed over tensors as their decompress runs."""

    sent_cf: float
    probes: tuple[float, ...]
    dense_sq: float = 0.0
    probe_sq: list[float] = field(default_factory=list)
    prev_step_time: float | None = None
    bytes_sent: int = 0
    bytes_dense: int = 0
    tensors: int = 0


class _SparseCompressionBase:
    """Shared machinery: selection, error feedback, transport, step bookkeeping, telemetry."""

    def __init__(self, compressor: str, policy: Any, *, error_feedback: bool, min_compress_numel: int,
                 seed: int, log_csv: str | None) -> None:
        if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) \
                or min_compress_numel < 1:
            raise ValueError(f"min_compress_numel must be an int >= 1, got {min_compress_numel!r}")
        self.selector: Selector = make_selector(compressor)
        self.compressor = compressor
        self.policy = policy
        self.error_feedback = bool(error_feedback)
        self.min_compress_numel = min_compress_numel
        self.seed = int(seed)
        self.log_csv = log_csv
        self._residuals: dict[str, torch.Tensor] = {}
        self._outputs: dict[str, torch.Tensor] = {}
        self._stats_bufs: dict[str, torch.Tensor] = {}
        self._bytes_sent = 0
        self._bytes_dense = 0
        self._step = 0  # optimizer steps begun; identical on every rank
        self._reset_step_state()

    # ------------------------------------------------------------------ step bookkeeping
    def _reset_step_state(self) -> None:
        self._phase = "idle"  # "compress" during backward, "decompress" during synchronize
        self._cur: _StepAccum | None = None
        self._pending: _StepAccum | None = None  # a finished step waiting for its step time
        self._keys = GradientKeys()
        self._step_start: float | None = None
        self._last_step_time = 0.0

    def reset(self) -> None:
        """Forget the step in flight (call from a Horovod elastic reset callback); policy state stays."""
        self._reset_step_state()

    def _begin_step(self) -> None:
        now = time.perf_counter()
        if self._step_start is not None:
            self._last_step_time = now - self._step_start
        self._step_start = now
        self._step += 1
        if self._cur is not None:
            self._finish_step(self._cur)
        plan = self.policy.plan()
        self._cur = _StepAccum(sent_cf=plan.send_cf, probes=tuple(plan.probe_cfs))
        self._cur.probe_sq = [0.0] * len(self._cur.probes)
        self._keys.begin()
        self._phase = "compress"

    def _finish_step(self, acc: _StepAccum) -> None:
        """Step t's gains are known now; its time arrives with step t+1: observe one step late."""
        if self._pending is not None and acc.prev_step_time is not None:
            p = self._pending
            self.policy.observe(StepStats(
                sent_cf=p.sent_cf, dense_sq_norm=p.dense_sq,
                compressed_sq_norms=dict(zip(p.probes, p.probe_sq)),
                step_time_s=acc.prev_step_time, samples=1.0))
            self._write_csv(p, acc.prev_step_time)
        self._pending = acc if acc.tensors else None

    # ------------------------------------------------------------------ Horovod interface
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Called by Horovod per gradient; returns the tensor to allreduce and a context."""
        if self._phase != "compress":
            self._begin_step()
        name, _ = hook_caller(tensor)
        cur = self._cur
        self._count_dense(tensor.numel() * tensor.element_size())
        if (not tensor.is_floating_point() or tensor.is_sparse or tensor.dtype != torch.float32
                or tensor.numel() < self.min_compress_numel or (cur.sent_cf <= 1 and not cur.probes)):
            self._count_sent(tensor.numel() * tensor.element_size())
            return tensor, None  # pass through untouched
        key, repeated = self._keys.key(name)
        if repeated:  # same parameter twice in one step: treat as a new step
            self._begin_step()
            self._keys.key(name)
        return self._compress_float(tensor, key)

    def _compress_float(self, tensor: torch.Tensor, key: str) -> tuple[torch.Tensor, Any]:
        cur = self._cur
        numel = tensor.numel()
        grad = tensor.detach().reshape(-1)
        if not grad.is_contiguous():
            grad = grad.contiguous()
        residual = None
        if self.error_feedback:
            residual = self._residuals.get(key)
            if residual is None or residual.numel() != numel or residual.device != grad.device:
                residual = torch.zeros_like(grad)
                self._residuals[key] = residual
        world = hvd.size()
        levels = sorted({cf for cf in (*cur.probes, cur.sent_cf) if cf > 1})
        seed = _mix(self.seed, self._step, key)
        sel = self.selector.select(key, grad, residual, levels[0], seed) if levels else None
        sq = {}  # cf -> ||C_cf(acc)||^2, multi-level: higher CFs compress the first-level selection
        masks = {}
        for cf in levels:
            if cf == levels[0]:
                sq[cf] = sel.sumsq_sel
            else:
                masks[cf] = self.selector.subselect(sel, numel, cf, seed ^ int(cf))
                sq[cf] = kernels.sumsq(sel.val[masks[cf]].contiguous())
        stats = self._stats_vector(key, len(cur.probes), grad.device)
        stats[2] = sel.sumsq_acc if sel is not None else kernels.sumsq(grad)
        for i, cf in enumerate(cur.probes):
            stats[3 + i] = sq[cf] if cf in sq else stats[2]
        cur.tensors += 1

        send_cf = cur.sent_cf
        k = k_for(numel, send_cf) if send_cf > 1 else numel
        transport = cost_model.choose_transport(numel, k, world, self.selector.shared_indices)
        if send_cf > 1 and send_cf != levels[0]:  # send a higher level: the rest returns to the residual
            sel = apply_mask(sel, masks[send_cf], residual)
        ctx = _Ctx(kind="dense", key=key, shape=tensor.shape, numel=numel, dtype=tensor.dtype,
                   nprobes=len(cur.probes))
        if transport == cost_model.DENSE:
            if sel is not None:  # undo the selection: send acc whole, residual becomes zero
                acc = residual if residual is not None else grad
                if residual is not None:
                    kernels.scatter_add(acc, sel.idx, sel.val)
                payload = torch.cat([acc, stats])
                if residual is not None:
                    residual.zero_()
            else:
                payload = torch.cat([grad, stats])
            self._count_sent(payload.numel() * 4)
            return payload, ctx
        if transport == cost_model.ALLREDUCE:
            ctx.kind, ctx.idx, ctx.k = "ar", sel.idx, sel.idx.numel()
            payload = torch.cat([sel.val, stats])
            self._count_sent(payload.numel() * 4)
            return payload, ctx
        # ALLGATHER: (index, value bits) pairs from every rank; the stats ride the stock allreduce.
        count = sel.idx.numel()
        packed = self._packed(key, count, grad.device)
        packed[:, 0] = sel.idx
        packed[:, 1] = sel.val.view(torch.int32)
        ctx.kind = "ag"
        ctx.handle = hvd.allgather_async(packed, name=f"crossover.allgather.{key}")
        self._count_sent(packed.numel() * 4 + stats.numel() * 4)
        return stats, ctx

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Called by Horovod in synchronize() with the reduced tensor; returns the averaged gradient."""
        if ctx is None:
            return tensor
        self._phase = "decompress"
        n = ctx.nprobes
        stats = tensor[-(3 + n):]
        scale = float(stats[0])  # 1 for Average, world size for Sum (times any pre/postscale)
        world = hvd.size()
        cur = self._cur
        if cur is not None and scale > 0:
            to_sum = world / scale  # turns a reduced statistic into the sum over ranks
            if cur.prev_step_time is None:
                cur.prev_step_time = float(stats[1]) / scale
            cur.dense_sq += float(stats[2]) * to_sum
            for i in range(n):
                cur.probe_sq[i] += float(stats[3 + i]) * to_sum
        if ctx.kind == "dense":
            return tensor[:ctx.numel].view(ctx.shape)
        out = self._outputs.get(ctx.key)
        if out is None or out.numel() != ctx.numel or out.device != tensor.device:
            out = torch.empty(ctx.numel, dtype=torch.float32, device=tensor.device)
            self._outputs[ctx.key] = out
        if ctx.kind == "ar":
            kernels.zero_scatter(out, ctx.idx, tensor[:ctx.k].contiguous())
        else:
            gathered = hvd.synchronize(ctx.handle)
            idx = gathered[:, 0].contiguous()
            val = gathered[:, 1].contiguous().view(torch.float32)
            kernels.zero_scatter(out, idx, val, scale / world)
        return out.view(ctx.shape)

    def _count_sent(self, nbytes: int) -> None:
        self._cur.bytes_sent += nbytes
        self._bytes_sent += nbytes

    def _count_dense(self, nbytes: int) -> None:
        self._cur.bytes_dense += nbytes
        self._bytes_dense += nbytes

    # ------------------------------------------------------------------ buffers
    def _stats_vector(self, key: str, nprobes: int, device: torch.device) -> torch.Tensor:
        v = torch.empty(3 + nprobes, dtype=torch.float32, device=device)
        v[0] = 1.0
        v[1] = self._last_step_time
        return v

    def _packed(self, key: str, count: int, device: torch.device) -> torch.Tensor:
        buf = self._stats_bufs.get(key)
        if buf is None or buf.shape[0] < count or buf.device != device:
            buf = torch.empty((max(count, 1), 2), dtype=torch.int32, device=device)
            self._stats_bufs[key] = buf
        return buf[:count]

    # ------------------------------------------------------------------ telemetry and state
    def stats(self) -> dict[str, Any]:
        """Cumulative telemetry of this rank: step, CF in use, gain, bytes sent vs dense."""
        summary = self.policy.summary()
        cf = summary.get("send_cf", 1.0)
        gains = summary.get("gains", {}) or {}
        gain = gains.get(cf, 1.0 if cf == 1.0 else None)
        return {"step": self._step, "compression_factor": cf, "gain": gain,
                "bytes_sent": self._bytes_sent, "bytes_dense": self._bytes_dense,
                "compressor": self.compressor, "policy": summary}

    def _write_csv(self, p: _StepAccum, step_time: float) -> None:
        if not self.log_csv:
            return
        path = self.log_csv.format(rank=hvd.rank())
        new = not _exists(path)
        with open(path, "a", newline="") as fh:
            w = csv.writer(fh)
            if new:
                w.writerow(["step", "sent_cf", "step_time_s", "bytes_sent", "bytes_dense"]
                           + [f"gain_cf{cf:g}" for cf in p.probes])
            gains = [math.sqrt(sq / p.dense_sq) if p.dense_sq > 0 else "" for sq in p.probe_sq]
            w.writerow([self._step - 2, p.sent_cf, f"{step_time:.6f}", p.bytes_sent, p.bytes_dense] + gains)

    def state_dict(self, include_residuals: bool = True) -> dict[str, Any]:
        """Everything a resumed run needs to continue the same schedule."""
        state = {"version": _STATE_VERSION, "compressor": self.compressor, "seed": self.seed,
                 "policy": self.policy.state_dict(), "bytes_sent": self._bytes_sent,
                 "bytes_dense": self._bytes_dense, "step": self._step,
                 # the last two steps' statistics, not yet fed to the policy (it observes one step late)
                 "current": _accum_to_dict(self._cur), "pending": _accum_to_dict(self._pending),
                 "last_step_time": self._last_step_time}
        if include_residuals:
            state["residuals"] = {k: v.clone() for k, v in self._residuals.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`; the step in flight (if any) is dropped."""
        if state.get("version") != _STATE_VERSION or state.get("compressor") != self.compressor:
            raise ValueError(f"state is for compressor {state.get('compressor')!r} version "
                             f"{state.get('version')!r}; this is {self.compressor!r} v{_STATE_VERSION}")
        self.policy.load_state_dict(state["policy"])
        self.seed = int(state["seed"])
        self._bytes_sent = int(state.get("bytes_sent", 0))
        self._bytes_dense = int(state.get("bytes_dense", 0))
        self._step = int(state.get("step", 0))
        if "residuals" in state:
            self._residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self._reset_step_state()
        self._cur = _accum_from_dict(state.get("current"))
        self._pending = _accum_from_dict(state.get("pending"))
        self._last_step_time = float(state.get("last_step_time", 0.0))
        if self._cur is not None:
            self._phase = "decompress"  # the next compress finishes the restored step

    def sync(self, root_rank: int = 0) -> None:
        """Make every rank's policy state equal to `root_rank`'s (after an elastic reset, or a resume
        where ranks loaded different checkpoints); residuals stay per rank."""
        state = hvd.broadcast_object(self.state_dict(include_residuals=False), root_rank=root_rank,
                                     name="crossover.compression.sync")
        residuals = self._residuals
        self.load_state_dict(state)
        self._residuals = residuals


class AdaptiveCompression(_SparseCompressionBase):
    """GraVAC: sparsify with `compressor`, adapting the compression factor during training.

    Parameters follow the paper (docs/gravac.md): cf_min, cf_max, epsilon, omega, window, scaling,
    warmup_steps, ewma_alpha. `enabled=False` turns compression off (exact dense allreduce).
    `min_compress_numel`: smaller tensors (biases, norms) go dense. `log_csv`: a path, may contain
    `{rank}`, that gets one row per step.
    """

    def __new__(cls, *args: Any, policy: str = "gravac", **kwargs: Any) -> Any:
        """policy="dqsgd" gives a DqsgdCompression (quantization bits per step) instead of GraVAC."""
        if policy == "dqsgd":
            from .torch_quantization import DqsgdCompression

            return dqsgd_instead(DqsgdCompression, args, kwargs)
        return super().__new__(cls)

    def __init__(self, compressor: str = "topk", *, cf_min: float = 10.0, cf_max: float = 1000.0,
                 epsilon: float = 0.9, omega: float = 0.01, window: int = 500,
                 scaling: str = "exponential", warmup_steps: int = 0, ewma_alpha: float = 0.1,
                 error_feedback: bool = True, min_compress_numel: int = 16384, enabled: bool = True,
                 seed: int = 0, log_csv: str | None = None, policy: str = "gravac") -> None:
        pol = gravac_or_dense(enabled, policy, cf_min=cf_min, cf_max=cf_max, epsilon=epsilon, omega=omega,
                              window=window, scaling=scaling, warmup_steps=warmup_steps, ewma_alpha=ewma_alpha)
        super().__init__(compressor, pol, error_feedback=error_feedback,
                         min_compress_numel=min_compress_numel, seed=seed, log_csv=log_csv)
        self.enabled = bool(enabled)


class StaticCompression(_SparseCompressionBase):
    """A fixed compression factor: `StaticCompression("topk", cf=100)` is static top-k at 1 %."""

    def __init__(self, compressor: str = "topk", *, cf: float = 100.0, error_feedback: bool = True,
                 min_compress_numel: int = 16384, seed: int = 0, log_csv: str | None = None) -> None:
        super().__init__(compressor, StaticPolicy(cf=cf), error_feedback=error_feedback,
                         min_compress_numel=min_compress_numel, seed=seed, log_csv=log_csv)


class FP16Compression:
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

    def stats(self) -> dict[str, Any]:
        return {"step": None, "compression_factor": 2.0, "gain": None, "bytes_sent": self.bytes_sent,
                "bytes_dense": self.bytes_dense}


def _accum_to_dict(acc: _StepAccum | None) -> dict[str, Any] | None:
    return None if acc is None else {**dataclasses.asdict(acc), "probes": list(acc.probes)}


def _accum_from_dict(d: Mapping[str, Any] | None) -> _StepAccum | None:
    if d is None:
        return None
    return _StepAccum(**{**d, "probes": tuple(d["probes"]), "probe_sq": list(d["probe_sq"])})


def _mix(seed: int, step: int, key: str) -> int:
    """A seed shared by all ranks for (step, tensor): same inputs on every rank, no communication."""
    h = 1469598103934665603
    for ch in f"{seed}:{step}:{key}".encode():
        h = ((h ^ ch) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def _exists(path: str) -> bool:
    import os

    return os.path.exists(path)
