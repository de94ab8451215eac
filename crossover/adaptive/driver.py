"""The step driver: everything an adaptive compression does per step that is not moving tensors.

Plain numbers in and out; no framework, no Horovod. The Horovod glue (horovod.torch and
horovod.tensorflow objects) and the PyTorch DDP hook all keep only tensor movement and call this:

    plan = driver.begin_step(now)              # first gradient of a step: finish the last one, plan this one
    local = driver.layout.local(...)            # per tensor: the statistics vector that rides in the payload
    ...the framework reduces the payload (sum or average over ranks)...
    driver.add_reduced(reduced_stats, world)    # per tensor, as its decompress runs
    driver.count(sent_bytes, dense_bytes)

Why one step late: the statistics of step t (gains) are known once its payloads are reduced, but
the duration of step t is only known when step t+1 begins, and it reaches every rank inside step
t+1's payloads. So the policy observes step t when step t+1 is finished (`pending`). Every rank feeds
the policy the same reduced numbers in the same order, so every rank takes the same decisions.

The statistics vector (`SparseStatsLayout`) is defined once here; its first element is 1.0 on every
rank, so after the reduction it tells the scale the framework applied (1 for Average, the world size
for Sum, times any pre/postscale), from which `add_reduced` recovers sums over ranks.

`QuantStepDriver` does the same for DQ-SGD/QSGD: bits per step instead of a compression factor,
statistics `[1, ||x||^2]`, and DQ-SGD's budget calibration on the first usable step.
"""

from __future__ import annotations

import copy
import csv
import logging
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from crossover.adaptive.dqsgd import MAX_BITS, MIN_BITS, DqsgdPolicy, DqsgdStats, error_budget_for_bits
from crossover.adaptive.gravac import Plan, StepStats

__all__ = ["SparseStatsLayout", "StepRecord", "SparseStepDriver", "QuantStepDriver", "QUANT_STATS_LEN",
           "STAT_MAX", "clamp_stat",
           "normalize_reduced", "shared_seed", "GradientKeys", "check_min_numel", "gravac_or_dense",
           "dqsgd_settings", "lr_at", "DQSGD_PARAMS"]

log = logging.getLogger(__name__)

CF_POLICY_STATE_VERSION = 1
QUANT_STATE_VERSION = 1
QUANT_STATS_LEN = 2  # [1, ||x||^2]
# Statistics travel in float32 and are summed over ranks: each rank's finite values are clamped to
# STAT_MAX (2**100) so that a sum over up to 2**27 ranks cannot overflow float32 (max ~2**128). They are
# computed in float64 (a gradient of 1e36 per element has a finite ||g||^2 there). A reduced statistic
# at or above STAT_MAX means some rank saturated: that step is not shown to the policy (`saturated`).
STAT_MAX = 2.0 ** 100


def clamp_stat(x: float, hi: float = STAT_MAX) -> float:
    """`x` clamped to `hi` when finite; inf and NaN stay as they are (they mark a non-finite step)."""
    return min(x, hi) if math.isfinite(x) else x


