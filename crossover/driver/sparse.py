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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from crossover.adaptive.gravac import Plan, StepStats
from crossover.adaptive.gravac import tunables as T
from crossover.adaptive.gravac.transport_choice import CfState, TransportChoice
from crossover.compression import cost_model
from crossover.compression.wire import SparseStatsLayout, normalize_reduced
from crossover.driver.records import StepRecord, check_int, check_real
from crossover.driver.steplog import StepLog

__all__ = ["CF_POLICY_STATE_VERSION", "CfPolicy", "SparseStepDriver", "TRANSPORTS"]

log = logging.getLogger("crossover.driver")

CF_POLICY_STATE_VERSION = 1

#: ``transport=`` of a rank-specific selector (top-k, DGC, RedSync): "auto" (the cost model's cheapest, then
#: measured time: ``TransportChoice``), "agreed" (always the agreed index set) or "allgather" (always each
#: rank's own pairs). Shared-index selectors (random-k) always allreduce: pass None.
TRANSPORTS = ("auto", cost_model.AGREED, cost_model.ALLGATHER)


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
                 rank: Callable[[], int] = lambda: 0, transport: str | None = None) -> None:
        if transport is not None and transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)} (or None for a shared-index "
                             f"compressor), got {transport!r}")
        self.policy = policy
        self.transport = transport
        config = getattr(policy, "config", None)
        omega = config.get("omega", T.OMEGA) if isinstance(config, Mapping) else T.OMEGA
        self.transports = TransportChoice((cost_model.AGREED, cost_model.ALLGATHER), omega=omega) \
            if transport == "auto" else None
        self.compressor = compressor
        self.seed = int(seed)
        self.log = StepLog(log_csv, rank)
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
        if self.current is not None:
            self._finish(self.current)
        plan = self.policy.plan()
        self.current = StepRecord(step=self.step, sent_cf=float(plan.send_cf),
                                  probes=tuple(float(p) for p in plan.probe_cfs),
                                  measure=plan.measure, transport=self._transport_for(float(plan.send_cf)))
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
        return SparseStatsLayout(len(self.current.probes) if self.current else 0)

    def add_reduced(self, reduced: Sequence[float], world: int) -> None:
        """One tensor's reduced statistics vector (as the reduction left it) for the step in flight."""
        rec = self.current
        if rec is None:
            return
        sums = normalize_reduced(reduced, world)
        if sums is not None:
            flags = (rec.nonfinite, rec.saturated)
            rec.add(sums, SparseStatsLayout(len(rec.probes)))
            self._count_flags(rec, flags)

    def _count_flags(self, rec: StepRecord, before: tuple[bool, bool]) -> None:
        """Count a step once when it first turns out non-finite or saturated."""
        if rec.nonfinite and not before[0]:
            self.nonfinite_steps += 1
            log.warning("crossover: step %d has non-finite gradient statistics (inf/NaN on some rank): the "
                        "affected tensors decode to NaN, their residuals are restored, the policy skips the step",
                        rec.step)
        if rec.saturated and not before[1]:
            self.saturated_steps += 1

    def add_sums(self, sums: Sequence[float], tensors: int, layout: SparseStatsLayout) -> None:
        """The whole step's statistics at once, in `layout`, already summed over tensors and ranks
        (TensorFlow accumulates them in graph); `sums[STEP_TIME]` is the sum over tensors of the mean
        step time. A layout with more probes than the plan (TF always measures two) is fine."""
        rec = self.current
        if rec is None or tensors <= 0:
            return
        flags = (rec.nonfinite, rec.saturated)
        rec.add([1.0, sums[layout.STEP_TIME] / tensors, *sums[2:layout.length]], layout)
        rec.tensors = tensors
        self._count_flags(rec, flags)

    def count(self, sent: int, dense: int) -> None:
        """Bytes handed to the framework for the step in flight, and what dense would have sent."""
        self.bytes_sent += sent
        self.bytes_dense += dense
        if self.current is not None:
            self.current.bytes_sent += sent
            self.current.bytes_dense += dense

    # ------------------------------------------------------------------ telemetry and state
    def stats(self) -> dict[str, Any]:
        """Cumulative telemetry of this rank: step, CF in use, gain, bytes sent vs dense."""
        summary = self.policy.summary()
        cf = summary.get("send_cf", 1.0)
        gains = summary.get("gains", {}) or {}
        gain = gains.get(cf, 1.0 if cf == 1.0 else None)
        return {"step": self.step, "compression_factor": cf, "gain": gain, "bytes_sent": self.bytes_sent,
                "bytes_dense": self.bytes_dense, "nonfinite_steps": self.nonfinite_steps,
                "saturated_steps": self.saturated_steps, "compressor": self.compressor, "policy": summary,
                "transport": self.current.transport if self.current is not None else None,
                "transport_choice": self.transports.summary() if self.transports is not None else None}

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue the same schedule (residuals are the glue's)."""
        return {"version": CF_POLICY_STATE_VERSION, "compressor": self.compressor, "seed": self.seed,
                "policy": self.policy.state_dict(), "bytes_sent": self.bytes_sent,
                "bytes_dense": self.bytes_dense, "step": self.step,
                # the last two steps' statistics, not yet fed to the policy (it observes one step late)
                "current": None if self.current is None else self.current.to_dict(),
                "pending": None if self.pending is None else self.pending.to_dict(),
                "last_step_time": self.last_step_time, "nonfinite_steps": self.nonfinite_steps,
                "saturated_steps": self.saturated_steps,
                "transport": None if self.transports is None else self.transports.state_dict()}

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
        policy = copy.deepcopy(self.policy)
        policy.load_state_dict(state["policy"])
        seed = check_int("seed", state["seed"], -(2 ** 63))
        counters = {name: check_int(name, state.get(name, 0), 0)
                    for name in ("bytes_sent", "bytes_dense", "step", "nonfinite_steps", "saturated_steps")}
        current = StepRecord.from_dict(state.get("current"))
        pending = StepRecord.from_dict(state.get("pending"))
        last_step_time = check_real("last_step_time", state.get("last_step_time", 0.0), 0.0)
        transports = None
        if self.transports is not None:  # a state saved without it (older, or another transport=) starts afresh
            transports = TransportChoice(self.transports.candidates, omega=self.transports.omega)
            if state.get("transport") is not None:
                transports.load_state_dict(state["transport"])
        # validated: apply
        self.policy, self.seed, self.transports = policy, seed, transports
        for name, v in counters.items():
            setattr(self, name, v)
        self.reset()
        self.current, self.pending, self.last_step_time = current, pending, last_step_time
        return self.current is not None
