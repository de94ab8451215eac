"""The step session: the one caller of both a step driver and a codec, for every torch host.

A host (Horovod's compression hook, the PyTorch DDP hook) keeps only what is host-specific (frames, process sets,
buckets, futures) and calls, per step and per gradient::

    session.begin_step(comm)                         # the first gradient of a step
    session.optimizer_seen(opt)                      # hosts that see the optimizer (momentum, DQ-SGD's lr)
    payload, ctx = session.encode(key, grad, comm)   # per compressed gradient; the host reduces `payload`
    out = session.decode(reduced, ctx, comm)         # per compressed gradient, once reduced
    session.settle(passed)                           # the step is over: feed deferred statistics, settle inf/NaN

`SparseSession` drives a compression-factor policy (GraVAC, static top-k) with `SparseCodec`, `LowRankSession`
one with `LowRankCodec` (PowerSGD: the CF sets each matrix's rank), `QuantSession` a bits-per-step one (DQ-SGD,
QSGD) with `QuantCodec`. Transport decisions come from `transport.py`; the codec
takes the decided transport and never calls back up.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from crossover.compression.agreed import sets_from_state
from crossover.compression.collectives import Collectives
from crossover.compression.cost_model import AGREED, SCATTER
from crossover.compression.lowrank_codec import LowRankCodec
from crossover.compression.quant_codec import QuantCodec
from crossover.compression.selectors import make_selector
from crossover.compression.sparse_codec import SparseCodec
from crossover.compression.wire import RanksDisagree
from crossover.driver import transport
from crossover.driver.quant import QuantStepDriver
from crossover.driver.settings import check_momentum, lr_at, optimizer_momentum
from crossover.driver.sparse import SparseStepDriver

log = logging.getLogger("crossover.driver")

__all__ = ["AUTO", "LOWRANK", "LowRankSession", "QuantSession", "SparseSession", "StepSession", "cf_session",
           "check_compressor", "finite_probe"]


def finite_probe(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool: every value of `tensor` is finite (no sync). From its min and max (one pass, NaN propagates,
    nothing can overflow): 0.6 ms on 4.7 M CPU floats against 17 ms for ``isfinite(t).all()``."""
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.isfinite(torch.stack(torch.aminmax(tensor))).all()