class CfPolicy(Protocol):
    """What the sparse driver needs of a compression-factor policy (GravacPolicy, StaticPolicy)."""

    def plan(self) -> Plan: ...

    def observe(self, stats: StepStats) -> None: ...

    def summary(self) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def shared_seed(seed: int, step: int, key: str) -> int:
    """A 63-bit seed for (step, tensor) that every rank computes alike with no communication (FNV-1a)."""
    h = 1469598103934665603
    for ch in f"{seed}:{step}:{key}".encode():
        h = ((h ^ ch) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


# ---------------------------------------------------------------------------------------------
# The statistics vector of sparse (GraVAC / static) compression
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SparseStatsLayout:
    """Layout of the statistics that ride in every compressed payload, for `nprobes` probed CFs.

    ``[1, previous step time, ||g||^2, ||g||, ||g+e||^2, ||g+e||, ||C_cf_i(g+e)||^2 ..., ||C_cf_i(g+e)|| ...]``
    with g the local gradient, e its error-feedback residual and C_cf the compressor at factor cf.
    Each entry but the first two is summed over tensors (by the driver) and over ranks (by the
    reduction), which is what the policy's gain definitions are written in.
    """

    nprobes: int
    ONE = 0
    STEP_TIME = 1
    GRAD_SQ = 2
    GRAD_NORM = 3
    ACC_SQ = 4
    ACC_NORM = 5
    HEAD = 6

    @property
    def length(self) -> int:
        return self.HEAD + 2 * self.nprobes

    def probe_sq(self, i: int) -> int:
        return self.HEAD + i

    def probe_norm(self, i: int) -> int:
        return self.HEAD + self.nprobes + i

    def local(self, *, step_time: float, grad_sq: float, acc_sq: float, probe_sq: Sequence[float]) -> list[float]:
        """One tensor's vector on one rank, from squared norms (the norms are their square roots).

        Every value is clamped to STAT_MAX (`clamp_stat`) so that it converts to float32 and its sum
        over ranks stays finite; a non-finite input stays non-finite, so the reduced vector is
        non-finite on every rank (`StepRecord.nonfinite`).
        """
        if len(probe_sq) != self.nprobes:
            raise ValueError(f"expected {self.nprobes} probe norms, got {len(probe_sq)}")
        out = [1.0, step_time, grad_sq, _sqrt(grad_sq), acc_sq, _sqrt(acc_sq), *probe_sq,
               *(_sqrt(v) for v in probe_sq)]
        return [clamp_stat(v) for v in out]


def _sqrt(x: float) -> float:
    return math.sqrt(x) if x > 0 else (0.0 if x == 0 else float("nan"))


def normalize_reduced(reduced: Sequence[float], world: int) -> list[float] | None:
    """A reduced statistics vector as sums over ranks (step time: the mean); None if unusable.

    ``reduced[0]`` is 1 summed or averaged over ranks and scaled like the payload: it is the factor
    that turns the reduction back into a sum (``world / reduced[0]``) or a mean (``1 / reduced[0]``).
    """
    scale = float(reduced[0])
    if not (math.isfinite(scale) and scale > 0):
        return None
    to_sum = world / scale
    out = [1.0, float(reduced[1]) / scale]
    out.extend(float(v) * to_sum for v in reduced[2:])
    return out


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
    bytes_sent: int = 0
    bytes_dense: int = 0
    nonfinite: bool = False  # some tensor's reduced statistics were inf/NaN: not shown to the policy
    saturated: bool = False  # some statistic reached STAT_MAX (clamped): not shown to the policy

    def __post_init__(self) -> None:
        n = len(self.probes)
        self.probe_sq = list(self.probe_sq) or [0.0] * n
        self.probe_norm = list(self.probe_norm) or [0.0] * n
        if len(self.probe_sq) != n or len(self.probe_norm) != n:
            raise ValueError("probe statistics must have one value per probed CF")

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
                 "compressed_norm_sums": dict(zip(self.probes, self.probe_norm))}
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
        allowed = {f.name for f in fields(cls)}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(f"unknown step record fields {sorted(unknown)}")
        rec = cls(**{**d, "probes": tuple(float(p) for p in d["probes"])})
        rec.validate()
        return rec

    def validate(self) -> None:
        """Raise ValueError unless every field is a sane value (a loaded state is checked before use)."""
        _check_int("step record step", self.step, 0)
        _check_real("step record sent_cf", self.sent_cf, 1.0)
        for cf in self.probes:
            _check_real("step record probe CF", cf, 1.0)
        for name in ("tensors", "bytes_sent", "bytes_dense"):
            _check_int(f"step record {name}", getattr(self, name), 0)
        for name in ("grad_sq", "grad_norm", "acc_sq", "acc_norm"):
            _check_real(f"step record {name}", getattr(self, name), 0.0)
        for v in (*self.probe_sq, *self.probe_norm):
            _check_real("step record probe statistic", v, 0.0)
        if self.prev_step_time is not None:
            _check_real("step record prev_step_time", self.prev_step_time, 0.0)
        if not all(isinstance(v, bool) for v in (self.nonfinite, self.saturated, self.measure)):
            raise ValueError("step record nonfinite/saturated/measure must be booleans")


