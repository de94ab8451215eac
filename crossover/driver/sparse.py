"""The step driver of compression-factor policies (GraVAC, static top-k and the like): everything an adaptive
compression does per step that is not moving tensors. Plain numbers in and out; no framework, no Horovod.

The Horovod glue (horovod.torch and horovod.tensorflow objects) and the PyTorch DDP hook keep only tensor
movement and call this::

    rec = driver.begin_step(now)               # first gradient of a step: finish the last one, plan this one
    local = driver.layout.local(...)            # per tensor: the statistics vector that rides in the payload
    ...the framework reduces the payload (sum or average over ranks)...
    driver.add_reduced(reduced_stats, world)    # per tensor, as its decompress runs
    driver.count(sent_bytes, dense_bytes)

Why one step late: the statistics of step t (gains) are known once its payloads are reduced, but the duration of
step t is only known when step t+1 begins, and it reaches every rank inside step t+1's payloads. So the policy
observes step t when step t+1 is finished (``pending``). Every rank feeds the policy the same reduced numbers in
the same order, so every rank takes the same decisions.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Protocol

from crossover.adaptive.gravac import Plan, StepStats
from crossover.adaptive.gravac import tunables as T
from crossover.compression.checks import check_int, check_real, check_seed
from crossover.compression.wire import STAT_MAX, SparseStatsLayout, normalize_reduced
from crossover.driver.flat import flat_stats
from crossover.driver.steplog import StepLog
from crossover.driver.tboard import TensorBoardLog
from crossover.driver.transport import CfState, TransportChoice, auto_candidates, check_transport

__all__ = ["CF_POLICY_STATE_VERSION", "CfPolicy", "SparseStepDriver", "StepRecord"]

log = logging.getLogger("crossover.driver")

CF_POLICY_STATE_VERSION = 1


@dataclass
class StepRecord:
    """Global statistics of one step, summed over tensors as their reduced statistics arrive."""

    step: int
    sent_cf: float
    probes: tuple[float, ...]
    measure: bool = False  # the plan's `measure`: statistics travel even on a dense step without probes
    tensors: int = 0
    grad_sq: float = 0.0
    grad_norm: float = 0.0
    acc_sq: float = 0.0
    acc_norm: float = 0.0
    probe_sq: list[float] = field(default_factory=list)
    probe_norm: list[float] = field(default_factory=list)
    prev_step_time: float | None = None  # the previous step's duration, mean over ranks
    momentum: float | None = None  # the optimizers' momentum, mean over ranks (None: not reported)
    bytes_sent: int = 0
    bytes_dense: int = 0
    nonfinite: bool = False  # some tensor's reduced statistics were inf/NaN: not shown to the policy
    saturated: bool = False  # some statistic reached STAT_MAX (clamped): not shown to the policy
    transport: str | None = None  # how compressed tensors travel this step (cost_model name; None: the codec's default)
    # the cost model's bytes per worker of this step's compressed tensors, per candidate transport (same on every
    # rank: tensor sizes, k and world size), as the step session reports them (`note_costs`)
    transport_bytes: dict[str, float] = field(default_factory=dict)
    # whether the step session reports those bytes (`note_costs`): the driver turns it on where they are read (the
    # transport choice, a benchmark); not saved, and off by default: the arithmetic costs about 10 us per compressed
    # tensor
    wants_costs: ClassVar[bool] = False

    def __post_init__(self) -> None:
        n = len(self.probes)
        self.probe_sq = list(self.probe_sq) or [0.0] * n
        self.probe_norm = list(self.probe_norm) or [0.0] * n
        if len(self.probe_sq) != n or len(self.probe_norm) != n:
            raise ValueError("probe statistics must have one value per probed CF")

    def note_costs(self, costs: Mapping[str, float]) -> None:
        """Add one compressed tensor's predicted bytes per worker, per candidate transport."""
        for kind, nbytes in costs.items():
            self.transport_bytes[kind] = self.transport_bytes.get(kind, 0.0) + float(nbytes)

    @property
    def skipped(self) -> bool:
        """Whether the policy must not observe this step (identical on every rank: reduced numbers)."""
        return self.nonfinite or self.saturated

    def add(self, sums: Sequence[float], layout: SparseStatsLayout) -> None:
        """Add one tensor's statistics, already turned into sums over ranks (`normalize_reduced`).

        Non-finite statistics (an inf/NaN gradient on some rank) mark the step `nonfinite` and are not
        added; statistics at or above STAT_MAX mark it `saturated`.
        """
        self.tensors += 1
        head = sums[:layout.length]
        if self.prev_step_time is None and math.isfinite(sums[layout.STEP_TIME]):
            self.prev_step_time = sums[layout.STEP_TIME]
        if self.momentum is None and math.isfinite(sums[layout.MOMENTUM]):
            self.momentum = sums[layout.MOMENTUM]
        if not all(math.isfinite(v) for v in head):
            self.nonfinite = True
            return
        if any(v >= STAT_MAX for v in head[layout.GRAD_SQ:]):
            self.saturated = True
        self.grad_sq += sums[layout.GRAD_SQ]
        self.grad_norm += sums[layout.GRAD_NORM]
        self.acc_sq += sums[layout.ACC_SQ]
        self.acc_norm += sums[layout.ACC_NORM]
        for i in range(min(layout.nprobes, len(self.probes))):
            self.probe_sq[i] += sums[layout.probe_sq(i)]
            self.probe_norm[i] += sums[layout.probe_norm(i)]

    def to_stats(self, step_time: float) -> StepStats:
        """The policy's view of this step, given its duration."""
        extra = {"grad_sq_norm": self.grad_sq, "grad_norm_sum": self.grad_norm, "dense_norm_sum": self.acc_norm,
                 "compressed_norm_sums": dict(zip(self.probes, self.probe_norm)),
                 "momentum": math.nan if self.momentum is None else self.momentum}
        known = {f.name for f in fields(StepStats)}
        return StepStats(sent_cf=self.sent_cf, dense_sq_norm=self.acc_sq,
                         compressed_sq_norms=dict(zip(self.probes, self.probe_sq)),
                         step_time_s=step_time, samples=1.0, **{k: v for k, v in extra.items() if k in known})

    def gains(self) -> list[float | None]:
        """Per-probe sqrt(||C(g+e)||^2 / ||g+e||^2) of this step alone (telemetry)."""
        return [math.sqrt(sq / self.acc_sq) if self.acc_sq > 0 else None for sq in self.probe_sq]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "probes": list(self.probes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> StepRecord | None:
        if d is None:
            return None
        if not isinstance(d, Mapping):
            raise ValueError(f"a step record must be a mapping or None, got {type(d).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown, missing = set(d) - allowed, allowed - set(d) - _ADDED_LATER
        if unknown or missing:
            raise ValueError(f"step record: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
        probes = d["probes"]
        if not isinstance(probes, (list, tuple)):
            raise ValueError(f"step record probes must be a list of CFs, got {probes!r}")
        rec = cls(**{**d, "probes": tuple(check_real("step record probe CF", p, 1.0) for p in probes)})
        rec.validate()
        return rec

    def validate(self) -> None:
        """Raise ValueError unless every field is a sane value (a loaded state is checked before use)."""
        check_int("step record step", self.step, 0)
        check_real("step record sent_cf", self.sent_cf, 1.0)
        for cf in self.probes:
            check_real("step record probe CF", cf, 1.0)
        for name in ("tensors", "bytes_sent", "bytes_dense"):
            check_int(f"step record {name}", getattr(self, name), 0)
        for name in ("grad_sq", "grad_norm", "acc_sq", "acc_norm"):
            check_real(f"step record {name}", getattr(self, name), 0.0)
        for v in (*self.probe_sq, *self.probe_norm):
            check_real("step record probe statistic", v, 0.0)
        if self.prev_step_time is not None:
            check_real("step record prev_step_time", self.prev_step_time, 0.0)
        if self.momentum is not None:
            check_real("step record momentum", self.momentum, 0.0)
        if not all(isinstance(v, bool) for v in (self.nonfinite, self.saturated, self.measure)):
            raise ValueError("step record nonfinite/saturated/measure must be booleans")
        if self.transport is not None and not isinstance(self.transport, str):
            raise ValueError(f"step record transport must be a name or None, got {self.transport!r}")
        if not isinstance(self.transport_bytes, Mapping):
            raise ValueError("step record transport_bytes must be a mapping of transport -> bytes")
        for kind, v in self.transport_bytes.items():
            if not isinstance(kind, str):
                raise ValueError(f"step record transport_bytes keys must be names, got {kind!r}")
            check_real("step record transport bytes", v, 0.0)

    @classmethod
    def log_row_stats(cls, row: Mapping[str, str]) -> StepStats | None:
        """The policy's view of one row that `StepLog.write` wrote (built as the driver builds it, `to_stats`); None for
        a step the policy did not observe (`skipped`). The norm sums are not in the file: they read as 0."""
        if row["skipped"] not in ("0", ""):
            return None
        probes = tuple(float(row[f"probe{i}_cf"]) for i in range(1, StepLog.MAX_PROBES + 1)
                       if row[f"probe{i}_cf"] != "")
        rec = cls(step=int(row["step"]), sent_cf=float(row["sent_cf"]), probes=probes)
        if row.get("momentum") not in (None, ""):
            rec.momentum = float(row["momentum"])
        if row["grad_sq"] != "":  # written only for a measured step
            rec.grad_sq, rec.acc_sq = float(row["grad_sq"]), float(row["acc_sq"])
            rec.probe_sq = [float(row[f"probe{i}_sq"]) for i in range(1, len(probes) + 1)]
        return rec.to_stats(float(row["step_time_s"]))


#: Fields a record saved before they existed may lack (their defaults stand in).
_ADDED_LATER = {"momentum", "transport", "transport_bytes"}


class CfPolicy(Protocol):
    """What the sparse driver needs of a compression-factor policy (GravacPolicy, StaticPolicy)."""

    def plan(self) -> Plan: ...

    def observe(self, stats: StepStats) -> None: ...

    def summary(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

class SparseStepDriver:
    """Step counter, plans, one-step-late observation, byte counters and state of a CF policy."""

    def __init__(self, policy: CfPolicy, *, compressor: str, seed: int, log_csv: str | None = None,
                 rank: Callable[[], int] = lambda: 0, checks: bool = True, tensorboard: Any = None,
                 transport: str | None = None, alltoall: bool = False) -> None:
        check_transport(transport, none_ok=True)
        self.policy = policy
        expect = getattr(policy, "expect_momentum", None)
        if callable(expect):  # every host puts the optimizer's momentum in the statistics (SparseStatsLayout)
            expect()
        self.checks = checks  # the statistics end with the codec's agreement checks (the codec's `checks`)
        self.transport = transport
        config = getattr(policy, "config", None)
        omega = config.get("omega", T.OMEGA) if isinstance(config, Mapping) else T.OMEGA
        self.transports = TransportChoice(auto_candidates(alltoall), omega=omega) if transport == "auto" else None
        self.collect_costs = False  # True: every step records the cost model's bytes per transport (benchmarks)
        self.compressor = compressor
        self.seed = check_seed(seed)
        self.log = StepLog(log_csv, rank)
        self.tensorboard: TensorBoardLog | None = None
        self._tb_seen: tuple[Any, Any] = (None, False)  # (searches, settled) last logged
        if tensorboard is not None:
            self.attach_tensorboard(tensorboard, rank)
        self.step = 0  # steps begun; identical on every rank
        self.bytes_sent = 0
        self.bytes_dense = 0
        self.nonfinite_steps = 0  # steps with inf/NaN statistics (not shown to the policy)
        self.saturated_steps = 0  # steps whose statistics reached STAT_MAX (not shown to the policy)
        self.reset()

    # ------------------------------------------------------------------ steps
    def reset(self) -> None:
        """Forget the step in flight (elastic reset); the policy and counters stay."""
        self.current: StepRecord | None = None
        self.pending: StepRecord | None = None  # a finished step waiting for its duration
        self._step_start: float | None = None
        self.last_step_time = 0.0

    def begin_step(self, now: float) -> StepRecord:
        """A new step begins at time `now` (seconds): finish the last one, plan this one."""
        if self._step_start is not None:
            self.last_step_time = now - self._step_start
        self._step_start = now
        self.step += 1
        self.log.open()
        finished = self.current
        if finished is not None:
            self._finish(finished)
        plan = self.policy.plan()
        self.current = StepRecord(step=self.step, sent_cf=float(plan.send_cf),
                                  probes=tuple(float(p) for p in plan.probe_cfs),
                                  measure=plan.measure, transport=self._transport_for(float(plan.send_cf)))
        if self.transports is not None or self.collect_costs:
            self.current.wants_costs = True
        if self.tensorboard is not None:
            self._tb_step(finished, self.last_step_time, float(plan.send_cf))
        return self.current

    def _transport_for(self, cf: float) -> str | None:
        """The transport of a step sending ``cf``: the transport choice's, the fixed one, or None (dense, or the
        codec's default). Identical on every rank (plans and reduced statistics only)."""
        if cf <= 1.0 or self.transport is None:
            return None
        if self.transports is not None:
            return self.transports.plan(cf)
        return self.transport

    def skips_all(self) -> bool:
        """True when the step in flight neither compresses nor measures anything: every tensor may go
        through untouched (exact dense). Identical on every rank (it depends on the plan only)."""
        cur = self.current
        return cur is not None and cur.sent_cf <= 1 and not cur.probes and not cur.measure

    def _finish(self, rec: StepRecord) -> None:
        """Step t's statistics are complete; step t-1's duration arrived with them: observe t-1."""
        p = self.pending
        if p is not None and rec.prev_step_time is not None:
            if not p.skipped:  # a non-finite or saturated step is not shown to the policy, on every rank
                self.policy.observe(p.to_stats(rec.prev_step_time))
                if self.transports is not None:
                    self.transports.observe(sent_cf=p.sent_cf, transport=p.transport,
                                            step_time_s=rec.prev_step_time, predicted_bytes=p.transport_bytes,
                                            cf_state=CfState.of(self.policy.summary()))
            self.log.write(p.step - 1, p, rec.prev_step_time)
        self.pending = rec if rec.tensors else None

    @property
    def layout(self) -> SparseStatsLayout:
        """The statistics layout of the step in flight."""
        return SparseStatsLayout(len(self.current.probes) if self.current else 0, self.checks)

    def add_reduced(self, reduced: Sequence[float], world: int) -> None:
        """One tensor's reduced statistics vector (as the reduction left it) for the step in flight."""
        rec = self.current
        if rec is None:
            return
        sums = normalize_reduced(reduced, world)
        if sums is not None:
            layout = SparseStatsLayout(len(rec.probes), self.checks)
            flags = (rec.nonfinite, rec.saturated)
            rec.add(sums, layout)
            self._count_flags(rec, flags)

    def mark_nonfinite(self) -> None:
        """The step in flight is non-finite though its statistics were not: a tensor that went through
        untouched (too small, not float32) held inf/NaN after the reduction, alike on every rank."""
        rec = self.current
        if rec is not None:
            flags = (rec.nonfinite, rec.saturated)
            rec.nonfinite = True
            self._count_flags(rec, flags)

    def _count_flags(self, rec: StepRecord, before: tuple[bool, bool]) -> None:
        """Count a step once when it first turns out non-finite or saturated."""
        if rec.nonfinite and not before[0]:
            self.nonfinite_steps += 1
            log.warning("crossover: step %d has non-finite gradients (inf/NaN on some rank): compressed tensors "
                        "with inf/NaN decode to NaN, error feedback forgets the step, the policy skips it", rec.step)
        if rec.saturated and not before[1]:
            self.saturated_steps += 1

    def add_sums(self, sums: Sequence[float], tensors: int, layout: SparseStatsLayout) -> None:
        """The whole step's statistics at once, in `layout`, already summed over tensors and ranks
        (TensorFlow accumulates them in graph); `sums[STEP_TIME]` and `sums[MOMENTUM]` are sums over tensors of
        means over ranks. A layout with more probes than the plan (TF always measures two) is fine."""
        rec = self.current
        if rec is None or tensors <= 0:
            return
        flags = (rec.nonfinite, rec.saturated)
        vec = [1.0, *sums[1:layout.length]]
        vec[layout.STEP_TIME] /= tensors
        vec[layout.MOMENTUM] /= tensors
        rec.add(vec, layout)
        rec.tensors = tensors
        self._count_flags(rec, flags)

    def count(self, sent: int, dense: int) -> None:
        """Bytes handed to the framework for the step in flight, and what dense would have sent."""
        self.bytes_sent += sent
        self.bytes_dense += dense
        if self.current is not None:
            self.current.bytes_sent += sent
            self.current.bytes_dense += dense

    # ------------------------------------------------------------------ TensorBoard
    def attach_tensorboard(self, target: Any, rank: Callable[[], int]) -> None:
        """Log per-step scalars to `target` (a directory: rank 0 writes; or a SummaryWriter); ValueError if bad."""
        self.tensorboard = TensorBoardLog(target, rank, final=self._tb_final)

    def adopt_telemetry(self, old: SparseStepDriver) -> None:
        """Take over `old`'s TensorBoard log (``compressor="auto"`` chose another family before any step)."""
        self.tensorboard, old.tensorboard = old.tensorboard, None
        if self.tensorboard is not None:
            self.tensorboard.final_to(self._tb_final)

    def close_tensorboard(self) -> None:
        """Log the step in flight, write everything queued and stop logging (also done at exit)."""
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _gain_of(self, cf: float) -> float | None:
        gains = getattr(self.policy, "gains", None)
        return (gains or {}).get(cf, 1.0 if cf == 1.0 else None)

    def _tb_step(self, rec: StepRecord | None, step_time: float | None, next_cf: float) -> None:
        """The step that just finished (`rec`), and the policy's searches and settles as they happen."""
        tb = self.tensorboard
        if rec is not None:
            dense = rec.bytes_dense
            tb.scalars(rec.step, (("compression_factor", rec.sent_cf), ("gain", self._gain_of(rec.sent_cf)),
                                  ("bytes_sent_over_dense", rec.bytes_sent / dense if dense else None),
                                  ("step_time_s", step_time)))
        seen = (getattr(self.policy, "searches", None), bool(getattr(self.policy, "settled", False)))
        if seen != self._tb_seen:
            self._tb_policy_event(seen, next_cf)

    def _tb_policy_event(self, seen: tuple[Any, bool], cf: float) -> None:
        tb, (searches, settled), step = self.tensorboard, seen, self.step
        if searches is not None and searches != self._tb_seen[0]:
            tb.scalars(step, (("searches", searches),))
            tb.text(step, "decisions", f"step {step}: search {searches} begins, sending CF {cf:g}")
        if settled and not self._tb_seen[1] and searches is not None:
            tb.scalars(step, (("settled_cf", cf),))
            tb.text(step, "decisions", f"step {step}: settled on CF {cf:g}")
        self._tb_seen = seen

    def _tb_final(self) -> None:
        """At close: the step in flight, without a duration (no later step began)."""
        rec = self.current
        if rec is not None and self.tensorboard is not None:
            self._tb_step(rec, None, rec.sent_cf)

    # ------------------------------------------------------------------ telemetry and state
    def stats(self) -> dict[str, Any]:
        """Cumulative telemetry of this rank: step, CF in use, gain, bytes sent vs dense; flat (crossover/driver/
        flat.py): the policy's summary under `policy/` keys."""
        summary = self.policy.summary()
        cf = summary.get("send_cf", 1.0)
        if self.step > 0 and not self._compressed_lately():
            cf = 1.0  # what was sent: every gradient went through dense (fp16/fp64 or small tensors)
        gains = summary.get("gains", {}) or {}
        gain = gains.get(cf, 1.0 if cf == 1.0 else None)
        out = {"step": self.step, "compression_factor": cf, "gain": gain, "bytes_sent": self.bytes_sent,
               "bytes_dense": self.bytes_dense, "nonfinite_steps": self.nonfinite_steps,
               "saturated_steps": self.saturated_steps, "compressor": self.compressor}
        if self.transport is not None:  # a rank-specific selector's transport= (not random-k, not the TF glue)
            out["transport"] = self.current.transport if self.current is not None else None
        return flat_stats(out, policy=summary,
                          transport_choice=self.transports.summary() if self.transports is not None else None)

    def _compressed_lately(self) -> bool:
        """Whether the latest step whose statistics arrived compressed a tensor: the step in flight (torch, DDP:
        its statistics arrive as it decodes) or the one before it (TensorFlow: they arrive at the next step)."""
        return any(rec is not None and rec.tensors > 0 for rec in (self.current, self.pending))

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue the same schedule (residuals are the glue's)."""
        state = {"version": CF_POLICY_STATE_VERSION, "compressor": self.compressor, "seed": self.seed,
                 "policy": self.policy.state_dict(), "bytes_sent": self.bytes_sent,
                 "bytes_dense": self.bytes_dense, "step": self.step,
                 # the last two steps' statistics, not yet fed to the policy (it observes one step late)
                 "current": None if self.current is None else self.current.to_dict(),
                 "pending": None if self.pending is None else self.pending.to_dict(),
                 "last_step_time": self.last_step_time, "nonfinite_steps": self.nonfinite_steps,
                 "saturated_steps": self.saturated_steps}
        if self.transports is not None:  # transport="auto" only: other drivers save what they did before it
            state["transport"] = self.transports.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> bool:
        """Restore from `state_dict()`; returns whether a step was in flight (its statistics are kept).

        Everything is validated first (a copy of the policy loads the policy state); on any error a
        ValueError is raised and nothing of this driver has changed.
        """
        try:
            return self._load(state)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a valid compression state: {type(exc).__name__}: {exc}") from exc

    def _load(self, state: Mapping[str, Any]) -> bool:
        if not isinstance(state, Mapping):
            raise ValueError(f"state must be a mapping, got {type(state).__name__}")
        if state.get("version") != CF_POLICY_STATE_VERSION or state.get("compressor") != self.compressor:
            raise ValueError(f"state is for compressor {state.get('compressor')!r} version "
                             f"{state.get('version')!r}; this is {self.compressor!r} v{CF_POLICY_STATE_VERSION}")
        # "transport" (transport="auto") may be missing: its step-time measurements are then taken again
        missing = [name for name in self.state_dict() if name not in state and name != "transport"]
        if missing:  # a field left out is never read as 0: that would reset a counter or the seeds' step
            raise ValueError(f"not a valid compression state: missing field(s) {', '.join(missing)}")
        policy = copy.deepcopy(self.policy)
        policy.load_state_dict(state["policy"])
        seed = check_seed(state["seed"])
        counters = {name: check_int(name, state[name], 0)
                    for name in ("bytes_sent", "bytes_dense", "step", "nonfinite_steps", "saturated_steps")}
        current = StepRecord.from_dict(state["current"])
        pending = StepRecord.from_dict(state["pending"])
        last_step_time = check_real("last_step_time", state["last_step_time"], 0.0)
        transports = None
        if self.transports is not None:  # saved without it (another transport=, or older): afresh
            transports = TransportChoice(self.transports.candidates, omega=self.transports.omega)
            saved = state.get("transport")
            if isinstance(saved, Mapping) and list(saved.get("candidates", ())) != list(transports.candidates):
                log.info("compression state: transport choice saved for %s, this run chooses between %s: its "
                         "step times are measured again", saved.get("candidates"), list(transports.candidates))
            elif saved is not None:
                transports.load_state_dict(saved)
        # validated: apply
        self.policy, self.seed, self.transports = policy, seed, transports
        for name, v in counters.items():
            setattr(self, name, v)
        self.reset()
        self.current, self.pending, self.last_step_time = current, pending, last_step_time
        return self.current is not None