class StepSession:
    """What both families share: counting, the deferred statistics, settling a non-finite step, state."""

    driver: Any
    codec: Any

    def __init__(self) -> None:
        self._step_keys: dict[str, bool] = {}  # compressed this step -> its decode already undid it (non-finite)
        self._deferred: dict[int, tuple[Any, int]] = {}  # order -> (reduced statistics, world), fed at settle

    # ------------------------------------------------------------------ per step
    def begin_step(self, comm: Collectives) -> None:
        """The first gradient of a step (`comm`: the collectives of this step's group)."""
        raise NotImplementedError

    def optimizer_seen(self, opt: Any) -> None:
        """The optimizer whose gradients these are (None when the host cannot see it)."""

    @property
    def family_open(self) -> bool:
        """Whether `for_optimizer` still has a codec family to choose (``compressor="auto"`` before its first step)."""
        return False

    def for_optimizer(self, opt: Any, comm: Any = None, device: Any = None) -> StepSession:
        """The session to run from the first step on (hosts call it before that step begins): this one, unless a
        codec family is still to be chosen from the optimizer (``compressor="auto"``, `SparseSession`)."""
        return self

    def for_state(self, state: Any) -> StepSession:
        """The session that loads `state` (the host swaps it in once its load succeeded): this one, unless the family
        is still open and the checkpoint names another (``compressor="auto"``)."""
        return self

    def skips_all(self) -> bool:
        """True when this step compresses nothing (the plan is dense and measures nothing)."""
        return False

    def count(self, sent: int, dense: int) -> None:
        """Bytes of a tensor the host sent untouched (`sent`) and what dense would have sent."""
        self.driver.count(sent, dense)

    # ------------------------------------------------------------------ per gradient
    def decode(self, reduced: torch.Tensor, ctx: Any, comm: Collectives, stats: torch.Tensor | None = None, *,
               order: int | None = None) -> torch.Tensor:
        """The averaged gradient from the reduced payload (and `stats`, the reduction of `ctx.stats_apart`).

        Its reduced statistics go to the driver now, or at `settle` in ascending `order` (hosts whose decodes
        finish in an order that may differ between ranks, such as DDP's callbacks): every rank sums them alike.
        """
        out, summed = self._decode(reduced, ctx, comm, stats)
        if not all(math.isfinite(float(v)) for v in summed):
            self._step_keys[ctx.key] = True  # the codec put its residual back
        if order is None:
            self._feed(summed, comm.size())
        else:
            self._deferred[order] = (summed, comm.size())
        return out

    # ------------------------------------------------------------------ end of step
    def settle(self, passed: Sequence[torch.Tensor] = ()) -> None:
        """The step in flight is over (the next begins, or stats()/state_dict() between steps).

        1. Deferred statistics go to the driver in order.
        2. A tensor passed through untouched (`passed`: `finite_probe` of its reduced values) reaches every rank
           with the same reduced value, so inf/NaN in it makes the step non-finite alike everywhere.
        3. A non-finite step leaves no trace in error feedback: a compressed tensor whose own decode did not put its
           residual back (its statistics were finite) has it reset to zeros (the pre-step residual is gone by
           now; keeping the step's gradient would send the skipped step later).
        """
        deferred, self._deferred = self._deferred, {}
        for order in sorted(deferred):
            self._feed(*deferred[order])
        if passed and not all(bool(torch.stack([f for f in passed if f.device == d]).all())
                              for d in {f.device for f in passed}):
            self.driver.mark_nonfinite()
        keys, self._step_keys = self._step_keys, {}
        if keys and self._step_nonfinite():
            for key, undone in keys.items():
                res = self.codec.memory.get(key)
                if res is not None and not undone:
                    res.zero_()

    # ------------------------------------------------------------------ telemetry and state
    @property
    def policy(self) -> Any:
        return self.driver.policy

    def stats(self) -> dict[str, Any]:
        return self.driver.stats()

    def attach_tensorboard(self, target: Any, rank: Callable[[], int]) -> None:
        self.driver.attach_tensorboard(target, rank)

    def close_tensorboard(self) -> None:
        self.driver.close_tensorboard()

    def reset(self) -> None:
        """Forget the step in flight (elastic reset); the policy state stays."""
        self._step_keys.clear()
        self._deferred.clear()
        self.driver.reset()

    def state_dict(self) -> dict[str, Any]:
        return self.driver.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> bool:
        """Restore the driver's state (checked whole first: ValueError, nothing changed); whether a step was in
        flight. The step in flight here is forgotten."""
        in_flight = bool(self.driver.load_state_dict(state))
        self._step_keys.clear()
        self._deferred.clear()
        return in_flight

    # ------------------------------------------------------------------ the family's
    def _decode(self, reduced: torch.Tensor, ctx: Any, comm: Collectives,
                stats: torch.Tensor | None) -> tuple[torch.Tensor, Sequence[float]]:
        raise NotImplementedError

    def _feed(self, summed: Any, world: int) -> None:
        raise NotImplementedError

    def _step_nonfinite(self) -> bool:
        raise NotImplementedError