def _check_int(what: str, v: object, lo: int) -> int:
    """`v` as an int (numpy integers too) if it is one and >= lo, else ValueError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")
    return int(v)


def _check_real(what: str, v: object, lo: float) -> float:
    """`v` as a float if it is a finite real number >= lo, else ValueError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < lo:
        raise ValueError(f"{what} must be a finite number >= {lo:g}, got {v!r}")
    return float(v)


class StepLog:
    """The per-step CSV telemetry file of one rank (`log_csv`).

    * One file per rank: `{rank}` in the pattern is replaced by the rank; a pattern without it gets
      `.rank<r>` before its extension (`gravac.csv` -> `gravac.rank0.csv`), so ranks never share a file.
    * Never mixed into an existing file: the file is created at the first step; if the path exists,
      the next free `<name>.<n><ext>` is used and a warning names it.
    * A header that cannot lie: fixed columns, the probed CFs are values in each row
      (`probe1_cf, probe1_gain, probe2_cf, probe2_gain`; GraVAC probes at most two CFs), `skipped` = 1
      when the policy did not observe the step (non-finite or saturated statistics).
    * The squared norms the gains come from, summed over ranks and tensors (`grad_sq` = ||g||^2,
      `acc_sq` = ||g + e||^2, `probe1_sq`, `probe2_sq` = ||C_cf(g + e)||^2): `probeN_gain` is the "norm"
      definition, sqrt(probeN_sq / acc_sq); the default "delivered" gain is min(1, sqrt(probeN_sq / grad_sq)).
      A policy's decisions can be replayed from these columns.
    """

    HEADER = ("step", "sent_cf", "step_time_s", "bytes_sent", "bytes_dense", "probe1_cf", "probe1_gain",
              "probe2_cf", "probe2_gain", "skipped", "grad_sq", "acc_sq", "probe1_sq", "probe2_sq")
    MAX_PROBES = 2

    def __init__(self, pattern: str | None, rank: Callable[[], int]) -> None:
        self.pattern = pattern
        self._rank = rank
        self.path: str | None = None  # the file actually written, once opened

    def open(self) -> None:
        """Create this rank's file with its header (first step); idempotent."""
        if not self.pattern or self.path is not None:
            return
        pattern = self.pattern
        if "{rank}" not in pattern:
            root, ext = os.path.splitext(pattern)
            pattern = root + ".rank{rank}" + ext
        wanted = pattern.format(rank=self._rank())
        root, ext = os.path.splitext(wanted)
        path, n = wanted, 0
        while True:
            try:
                fh = open(path, "x", newline="")
                break
            except FileExistsError:
                n += 1
                path = f"{root}.{n}{ext}"
        with fh:
            csv.writer(fh).writerow(self.HEADER)
        if path != wanted:
            log.warning("crossover: log_csv file %s exists; writing %s instead (an existing file is never "
                        "appended to)", wanted, path)
        self.path = path

    @classmethod
    def row_stats(cls, row: Mapping[str, str]) -> StepStats | None:
        """The policy's view of one row that `write` wrote (built as the driver builds it, `to_stats`); None for
        a step the policy did not observe (`skipped`). The norm sums are not in the file: they read as 0."""
        if row["skipped"] not in ("0", ""):
            return None
        probes = tuple(float(row[f"probe{i}_cf"]) for i in range(1, cls.MAX_PROBES + 1) if row[f"probe{i}_cf"] != "")
        rec = StepRecord(step=int(row["step"]), sent_cf=float(row["sent_cf"]), probes=probes)
        if row["grad_sq"] != "":  # written only for a measured step
            rec.grad_sq, rec.acc_sq = float(row["grad_sq"]), float(row["acc_sq"])
            rec.probe_sq = [float(row[f"probe{i}_sq"]) for i in range(1, len(probes) + 1)]
        return rec.to_stats(float(row["step_time_s"]))

    def write(self, step: int, rec: StepRecord, step_time: float) -> None:
        if not self.pattern:
            return
        self.open()
        probes: list[Any] = []
        for cf, g in list(zip(rec.probes, rec.gains()))[:self.MAX_PROBES]:
            probes += [cf, "" if g is None or rec.skipped else g]
        probes += [""] * (2 * self.MAX_PROBES - len(probes))
        measured = rec.tensors > 0 and not rec.skipped
        norms = [rec.grad_sq, rec.acc_sq, *rec.probe_sq[:self.MAX_PROBES]] if measured else []
        norms = [repr(float(v)) for v in norms] + [""] * (2 + self.MAX_PROBES - len(norms))
        with open(self.path, "a", newline="") as fh:  # type: ignore[arg-type]
            csv.writer(fh).writerow([step, rec.sent_cf, f"{step_time:.6f}", rec.bytes_sent, rec.bytes_dense,
                                     *probes, int(rec.skipped), *norms])


