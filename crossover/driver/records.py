"""The record of one step's global statistics, as the reduced payloads arrive, and the checks a saved one passes."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from crossover.adaptive.gravac import StepStats
from crossover.compression.wire import STAT_MAX, SparseStatsLayout

__all__ = ["StepRecord", "check_int", "check_real"]


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


#: Fields a record saved before they existed may lack (their defaults stand in).
_ADDED_LATER = {"momentum", "transport", "transport_bytes"}


def check_int(what: str, v: object, lo: int) -> int:
    """`v` as an int (numpy integers too) if it is one and >= lo, else ValueError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")
    return int(v)


def check_real(what: str, v: object, lo: float) -> float:
    """`v` as a float if it is a finite real number >= lo, else ValueError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < lo:
        raise ValueError(f"{what} must be a finite number >= {lo:g}, got {v!r}")
    return float(v)