class SparseSession(StepSession):
    """A compression-factor policy (GraVAC, static) driving a sparsifying codec.

    `momentum`: None reads the optimizer's when the host shows it (`optimizer_seen`), reporting `unknown_momentum`
    until then; `clock`: seconds (GraVAC's step time is the difference between two step starts)."""

    def __init__(self, codec: SparseCodec, driver: SparseStepDriver, *, momentum: float | None,
                 unknown_momentum: float, clock: Callable[[], float] | None = None) -> None:
        super().__init__()
        if clock is not None and not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        self.codec, self.driver = codec, driver
        self.clock = clock or time.perf_counter
        self.momentum_setting = check_momentum(momentum)
        self.momentum = unknown_momentum if self.momentum_setting is None else self.momentum_setting
        self.rebuild: Callable[[str], SparseSession] | None = None  # compressor="auto": the family is still open

    @property
    def family_open(self) -> bool:
        return self.rebuild is not None

    def for_optimizer(self, opt: Any, comm: Any = None, device: Any = None) -> SparseSession:
        """``compressor="auto"``, at the first step: the family `auto_family` picks for the momentum (`momentum=`,
        else the optimizer's, else the host's assumption), agreed over `comm` (every member calls this at its first
        step; RanksDisagree when the momenta differ): this session, or a new one with the same settings that takes
        over its telemetry. Decided once; every later call returns self."""
        rebuild, self.rebuild = self.rebuild, None
        if rebuild is None:
            return self
        momentum = self.momentum_setting
        if momentum is None:
            momentum = self.momentum if opt is None else optimizer_momentum(opt)
        if comm is not None:
            momentum = agreed_momentum(momentum, comm, device)
        family = auto_family(momentum)
        return self if family == self.driver.compressor else self._become(rebuild(family))

    def for_state(self, state: Any) -> SparseSession:
        """``compressor="auto"`` before the first step: a session of the checkpoint's family (a resumed run keeps its
        family); self otherwise, whose load then checks the family as every setting."""
        family = state.get("compressor") if isinstance(state, Mapping) else None
        if self.rebuild is None or family == self.driver.compressor or family not in AUTO_FAMILIES:
            return self
        return self._become(self.rebuild(family))

    def _become(self, new: SparseSession) -> SparseSession:
        new.driver.adopt_telemetry(self.driver)
        return new

    def begin_step(self, comm: Collectives) -> None:
        self.driver.begin_step(self.clock())

    def optimizer_seen(self, opt: Any) -> None:
        if self.momentum_setting is None and opt is not None:
            self.momentum = optimizer_momentum(opt)

    def skips_all(self) -> bool:
        return self.driver.skips_all()

    def encode(self, key: str, tensor: torch.Tensor, comm: Collectives) -> tuple[torch.Tensor, Any]:
        """One float32 gradient of the step in flight: (payload for the host's reduction, context for `decode`)."""
        rec, numel, world = self.driver.current, tensor.numel(), comm.size()
        shared = self.codec.selector.shared_indices
        # 1. what the plan sends of this tensor (k entries at its CF) and how: the plan's transport where the cost
        #    model allows it
        kind, k = transport.sparse_route(numel, world, rec.sent_cf, rec.probes, rec.transport, shared,
                                         hasattr(comm, "alltoall_async"))
        # 2. the cost model's bytes of every candidate transport, where the timed choice weighs them
        if rec.wants_costs and rec.sent_cf > 1 and not shared:
            rec.note_costs(transport.candidate_costs(numel, k, world, self.driver.layout.length))
        # 3. encode: selection, error feedback, the statistics that ride along, the codec's own collectives
        payload, ctx, sent = self.codec.encode(key, tensor, rec, self.driver.last_step_time, comm, kind,
                                               momentum=self.momentum)
        # 4. count what went out, against dense
        self.driver.count(sent, numel * tensor.element_size())
        self._step_keys[key] = False
        return payload, ctx

    def _decode(self, reduced: torch.Tensor, ctx: Any, comm: Collectives,
                stats: torch.Tensor | None) -> tuple[torch.Tensor, Sequence[float]]:
        out, summed = self.codec.decode(reduced, ctx, comm, stats)
        return out, summed.tolist()

    def _feed(self, summed: Any, world: int) -> None:
        self.driver.add_reduced(summed, world)

    def _step_nonfinite(self) -> bool:
        return self.driver.current is not None and self.driver.current.nonfinite

    def reset(self) -> None:
        super().reset()
        self.codec.forget_agreed()

    def state_dict(self, agreed: bool = True) -> dict[str, Any]:
        """The driver's state, and the agreed index sets (the same on every rank) where `agreed`."""
        state = self.driver.state_dict()
        if agreed:
            state["agreed"] = self.codec.agreed_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any], agreed: bool = True) -> bool:
        """As `StepSession.load_state_dict`, with the agreed index sets where `agreed` (else they are drawn anew
        from the shared seed, on every rank alike)."""
        if agreed and isinstance(state, Mapping) and "agreed" in state:
            sets_from_state(state["agreed"])  # checked before anything changes
        in_flight = super().load_state_dict(state)
        self.rebuild = None  # the checkpoint's family (for_state) is this run's
        self.codec.seed = self.driver.seed
        if agreed:
            self.codec.load_agreed(state.get("agreed", {}))
        else:
            self.codec.forget_agreed()
        return in_flight