# ---------------------------------------------------------------------------------------------
# Sparse (GraVAC / static CF) driver
# ---------------------------------------------------------------------------------------------
class SparseStepDriver:
    """Step counter, plans, one-step-late observation, byte counters and state of a CF policy."""

    def __init__(self, policy: CfPolicy, *, compressor: str, seed: int, log_csv: str | None = None,
                 rank: Callable[[], int] = lambda: 0) -> None:
        self.policy = policy
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
                                  measure=plan.measure)
        return self.current

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
                "saturated_steps": self.saturated_steps, "compressor": self.compressor, "policy": summary}

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue the same schedule (residuals are the glue's)."""
        return {"version": CF_POLICY_STATE_VERSION, "compressor": self.compressor, "seed": self.seed,
                "policy": self.policy.state_dict(), "bytes_sent": self.bytes_sent,
                "bytes_dense": self.bytes_dense, "step": self.step,
                # the last two steps' statistics, not yet fed to the policy (it observes one step late)
                "current": None if self.current is None else self.current.to_dict(),
                "pending": None if self.pending is None else self.pending.to_dict(),
                "last_step_time": self.last_step_time, "nonfinite_steps": self.nonfinite_steps,
                "saturated_steps": self.saturated_steps}

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
        seed = _check_int("seed", state["seed"], -(2 ** 63))
        counters = {name: _check_int(name, state.get(name, 0), 0)
                    for name in ("bytes_sent", "bytes_dense", "step", "nonfinite_steps", "saturated_steps")}
        current = StepRecord.from_dict(state.get("current"))
        pending = StepRecord.from_dict(state.get("pending"))
        last_step_time = _check_real("last_step_time", state.get("last_step_time", 0.0), 0.0)
        # validated: apply
        self.policy, self.seed = policy, seed
        for name, v in counters.items():
            setattr(self, name, v)
        self.reset()
        self.current, self.pending, self.last_step_time = current, pending, last_step_time
        return self.current is not None


# ---------------------------------------------------------------------------------------------
# Quantization (DQ-SGD / QSGD) driver
# ---------------------------------------------------------------------------------------------
class QuantStepDriver:
    """Bits per step: fixed (QSGD) or from DQ-SGD, fed the reduced ||x||^2 one step later.

    `dqsgd`: None for fixed `bits`; else the DQ-SGD settings (`total_steps`, `b_min`, `b_max`, `decay`,
    `target_bits`, `error_budget` (None: calibrated on the first usable step)).
    """

    def __init__(self, *, bits: int, dqsgd: Mapping[str, Any] | None = None) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
            raise ValueError(f"bits must be an int in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
        self.fixed_bits = bits
        self.step = 0
        self.bytes_sent = 0
        self.bytes_dense = 0
        self.nonfinite_steps = 0
        self.policy: DqsgdPolicy | None = None
        self._dq = dict(dqsgd) if dqsgd is not None else None
        if self._dq is not None:
            kw = self._policy_kw()
            budget = self._dq.get("error_budget")
            # validates the settings now (construction), not on the first step
            probe = DqsgdPolicy(error_budget=1.0 if budget is None else budget, **kw)
            self.policy = probe if budget is not None else None
        self.bits = self._plan_bits()
        self.reset()

    def _policy_kw(self) -> dict[str, Any]:
        dq = self._dq or {}
        return {"total_steps": dq["total_steps"], "b_min": dq["b_min"], "b_max": dq["b_max"],
                "decay": dq["decay"], "initial_bits": dq["target_bits"]}

    @property
    def adaptive(self) -> bool:
        return self._dq is not None

    def reset(self) -> None:
        """Forget the step in flight (elastic reset); policy state stays."""
        self._sq = 0.0
        self._have_sq = False
        self._nonfinite = False
        self._numel = 0
        self.lr: float | None = None

    def begin_step(self, world: int) -> int:
        """A new step begins: observe the last one (DQ-SGD; not a non-finite one), return this step's bits."""
        if self.step > 0 and self._have_sq and not self._nonfinite:
            self._observe(self._sq, world)
        self.step += 1
        self._sq, self._have_sq, self._nonfinite, self._numel = 0.0, False, False, 0
        self.bits = self._plan_bits()
        return self.bits

    def _plan_bits(self) -> int:
        if self._dq is None:
            return self.fixed_bits
        return int(self._dq["target_bits"]) if self.policy is None else self.policy.plan().bits

    def _observe(self, sq_norm: float, world: int) -> None:
        """Feed one finished step to DQ-SGD, calibrating the budget on the first usable step.

        `sq_norm` is the rank-summed ||x||^2; the variance bound wants the average over `world`
        independently quantized ranks.
        """
        if self._dq is None:
            return
        g = sq_norm / (world * world)
        lr = self.lr
        if self.policy is None:
            if not (g > 0 and lr):
                return
            budget = error_budget_for_bits(int(self._dq["target_bits"]), grad_sq_norm=g, numel=self._numel, lr=lr,
                                           total_steps=int(self._dq["total_steps"]))
            self.policy = DqsgdPolicy(error_budget=budget, **self._policy_kw())
        self.policy.observe(DqsgdStats(grad_sq_norm=g, numel=self._numel, lr=lr if lr else float("nan"),
                                       step=self.step - 1, bits=self.bits))

    def add_tensor(self, numel: int) -> None:
        """A compressed tensor of `numel` elements joins the step in flight."""
        self._numel += numel

    def add_reduced_sq(self, reduced_one: float, reduced_sq: float, world: int) -> None:
        """One tensor's reduced `[1, ||x||^2]` (as the reduction left it)."""
        if math.isfinite(reduced_one) and reduced_one > 0:
            self.add_sq_sum(reduced_sq * world / reduced_one)

    def add_sq_sum(self, sq_sum: float) -> None:
        """||x||^2 summed over ranks (and tensors), for the step in flight; inf/NaN marks it non-finite."""
        if not math.isfinite(sq_sum):
            if not self._nonfinite:
                self.nonfinite_steps += 1
                log.warning("crossover: step %d has a non-finite gradient norm (inf/NaN on some rank): "
                            "DQ-SGD skips it", self.step)
            self._nonfinite = True
            return
        self._sq += sq_sum
        self._have_sq = True

    def count(self, sent: int, dense: int) -> None:
        self.bytes_sent += sent
        self.bytes_dense += dense

    def stats(self) -> dict[str, Any]:
        """Cumulative telemetry of this rank, with the bits of the step in flight."""
        out: dict[str, Any] = {"step": self.step, "bits": self.bits, "compression_factor": 32.0 / self.bits,
                               "gain": None, "bytes_sent": self.bytes_sent, "bytes_dense": self.bytes_dense,
                               "nonfinite_steps": self.nonfinite_steps}
        if self.adaptive:
            out["policy"] = None if self.policy is None else self.policy.summary()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"version": QUANT_STATE_VERSION, "step": self.step, "bits": self.bits,
                "policy": None if self.policy is None else self.policy.state_dict(),
                "bytes_sent": self.bytes_sent, "bytes_dense": self.bytes_dense,
                "nonfinite_steps": self.nonfinite_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`; validated first, ValueError and no change on bad state."""
        try:
            if not isinstance(state, Mapping) or state.get("version") != QUANT_STATE_VERSION:
                raise ValueError(f"unsupported quantized compression state version "
                                 f"{getattr(state, 'get', lambda _: None)('version')!r}")
            pol = state.get("policy")
            policy = None if pol is None else DqsgdPolicy.from_state_dict(pol)
            step = _check_int("step", state["step"], 0)
            bits = _check_int("bits", state["bits"], MIN_BITS)
            if bits > MAX_BITS:
                raise ValueError(f"bits must be in [{MIN_BITS}, {MAX_BITS}], got {bits}")
            counters = [_check_int(n, state.get(n, 0), 0) for n in ("bytes_sent", "bytes_dense", "nonfinite_steps")]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a valid quantized compression state: {type(exc).__name__}: {exc}") from exc
        self.policy, self.step, self.bits = policy, step, bits
        self.bytes_sent, self.bytes_dense, self.nonfinite_steps = counters
        self.reset()


# ---------------------------------------------------------------------------------------------
# Keys of a step's gradients, and the policies the compression objects build
# ---------------------------------------------------------------------------------------------
class GradientKeys:
    """Keys for the gradients of one step: the host's name, else the gradient's position in the step.

    A name seen twice in one step means a new step began (the host did not say so).
    """

    def __init__(self) -> None:
        self._ordinal = 0
        self._seen: set[str] = set()

    def begin(self) -> None:
        """A new step starts: positions restart at 0."""
        self._ordinal = 0
        self._seen.clear()

    def key(self, name: str | None) -> tuple[str, bool]:
        """The key for the next gradient, and whether it was already seen this step (a new step began)."""
        key = name if name is not None else f"#{self._ordinal}"
        self._ordinal += 1
        repeated = key in self._seen
        self._seen.add(key)
        return key, repeated


def check_min_numel(min_compress_numel: object) -> int:
    """`min_compress_numel` validated: an int >= 1."""
    if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) or min_compress_numel < 1:
        raise ValueError(f"min_compress_numel must be an int >= 1, got {min_compress_numel!r}")
    return min_compress_numel


def gravac_or_dense(enabled: bool, **params: Any) -> CfPolicy:
    """AdaptiveCompression's policy: GraVAC with `params`, or CF 1 (dense) when not `enabled`."""
    import inspect

    from crossover.adaptive.gravac import GravacPolicy
    from crossover.adaptive.static import StaticPolicy

    known = [p for p in inspect.signature(GravacPolicy.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"unknown GraVAC setting(s) {', '.join(unknown)}; the settings are {', '.join(known)}")
    return GravacPolicy(**params) if enabled else StaticPolicy(cf=1.0)


DQSGD_PARAMS = ("total_steps, lr, error_budget, target_bits, b_min, b_max, decay, error_feedback, "
                "min_compress_numel, seed, transport")


def dqsgd_settings(*, total_steps: object, lr: object, error_budget: float | None, target_bits: object,
                   b_min: int, b_max: int, decay: float) -> dict[str, Any]:
    """DQ-SGD's settings, validated at construction (for `QuantStepDriver(dqsgd=...)`)."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an int >= 1 (the training horizon DQ-SGD plans bits for), "
                         f"got {total_steps!r}")
    if lr is not None and not callable(lr) and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                                                or not lr > 0):
        raise ValueError(f"lr must be a number > 0, a callable step -> lr, or None (read from the "
                         f"optimizer), got {lr!r}")
    # validates b_min, b_max, decay, error_budget
    DqsgdPolicy(error_budget=1.0 if error_budget is None else error_budget, total_steps=total_steps,
                b_min=b_min, b_max=b_max, decay=decay)
    if isinstance(target_bits, bool) or not isinstance(target_bits, int) or not b_min <= target_bits <= b_max:
        raise ValueError(f"target_bits must be an int in [b_min, b_max] = [{b_min}, {b_max}], got {target_bits!r}")
    return {"total_steps": total_steps, "error_budget": error_budget, "target_bits": target_bits,
            "b_min": b_min, "b_max": b_max, "decay": decay}


def lr_at(lr: object, step: int, optimizer_lr: Callable[[], float | None]) -> float | None:
    """The learning rate DQ-SGD uses at `step`: a number, a callable step -> lr, else the optimizer's."""
    if callable(lr):
        return float(lr(step))
    if lr is not None:
        return float(lr)  # type: ignore[arg-type]
    return optimizer_lr()
