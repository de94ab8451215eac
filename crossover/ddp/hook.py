"""Adaptive gradient compression as a PyTorch DDP communication hook.

    from crossover.ddp import AdaptiveState, adaptive_hook
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = AdaptiveState()                      # GraVAC; policy="dqsgd" / "static" / "qsgd" / "fp16"
    ddp.register_comm_hook(state, adaptive_hook)

How it fits DDP (docs/ddp.md): DDP calls `adaptive_hook(state, bucket)` once per gradient bucket, in
bucket-index order, during backward; the hook returns a `torch.futures.Future` of the averaged flat
bucket, which DDP copies into the gradients before `optimizer.step()`. Unlike Horovod's compression
hook, the bucket says where a step begins (`bucket.index() == 0`) and which parameters it holds.

The same pieces as the Horovod glue (horovod_ext/torch_compression.py), none of its code: the
framework-free step driver (crossover/driver/: plans, one-step-late observation, byte
counters, state) and the codecs (crossover/compression/: selection, error feedback, quantization,
transport chosen by the cost model). This module only moves tensors:

* per bucket: encode -> `all_reduce` of the payload (pre-divided by the world size, so the reduction
  is an average) and, for rank-specific selections, the codec's own allgather, both issued from the
  hook's body so that every rank issues the same collectives in the same order -> decode in a
  `.then()` callback;
* every rank decides the same: the driver plans step t from statistics reduced over ranks inside the
  payloads of earlier steps; the callbacks only store each bucket's reduced statistics, and the hook
  feeds them to the driver in bucket order at the start of the next step (a fixed summation order,
  so the floating-point sums are identical on every rank);
* error feedback is kept per bucket and follows DDP's bucket rebuild (crossover/ddp/_buckets.py).

The per-bucket machinery all engines share is in crossover/ddp/_engine.py; this module holds the engines of
each policy family, their settings and `AdaptiveState`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, Union

import torch
import torch.distributed as dist

from crossover.adaptive.dqsgd import DqsgdPolicy
from crossover.adaptive.static import StaticPolicy
from crossover.compression.checks import check_int
from crossover.compression.cost_model import SCATTER
from crossover.compression.quant_codec import QuantCodec
from crossover.driver import (
    DEFAULT_TRANSPORT,
    UNKNOWN_MOMENTUM,
    CfPolicy,
    QuantStepDriver,
    check_transport,
    dqsgd_settings,
    gravac_or_dense,
)
from crossover.driver.flat import user_stats
from crossover.driver.session import QuantSession, cf_session, check_compressor

from ._collectives import TorchDistCollectives
from ._engine import Future, _CodecEngine, _Engine, allreduce_mean

__all__ = ["AdaptiveState", "adaptive_hook", "POLICIES", "GATHERS"]

log = logging.getLogger(__name__)

POLICIES = ("gravac", "dqsgd", "static", "qsgd", "fp16")
#: How rank-specific selections travel (Gloo's allgather needs one size on every rank): "pad" sends
#: exactly k pairs per rank (one collective); "counts" exchanges the counts first (a blocking extra one).
GATHERS = ("pad", "counts")
STATE_VERSION = 1
LR = Union[float, Callable[[int], float]]

_DQ_DEFAULTS = {name: p.default for name, p in inspect.signature(DqsgdPolicy).parameters.items()
                if name in ("b_min", "b_max", "decay")}
DEFAULT_MIN_COMPRESS_NUMEL = 16384  # as the Horovod objects: smaller buckets go dense


class _Fp16Engine(_Engine):
    """fp16 casts, as PyTorch's fp16_compress_hook, with crossover's byte counters and state."""

    name = "fp16"

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.step = 0
        self.bytes_sent = 0
        self.bytes_dense = 0
        self._half: dict[int, torch.Tensor] = {}

    def run(self, bucket: dist.GradBucket) -> Future:
        buf = bucket.buffer()
        if bucket.index() == 0:
            self.step += 1
        nbytes = buf.numel() * buf.element_size()
        self.bytes_dense += nbytes
        if buf.dtype not in (torch.float32, torch.float64):
            self.bytes_sent += nbytes
            return allreduce_mean(buf, self.group)
        half = self._half.get(bucket.index())
        if half is None or half.numel() != buf.numel() or half.device != buf.device:
            half = self._half[bucket.index()] = torch.empty(buf.numel(), dtype=torch.float16, device=buf.device)
        half.copy_(buf).div_(dist.get_world_size(self.group))  # reused: DDP finishes a step before the next
        self.bytes_sent += half.numel() * 2

        def finish(f: Future) -> torch.Tensor:
            buf.copy_(f.value()[0])
            return buf

        return dist.all_reduce(half, group=self.group, async_op=True).get_future().then(finish)

    def stats(self) -> dict[str, Any]:
        return {"step": self.step, "compression_factor": 2.0, "gain": None, "bytes_sent": self.bytes_sent,
                "bytes_dense": self.bytes_dense}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "bytes_sent": self.bytes_sent, "bytes_dense": self.bytes_dense}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        counters = [check_int(name, state.get(name), 0) for name in ("step", "bytes_sent", "bytes_dense")]
        self.step, self.bytes_sent, self.bytes_dense = counters


# ---------------------------------------------------------------------------------------------
# Construction: one validated engine per policy
# ---------------------------------------------------------------------------------------------
def _sparse_engine(group: Any, name: str, compressor: str, policy: CfPolicy, *, error_feedback: bool,
                   min_compress_numel: int, seed: int, log_csv: str | None, gather: str,
                   clock: Callable[[], float] | None, transport: str, momentum: float | None = None,
                   optimizer: Any = None) -> _Engine:
    """A compression-factor policy (GraVAC, static) driving a sparsifying codec, per bucket."""
    if check_transport(transport) == SCATTER:
        raise ValueError("transport='scatter' needs an alltoall from Horovod's background loop; the DDP hook "
                         "issues its collectives bucket by bucket and has none: use 'allgather', 'agreed' or "
                         "'auto' here")
    if gather not in GATHERS:
        raise ValueError(f"gather must be one of {', '.join(GATHERS)}; got {gather!r}")
    comm = TorchDistCollectives(group, equal_sizes=gather == "pad")
    # a DDP hook does not see the optimizer: the user says its momentum, else the safe assumption
    session = cf_session(compressor, policy, error_feedback=error_feedback, seed=seed, log_csv=log_csv,
                         rank=comm.rank, transport=transport, alltoall=False, fixed_gather=gather == "pad",
                         momentum=momentum, unknown_momentum=UNKNOWN_MOMENTUM, clock=clock)
    engine = _CodecEngine(group, name, session, min_compress_numel=min_compress_numel, optimizer=optimizer)
    engine.comm = comm
    return engine


def _build_gravac(group: Any, compressor: str = "auto", *, error_feedback: bool = True,
                  min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL, enabled: bool = True, seed: int = 0,
                  log_csv: str | None = None, gather: str = "pad", clock: Callable[[], float] | None = None,
                  momentum: float | None = None, transport: str = DEFAULT_TRANSPORT, optimizer: Any = None,
                  **gravac: Any) -> _Engine:
    check_compressor(compressor)
    try:
        policy = gravac_or_dense(enabled, **gravac)  # GravacPolicy's own defaults and checks
    except TypeError as exc:
        raise ValueError(f"policy='gravac': {exc}") from None
    if momentum is None and optimizer is None and enabled:
        log.info("crossover.ddp: AdaptiveState() was shown neither the optimizer nor its momentum, so the policy "
                 "assumes %g (SGD momentum or Adam's beta1: the compression is capped where that keeps accuracy); "
                 "pass optimizer=<your optimizer> (or momentum=, 0 for none) to cap by it (docs/accuracy.md)",
                 UNKNOWN_MOMENTUM)
    return _sparse_engine(group, "gravac", compressor, policy, error_feedback=error_feedback,
                          min_compress_numel=min_compress_numel, seed=seed, log_csv=log_csv, gather=gather,
                          clock=clock, transport=transport, momentum=momentum, optimizer=optimizer)


def _build_static(group: Any, compressor: str = "topk", *, cf: float = 100.0, error_feedback: bool = True,
                  min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL, seed: int = 0,
                  log_csv: str | None = None, gather: str = "pad", clock: Callable[[], float] | None = None,
                  transport: str = "allgather", optimizer: Any = None) -> _Engine:
    check_compressor(compressor)
    return _sparse_engine(group, "static", compressor, StaticPolicy(cf=cf), error_feedback=error_feedback,
                          min_compress_numel=min_compress_numel, seed=seed, log_csv=log_csv, gather=gather,
                          clock=clock, transport=transport, optimizer=optimizer)


def _quant_engine(group: Any, name: str, driver: QuantStepDriver, *, lr: LR | None, error_feedback: bool,
                  min_compress_numel: int, seed: int, transport: str, optimizer: Any = None) -> _Engine:
    """A bits-per-step driver (DQ-SGD, fixed QSGD) and a quantizing codec, per bucket."""
    session = QuantSession(QuantCodec(error_feedback=error_feedback, seed=seed), driver, transport_setting=transport,
                           lr=lr)
    return _CodecEngine(group, name, session, min_compress_numel=min_compress_numel, optimizer=optimizer)


def _build_dqsgd(group: Any, *, total_steps: int | None = None, lr: LR | None = None,
                 error_budget: float | None = None, target_bits: int = 6, b_min: int = _DQ_DEFAULTS["b_min"],
                 b_max: int = _DQ_DEFAULTS["b_max"], decay: float = _DQ_DEFAULTS["decay"],
                 error_feedback: bool = False, min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL, seed: int = 0,
                 transport: str = "auto", optimizer: Any = None) -> _Engine:
    if lr is None and optimizer is None:
        raise ValueError("policy='dqsgd' needs the learning rate: pass optimizer=<your optimizer> (its lr is read at "
                         "each step) or lr= (a number, or a callable step -> lr)")
    settings = dqsgd_settings(total_steps=total_steps, lr=lr, error_budget=error_budget, target_bits=target_bits,
                              b_min=b_min, b_max=b_max, decay=decay)
    return _quant_engine(group, "dqsgd", QuantStepDriver(bits=target_bits, dqsgd=settings), lr=lr,
                         error_feedback=error_feedback, min_compress_numel=min_compress_numel, seed=seed,
                         transport=transport, optimizer=optimizer)


def _build_qsgd(group: Any, *, bits: int = 8, error_feedback: bool = False,
                min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL, seed: int = 0,
                transport: str = "auto", optimizer: Any = None) -> _Engine:
    b_min, b_max = _DQ_DEFAULTS["b_min"], _DQ_DEFAULTS["b_max"]
    if isinstance(bits, bool) or not isinstance(bits, int) or not b_min <= bits <= b_max:
        raise ValueError(f"bits must be an int in [{b_min}, {b_max}], got {bits!r}")
    return _quant_engine(group, "qsgd", QuantStepDriver(bits=bits), lr=None, error_feedback=error_feedback,
                         min_compress_numel=min_compress_numel, seed=seed, transport=transport, optimizer=optimizer)


def _build_fp16(group: Any, optimizer: Any = None) -> _Engine:
    return _Fp16Engine(group)


_BUILDERS: dict[str, Callable[..., _Engine]] = {"gravac": _build_gravac, "dqsgd": _build_dqsgd,
                                                 "static": _build_static, "qsgd": _build_qsgd, "fp16": _build_fp16}


class AdaptiveState:
    """The state of `adaptive_hook` (PyTorch's `PowerSGDState` + `powerSGD_hook` convention).

    `AdaptiveState(process_group=None, *, policy="gravac", **settings)`; every setting is checked here
    (ValueError), not on the first step:

    * ``policy="gravac"`` (default): GraVAC adapts the compression factor. Settings: ``compressor`` ("auto", the
      default: low rank when the momentum below is above 0, else top-k, chosen at the first step; "topk",
      "powersgd", "randomk", "dgc", "redsync"), GravacPolicy's own (``cf_min``, ``cf_max``, ``epsilon``,
      ``omega``, ``window``, ``scaling``, ``warmup_steps``, ``ewma_alpha``: unset ones keep GravacPolicy's
      defaults), ``enabled=False`` (exact DDP averaging, for comparisons), ``error_feedback``,
      ``min_compress_numel`` (buckets smaller than this go dense), ``seed``, ``log_csv`` (per-step CSV,
      may contain ``{rank}``), ``gather`` ("pad": every rank sends exactly k (index, value) pairs in one
      allgather, the default; "counts": the counts go first, then the selections, padded to the largest),
      ``clock`` (a callable returning seconds, default ``time.perf_counter``: GraVAC's step time is the
      difference between two step starts; a clock that stops while the process does other work between
      steps, such as evaluation, keeps that work out of the throughput GraVAC compares), ``optimizer`` (your
      optimizer, also settable later as ``state.optimizer = opt``: its SGD momentum or Adam's beta1 is read at each
      step, as the Horovod objects do, and the policy caps the compression by it), ``momentum`` (a number instead,
      0 for none; given neither, the hook assumes 0.9, ``crossover.driver.UNKNOWN_MOMENTUM``),
      ``transport`` (rank-specific compressors: "allgather", the default, each rank's own pairs; opt-in
      "agreed", values at an index set agreed the step before, or "auto", the cheaper of the two by the cost
      model and measured step times; docs/scaling.md).
    * ``policy="static"``: a fixed ``cf`` (default 100) with ``compressor``; same other settings
      (``transport`` defaults to "allgather" there too).
    * ``policy="dqsgd"``: DQ-SGD picks the quantization bits per step. ``total_steps`` and ``lr`` (a
      number or a callable step -> lr; or ``optimizer``, whose lr is read at each step) are required; ``error_budget``,
      ``target_bits``, ``b_min``, ``b_max``, ``decay``, ``error_feedback``, ``min_compress_numel``,
      ``seed``, ``transport``.
    * ``policy="qsgd"``: fixed ``bits``. ``policy="fp16"``: fp16 casts (no settings).
    * ``tensorboard`` (every policy but fp16): a directory (rank 0 of the group writes per-step scalars under
      ``crossover/``) or a ``torch.utils.tensorboard.SummaryWriter`` (used on the rank that made it; never closed).

    `stats()` has the keys of the Horovod objects' (``bytes_sent``, ``bytes_dense``,
    ``compression_factor``, ...); `state_dict()` / `load_state_dict()` hold everything a resumed run
    needs (policy, step counter, error-feedback residuals per parameter): call them between steps.
    """

    def __init__(self, process_group: Any = None, *, policy: str = "gravac", **settings: Any) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(f"process_group must be a torch.distributed ProcessGroup or None, got {process_group!r} "
                             "(settings are keywords: AdaptiveState(policy='static', compressor='topk', cf=100))")
        builder = _BUILDERS.get(policy)
        if builder is None:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        optimizer = settings.get("optimizer")
        if optimizer is not None and not isinstance(getattr(optimizer, "param_groups", None), list):
            raise ValueError(f"optimizer= must be a torch optimizer (its param_groups give the momentum, or Adam's "
                             f"beta1, and DQ-SGD's learning rate at each step), got {type(optimizer).__name__}")
        tensorboard = settings.pop("tensorboard", None)
        try:
            engine = builder(process_group, **settings)
        except TypeError as exc:
            raise ValueError(f"policy={policy!r}: {exc}") from None
        if tensorboard is not None:
            if getattr(engine, "driver", None) is None:
                raise ValueError(f"tensorboard= logs a policy's steps; policy={policy!r} has none (use gravac, "
                                 f"static, dqsgd or qsgd)")
            engine.session.attach_tensorboard(tensorboard, engine.comm.rank)
        self.process_group = process_group
        self.policy_name = policy
        self._engine = engine

    # ------------------------------------------------------------------ telemetry and state
    def stats(self, debug: bool = False) -> dict[str, Any]:
        """Cumulative telemetry of this rank, the Horovod objects' keys; `debug`: the policy's internals too."""
        return user_stats(self._engine.stats(), debug)

    def state_dict(self) -> dict[str, Any]:
        """Policy, step counter, byte counters and error-feedback residuals (per parameter ordinal)."""
        return {"version": STATE_VERSION, "policy": self.policy_name, **self._engine.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()` (same policy); the next step continues the saved schedule.

        Everything (policy state, counters, step records, residuals: finite, of this model's sizes) is
        checked before anything is applied: a bad state raises ValueError and leaves this state unchanged.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"state must be a mapping (from AdaptiveState.state_dict()), got {type(state).__name__}")
        if state.get("version") != STATE_VERSION or state.get("policy") != self.policy_name:
            raise ValueError(f"state is for policy {state.get('policy')!r} version {state.get('version')!r}; this "
                             f"is policy {self.policy_name!r} version {STATE_VERSION}")
        try:
            self._engine.load_state_dict(state)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a valid compression state: {type(exc).__name__}: {exc}") from exc

    def reset(self) -> None:
        """Forget the step in flight (e.g. after an aborted step); the policy state stays."""
        self._engine.reset()

    def close_tensorboard(self) -> None:
        """`tensorboard=`: log the step in flight, write everything, stop logging (done at exit anyway)."""
        session = getattr(self._engine, "session", None)
        if session is not None:
            session.close_tensorboard()

    def sync(self, root_rank: int = 0) -> None:
        """Make every rank's policy state `root_rank`'s (after a resume where ranks loaded different
        checkpoints); residuals stay per rank. A collective: call it on every rank."""
        state = None
        if dist.get_rank(self.process_group) == root_rank:
            state = {k: v for k, v in self.state_dict().items() if k != "residuals"}
        box = [state]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.process_group, root_rank)
                                   if self.process_group is not None else root_rank, group=self.process_group)
        self.load_state_dict(box[0])

    # ------------------------------------------------------------------ introspection
    @property
    def policy(self) -> Any:
        """The policy object (GravacPolicy, StaticPolicy, DqsgdPolicy or None before calibration)."""
        session = getattr(self._engine, "session", None)
        return None if session is None else session.policy

    @property
    def optimizer(self) -> Any:
        """The optimizer whose momentum (or Adam's beta1) and learning rate are read at each step (None: not shown)."""
        return getattr(self._engine, "optimizer", None)

    @optimizer.setter
    def optimizer(self, opt: Any) -> None:
        if opt is not None and not isinstance(getattr(opt, "param_groups", None), list):
            raise ValueError(f"optimizer must be a torch optimizer, got {type(opt).__name__}")
        if hasattr(self._engine, "optimizer"):
            self._engine.optimizer = opt

    @property
    def driver(self) -> Any:
        """The step driver (None for fp16)."""
        return getattr(self._engine, "driver", None)

    @property
    def bucket_rebuilds(self) -> int:
        """How many times a bucket's parameters changed and its residual was rebuilt."""
        return getattr(self._engine, "bucket_rebuilds", 0)

    def residuals(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, copy of its flat error-feedback residual) for every parameter that has one."""
        layouts = getattr(self._engine, "layouts", None)
        return [] if layouts is None else layouts.by_parameter()

    def __repr__(self) -> str:
        return f"AdaptiveState(policy={self.policy_name!r})"


def adaptive_hook(state: AdaptiveState, bucket: dist.GradBucket) -> Future:
    """The DDP communication hook: `ddp.register_comm_hook(state, adaptive_hook)`."""
    return state._engine.run(bucket)



# DDP's register_comm_hook compares these annotations with the real objects (this module's
# `from __future__ import annotations` would leave strings there, which DDP rejects).
adaptive_hook.__annotations__ = {"state": AdaptiveState, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}