class LowRankSession(SparseSession):
    """A compression-factor policy driving the low-rank codec (PowerSGD): the plan's CF sets each matrix's rank.

    Its two allreduces per step are the codec's own; hosts that issue collectives in a fixed order call `advance`
    where every rank is at the same point (the DDP hook: in each bucket's hook body)."""

    codec: LowRankCodec

    def encode(self, key: str, tensor: torch.Tensor, comm: Collectives) -> tuple[torch.Tensor, Any]:
        """One float32 gradient of the step in flight: (the statistics for the host's reduction, context)."""
        rec = self.driver.current
        # 1. encode: M = gradient + residual, the rank from the plan's CF, P = M Q started, the statistics
        payload, ctx, sent = self.codec.encode(key, tensor, rec, self.driver.last_step_time, comm,
                                               momentum=self.momentum)
        # 2. count what went out, against dense
        self.driver.count(sent, tensor.numel() * tensor.element_size())
        self._step_keys[key] = False
        return payload, ctx

    def advance(self, comm: Collectives) -> None:
        """Finish the P allreduces begun and start the Q allreduces (every rank at the same point)."""
        self.codec.advance(comm)

    def reset(self) -> None:
        StepSession.reset(self)
        self.codec.forget()

    def state_dict(self, agreed: bool = True) -> dict[str, Any]:
        """The driver's state and the warm starts (the same on every rank)."""
        return {**self.driver.state_dict(), "warm_starts": self.codec.warm_state(),
                "matrices": self.codec.matrices_state()}

    def load_state_dict(self, state: Mapping[str, Any], agreed: bool = True) -> bool:
        """The driver's state and the warm starts (checked first: ValueError, nothing changed); a state without
        them draws them again from the shared seed, on every rank alike."""
        warm = mats = None
        if isinstance(state, Mapping) and "warm_starts" in state:
            warm = self.codec.check_warm_state(state["warm_starts"])
        if isinstance(state, Mapping) and "matrices" in state:
            mats = self.codec.check_matrices(state["matrices"])
        in_flight = StepSession.load_state_dict(self, state)
        self.rebuild = None
        self.codec.seed = self.driver.seed
        self.codec.load_warm(warm or {}, mats)
        return in_flight


class QuantSession(StepSession):
    """A bits-per-step driver (DQ-SGD, fixed QSGD) and a quantizing codec. `transport`: one of
    transport.QUANT_TRANSPORTS; `lr`: DQ-SGD's learning rate (a number, a callable step -> lr, or None to read
    the optimizer's)."""

    def __init__(self, codec: QuantCodec, driver: QuantStepDriver, *, transport_setting: str = "auto",
                 lr: Any = None) -> None:
        super().__init__()
        self.codec, self.driver = codec, driver
        self.transport = transport.check_quant_transport(transport_setting)
        self.lr = lr

    def begin_step(self, comm: Collectives) -> None:
        self.driver.begin_step(comm.size())

    def optimizer_seen(self, opt: Any) -> None:
        if self.driver.adaptive:
            self.driver.lr = lr_at(self.lr, self.driver.step, lambda: _optimizer_lr(opt))

    def encode(self, key: str, tensor: torch.Tensor, comm: Collectives) -> tuple[torch.Tensor, Any]:
        """One float32 gradient of the step in flight: (payload for the host's reduction, context for `decode`)."""
        numel = tensor.numel()
        # 1. its elements join the step (DQ-SGD's bound counts them)
        self.driver.add_tensor(numel)
        # 2. how it travels: packed codes by allgather or fp16 values by allreduce
        kind = transport.quant_route(self.transport, numel, self.driver.bits, comm.size())
        # 3. encode at the step's bits
        payload, ctx, sent = self.codec.encode(key, tensor, self.driver.bits, self.driver.step, comm, kind)
        # 4. count what went out, against dense
        self.driver.count(sent, numel * tensor.element_size())
        self._step_keys[key] = False
        return payload, ctx

    def _decode(self, reduced: torch.Tensor, ctx: Any, comm: Collectives,
                stats: torch.Tensor | None) -> tuple[torch.Tensor, Sequence[float]]:
        return self.codec.decode(reduced, ctx, comm)

    def _feed(self, summed: Any, world: int) -> None:
        one, sq = summed
        self.driver.add_reduced_sq(one, sq, world)

    def _step_nonfinite(self) -> bool:
        return self.driver.step_nonfinite


def _optimizer_lr(opt: Any) -> float:
    groups = getattr(opt, "param_groups", None)
    if not groups:
        raise RuntimeError("DQ-SGD needs the learning rate: pass lr= (a number or a callable step -> lr) "
                           "when the compression is not used by an optimizer it can see")
    return float(groups[0]["lr"])


#: The low-rank family's name among the compressors (``compressor="powersgd"``).
LOWRANK = "powersgd"
#: ``compressor="auto"`` (GraVAC's default): the family from the optimizer's momentum at the first step (`auto_family`).
AUTO = "auto"
#: The families "auto" chooses between (a checkpoint names one).
AUTO_FAMILIES = ("topk", LOWRANK)


def auto_family(momentum: float) -> str:
    """The codec family for an optimizer of this momentum (SGD's, or Adam's beta1): top-k without momentum (CF 100
    kept dense's accuracy), low rank with it (top-k's held-back coordinates then land 1/(1-m) times as far, capping it
    at CF 10, where low rank kept dense's accuracy faster: reports/benchmarks-momentum.md)."""
    return LOWRANK if momentum > 0.0 else "topk"


def agreed_momentum(momentum: float, comm: Any, device: Any = None) -> float:
    """The momentum every rank of `comm` chooses the family by: one small allreduce, once per run. Ranks whose momenta
    differ would pick different families and stall on each other's collectives: RanksDisagree on every rank."""
    sent = torch.tensor([momentum, momentum * momentum], dtype=torch.float64, device=device)
    mean, mean_sq = comm.wait(comm.allreduce_async(sent, "crossover.family")).tolist()
    if mean_sq - mean * mean > 1e-9:  # the variance over ranks: 0 up to rounding when they agree
        raise RanksDisagree(f"crossover: the ranks' optimizers have different momentum (mean {mean:.3g}, variance "
                            f"{mean_sq - mean * mean:.3g}); compressor='auto' picks the codec family from it on every "
                            "rank alike: give every rank the same optimizer settings, or pass momentum= or a "
                            "compressor by name")
    return mean


def check_compressor(compressor: object) -> str:
    """`compressor` if it names a selector (top-k, DGC, RedSync, random-k), the low-rank family or "auto", else
    ValueError."""
    if compressor in (LOWRANK, AUTO):
        return compressor  # type: ignore[return-value]
    make_selector(compressor)  # type: ignore[arg-type]  # ValueError naming the known compressors
    return compressor  # type: ignore[return-value]


def cf_session(compressor: str, policy: Any, *, error_feedback: bool, seed: int, log_csv: str | None,
               rank: Callable[[], int], transport: str | None, alltoall: bool, fixed_gather: bool,
               dense_stats_apart: bool = False, tensorboard: Any = None, momentum: float | None,
               unknown_momentum: float, clock: Callable[[], float] | None) -> SparseSession:
    """The session of a compression-factor policy: `compressor`'s codec (low-rank, or a selector's) and a step driver
    (`transport`: the user's setting, for rank-specific selectors; `alltoall`: whether the host has one). "auto": a
    top-k session whose `for_optimizer` picks the family at the first step."""
    if compressor == AUTO:
        def rebuild(family: str, transport: str | None = transport) -> SparseSession:
            if family == LOWRANK and transport in (AGREED, SCATTER):
                log.warning("crossover: the optimizer's momentum picked low rank (compressor='auto'), which sends by "
                            "allreduce: transport=%r is top-k's and goes unused; pass compressor='topk' to keep it",
                            transport)
                transport = None
            return cf_session(family, policy, error_feedback=error_feedback, seed=seed, log_csv=log_csv, rank=rank,
                              transport=transport, alltoall=alltoall, fixed_gather=fixed_gather,
                              dense_stats_apart=dense_stats_apart, momentum=momentum,
                              unknown_momentum=unknown_momentum, clock=clock)

        session = rebuild("topk")
        session.rebuild = rebuild
        if tensorboard is not None:
            session.attach_tensorboard(tensorboard, rank)
        return session
    if compressor == LOWRANK:
        if transport in (AGREED, SCATTER):
            raise ValueError(f"transport={transport!r} is how top-k's selections travel; low rank "
                             "(compressor='powersgd') sends its factors by allreduce: leave transport= out, or pick "
                             "compressor='topk'")
        codec: Any = LowRankCodec(error_feedback=error_feedback, seed=seed)
        cls, transport = LowRankSession, None
    else:
        codec = SparseCodec(compressor, error_feedback=error_feedback, seed=seed,
                            grad_norms=bool(getattr(policy, "needs_grad_norms", False)), fixed_gather=fixed_gather,
                            dense_stats_apart=dense_stats_apart)
        cls = SparseSession
        transport = None if codec.selector.shared_indices else transport
    driver = SparseStepDriver(policy, compressor=compressor, seed=seed, log_csv=log_csv, rank=rank,
                              checks=codec.checks, tensorboard=tensorboard, transport=transport,
                              alltoall=alltoall)
    return cls(codec, driver, momentum=momentum, unknown_momentum=unknown_momentum, clock=clock)
