"""GraVAC compression-factor policy (Tyagi and Swany, IEEE CLOUD 2023, arXiv 2305.12201).

Pure Python, standard library only: plain numbers in, decisions out. The policy never touches a
tensor; the caller compresses, measures and reports global (all-rank) statistics.

Why the interface looks like this: in a data-parallel job every rank must take the same decision on
every step without extra communication. So :meth:`GravacPolicy.plan` is a pure function of the
observations fed in so far, and the caller feeds every rank the same *global* statistics (summed
across ranks inside the gradient payload, possibly one step late). Same observations in the same
order give the same plans on every rank. See ``docs/gravac.md``.

Per step::

    plan = policy.plan()                 # send_cf (1.0 = dense) and probe_cfs to measure
    ...compress with plan.send_cf, measure ||C_cf(g)||^2 for every cf in plan.probe_cfs...
    policy.observe(StepStats(sent_cf=plan.send_cf, dense_sq_norm=..., compressed_sq_norms={...},
                             step_time_s=..., samples=...))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from crossover.adaptive._state import check_saved_state

__all__ = ["SCALINGS", "GravacPolicy", "Plan", "StepStats"]

#: Names accepted for ``scaling``: how the candidate step CF_s grows each window.
SCALINGS = ("exponential", "geometric")

_STATE_VERSION = 1
_DENSE = 1.0


@dataclass(frozen=True)
class Plan:
    """What to do on one step; identical on every rank fed the same observations.

    ``send_cf``: compression factor to send (dense size / compressed size); 1.0 means dense.
    ``probe_cfs``: CFs whose squared norm ``||C_cf(g)||^2`` the caller must measure this step,
    ascending and without duplicates: the floor CF_min and the candidate CF_min * CF_s (multi-level:
    the candidate compresses the already compressed floor tensor by CF_s).
    """

    send_cf: float
    probe_cfs: tuple[float, ...]

    @property
    def dense(self) -> bool:
        """True when this step sends the uncompressed gradient."""
        return self.send_cf == _DENSE

    @property
    def floor_cf(self) -> float:
        """The floor CF_min (first level of compression)."""
        return self.probe_cfs[0]

    @property
    def candidate_cf(self) -> float:
        """The candidate CF_min * CF_s (equals the floor when only one CF is probed)."""
        return self.probe_cfs[-1]

    @property
    def cf_s(self) -> float:
        """Second-level factor: compress the floor-compressed tensor by this to get the candidate."""
        return self.probe_cfs[-1] / self.probe_cfs[0]


@dataclass(frozen=True)
class StepStats:
    """Global statistics of one step, identical on every rank (the caller reduces them).

    ``sent_cf``: the ``Plan.send_cf`` actually used on that step.
    ``dense_sq_norm``: sum over tensors and ranks of ``||g||^2`` (g = gradient + residual).
    ``compressed_sq_norms``: ``{cf: sum over tensors and ranks of ||C_cf(g)||^2}`` for the CFs in
    that step's ``Plan.probe_cfs`` (keys are those exact floats; extra or missing keys are allowed).
    ``step_time_s``: wall time of the step in seconds (averaged over ranks).
    ``samples``: samples processed by the step (global, summed over ranks).

    Values that are not finite, or negative, are ignored by the policy (a NaN gradient on one step
    must not crash training); a zero ``dense_sq_norm`` carries no gain information and is skipped.
    """

    sent_cf: float
    dense_sq_norm: float
    compressed_sq_norms: Mapping[float, float]
    step_time_s: float
    samples: float

    def __post_init__(self) -> None:
        # Freeze a private copy so a caller mutating its dict cannot change a recorded step.
        frozen = MappingProxyType({float(k): float(v) for k, v in self.compressed_sq_norms.items()})
        object.__setattr__(self, "compressed_sq_norms", frozen)


@dataclass
class _Gain:
    """EWMA of the compression gain of one CF."""

    value: float
    count: int


@dataclass
class _Throughput:
    """Running totals for one sent CF: compression throughput = samples/s * mean gain."""

    samples: float = 0.0
    time_s: float = 0.0
    gain_sum: float = 0.0
    count: int = 0

    @property
    def value(self) -> float:
        return (self.samples / self.time_s) * (self.gain_sum / self.count)


@dataclass
class _State:
    floor: float
    scale: float
    candidate: float
    step: int = 0
    window_step: int = 0
    windows: int = 0
    settled: bool = False
    gains: dict[float, _Gain] = field(default_factory=dict)
    throughput: dict[float, _Throughput] = field(default_factory=dict)


def _finite_nonneg(x: float) -> bool:
    return math.isfinite(x) and x >= 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class GravacPolicy:
    """GraVAC compression-factor search as a deterministic state machine.

    The decision for step t depends only on the observations fed before it, so ranks that feed the
    same global statistics in the same order make the same plans (no extra communication).

    Keyword-only parameters (paper defaults):
      cf_min: initial floor CF_min, >= 1 (paper 10).
      cf_max: largest CF ever probed or sent, >= cf_min (paper 1000 to 2000).
      epsilon: gain a CF needs to be sent, in (0, 1] (paper 0.7 or 0.9).
      omega: relative tolerance for "same gain" and "same throughput", in [0, 1) (paper 0.01).
      window: observed steps between CF search decisions, int >= 1 (paper 500 to 2000).
      scaling: "exponential" (CF_s = 2, 4, 16, 256, ...: squared) or "geometric" (2, 4, 8, ...).
      warmup_steps: first observed steps sent dense (gains still measured), int >= 0.
      ewma_alpha: weight of the newest gain in the EWMA, in (0, 1]; 0.1 averages about 10 steps,
        which smooths step-to-step noise around epsilon yet is settled long before a window ends.
    """

    def __init__(
        self,
        *,
        cf_min: float = 10.0,
        cf_max: float = 1000.0,
        epsilon: float = 0.9,
        omega: float = 0.01,
        window: int = 500,
        scaling: str = "exponential",
        warmup_steps: int = 0,
        ewma_alpha: float = 0.1,
    ) -> None:
        if not _is_real(cf_min) or cf_min < 1:
            raise ValueError(f"cf_min must be a finite number >= 1, got {cf_min!r}")
        if not _is_real(cf_max):
            raise ValueError(f"cf_max must be a finite number >= cf_min, got {cf_max!r}")
        if cf_max < cf_min:
            raise ValueError(f"cf_min must be <= cf_max, got cf_min={cf_min!r} cf_max={cf_max!r}")
        if not _is_real(epsilon) or not 0.0 < epsilon <= 1.0:
            raise ValueError(f"epsilon must be in (0, 1], got {epsilon!r}")
        if not _is_real(omega) or not 0.0 <= omega < 1.0:
            raise ValueError(f"omega must be in [0, 1), got {omega!r}")
        if not _is_int(window) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}; got {scaling!r}")
        if not _is_int(warmup_steps) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not _is_real(ewma_alpha) or not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha!r}")
        self._cf_min0 = float(cf_min)
        self._cf_max = float(cf_max)
        self._epsilon = float(epsilon)
        self._omega = float(omega)
        self._window = window
        self._scaling = scaling
        self._warmup = warmup_steps
        self._alpha = float(ewma_alpha)
        # Throughput entries need this many steps before they take part in settling, so a CF sent
        # only now and then (a fallback) cannot win on one noisy step time.
        self._min_throughput_steps = max(1, window // 2)
        floor = self._cf_min0
        self._s = _State(floor=floor, scale=2.0, candidate=min(floor * 2.0, self._cf_max))

    # ------------------------------------------------------------------ decisions
    def plan(self) -> Plan:
        """Decision for the next step; pure (no side effects), same result until observe()."""
        s = self._s
        probes = (s.floor,) if s.candidate == s.floor else (s.floor, s.candidate)
        if s.step < self._warmup:
            return Plan(send_cf=_DENSE, probe_cfs=probes)
        return Plan(send_cf=self._choose(), probe_cfs=probes)

    def _choose(self) -> float:
        """Candidate if its gain >= epsilon, else the floor if its gain >= epsilon, else dense."""
        s = self._s
        for cf in (s.candidate, s.floor):
            g = s.gains.get(cf)
            if g is not None and g.value >= self._epsilon:
                return cf
        return _DENSE

    # ------------------------------------------------------------------ observations
    def observe(self, stats: StepStats) -> None:
        """Feed the global statistics of one step (in step order; may lag the plans)."""
        s = self._s
        step_gains = self._update_gains(stats)
        s.step += 1
        if s.step <= self._warmup:
            return  # warm-up: gains only, no throughput and no search
        self._record_throughput(stats, step_gains)
        if s.settled:
            return
        s.window_step += 1
        if s.window_step >= self._window:
            s.window_step = 0
            self._search()

    def _update_gains(self, stats: StepStats) -> dict[float, float]:
        """EWMA gain per probed CF; gain = sqrt(sum ||C(g)||^2 / sum ||g||^2) clipped to [0, 1]."""
        dense = float(stats.dense_sq_norm)
        measured: dict[float, float] = {}
        if not (_finite_nonneg(dense) and dense > 0.0):
            return measured
        for cf in sorted(stats.compressed_sq_norms):
            comp = stats.compressed_sq_norms[cf]
            if not (math.isfinite(cf) and cf >= 1.0 and _finite_nonneg(comp)):
                continue
            gain = min(1.0, math.sqrt(comp / dense))
            measured[cf] = gain
            old = self._s.gains.get(cf)
            if old is None:
                self._s.gains[cf] = _Gain(value=gain, count=1)
            else:
                old.value += self._alpha * (gain - old.value)
                old.count += 1
        return measured

    def _record_throughput(self, stats: StepStats, step_gains: Mapping[float, float]) -> None:
        """Add the step to the sent CF's entry: system throughput * gain of what was sent."""
        cf = float(stats.sent_cf)
        t, n = float(stats.step_time_s), float(stats.samples)
        if not (math.isfinite(cf) and cf >= 1.0 and math.isfinite(t) and math.isfinite(n)):
            return
        if t <= 0.0 or n <= 0.0:
            return
        if cf == _DENSE:
            gain = 1.0
        elif cf in step_gains:
            gain = step_gains[cf]
        elif cf in self._s.gains:
            gain = self._s.gains[cf].value
        else:
            return
        entry = self._s.throughput.setdefault(cf, _Throughput())
        entry.samples += n
        entry.time_s += t
        entry.gain_sum += gain
        entry.count += 1

    # ------------------------------------------------------------------ CF search
    def _search(self) -> None:
        """One window decision: settle, else raise the floor, step CF_s up, settle if exhausted."""
        s = self._s
        s.windows += 1
        ranked = self._ranked_throughput()
        if len(ranked) >= 2:
            (cf1, t1), (cf2, t2) = ranked[0], ranked[1]
            if t1 - t2 <= self._omega * t1:
                self._settle(min(cf1, cf2))
                return
        at_bound = s.candidate >= self._cf_max
        raised = False
        if s.candidate != s.floor:
            g_floor, g_cand = s.gains.get(s.floor), s.gains.get(s.candidate)
            if g_cand is None:
                return  # candidate not measured yet (observation lag > window): retry next window
            if g_floor is not None and abs(g_floor.value - g_cand.value) <= self._omega * g_floor.value:
                s.floor = s.candidate  # compressing further loses nothing extra: raise the floor
                raised = True
        grown = s.scale * s.scale if self._scaling == "exponential" else s.scale * 2.0
        s.scale = min(grown, max(self._cf_max, 2.0))  # beyond cf_max it changes nothing
        s.candidate = min(s.floor * s.scale, self._cf_max)
        if at_bound and not raised and ranked:
            self._settle(ranked[0][0])  # the candidate can move no further: take the best CF

    def _ranked_throughput(self) -> list[tuple[float, float]]:
        """Compressed CFs with enough steps, best compression throughput first (ties: lower CF)."""
        rows = [
            (cf, e.value)
            for cf, e in self._s.throughput.items()
            if cf != _DENSE and e.count >= self._min_throughput_steps
        ]
        rows.sort(key=lambda r: (-r[1], r[0]))
        return rows

    def _settle(self, cf: float) -> None:
        s = self._s
        s.settled = True
        s.floor = s.candidate = cf

    # ------------------------------------------------------------------ telemetry
    @property
    def step(self) -> int:
        """Number of observations fed so far."""
        return self._s.step

    @property
    def warming_up(self) -> bool:
        """True while the next plan is a warm-up (dense) step."""
        return self._s.step < self._warmup

    @property
    def send_cf(self) -> float:
        """CF the next plan sends (1.0 = dense)."""
        return self.plan().send_cf

    @property
    def floor_cf(self) -> float:
        """Current floor CF_min."""
        return self._s.floor

    @property
    def candidate_cf(self) -> float:
        """Current candidate CF_min * CF_s (equals the floor once settled or at cf_max)."""
        return self._s.candidate

    @property
    def cf_s(self) -> float:
        """Effective candidate step CF_s = candidate / floor (after the cf_max bound)."""
        return self._s.candidate / self._s.floor

    @property
    def floor_gain(self) -> float | None:
        """EWMA gain of the floor CF, None before it was measured."""
        g = self._s.gains.get(self._s.floor)
        return None if g is None else g.value

    @property
    def candidate_gain(self) -> float | None:
        """EWMA gain of the candidate CF, None before it was measured."""
        g = self._s.gains.get(self._s.candidate)
        return None if g is None else g.value

    @property
    def gains(self) -> dict[float, float]:
        """EWMA gain of every CF ever probed (a copy)."""
        return {cf: g.value for cf, g in sorted(self._s.gains.items())}

    @property
    def settled(self) -> bool:
        """True once the search stopped; floor and candidate are then the settled CF."""
        return self._s.settled

    @property
    def throughput(self) -> dict[float, float]:
        """Compression throughput (samples/s * mean gain) per CF sent after warm-up (a copy)."""
        return {cf: e.value for cf, e in sorted(self._s.throughput.items())}

    @property
    def config(self) -> dict[str, Any]:
        """Constructor arguments, as plain values."""
        return {
            "cf_min": self._cf_min0,
            "cf_max": self._cf_max,
            "epsilon": self._epsilon,
            "omega": self._omega,
            "window": self._window,
            "scaling": self._scaling,
            "warmup_steps": self._warmup,
            "ewma_alpha": self._alpha,
        }

    def summary(self) -> dict[str, Any]:
        """Read-only snapshot for telemetry (plain values; float dict keys are CFs)."""
        s = self._s
        return {
            "step": s.step,
            "warming_up": self.warming_up,
            "send_cf": self.send_cf,
            "floor_cf": s.floor,
            "candidate_cf": s.candidate,
            "cf_s": self.cf_s,
            "floor_gain": self.floor_gain,
            "candidate_gain": self.candidate_gain,
            "settled": s.settled,
            "windows": s.windows,
            "window_step": s.window_step,
            "gains": self.gains,
            "throughput": self.throughput,
            "throughput_steps": {cf: e.count for cf, e in sorted(s.throughput.items())},
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Full state as JSON-serialisable plain values (lists instead of float-keyed dicts)."""
        s = self._s
        return {
            "version": _STATE_VERSION,
            "config": self.config,
            "floor": s.floor,
            "scale": s.scale,
            "candidate": s.candidate,
            "step": s.step,
            "window_step": s.window_step,
            "windows": s.windows,
            "settled": s.settled,
            "gains": [[cf, g.value, g.count] for cf, g in sorted(s.gains.items())],
            "throughput": [
                [cf, e.samples, e.time_s, e.gain_sum, e.count] for cf, e in sorted(s.throughput.items())
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the saved config must equal this policy's config."""
        check_saved_state("GravacPolicy", state, _STATE_VERSION, self.config)
        st = _State(
            floor=float(state["floor"]),
            scale=float(state["scale"]),
            candidate=float(state["candidate"]),
            step=int(state["step"]),
            window_step=int(state["window_step"]),
            windows=int(state["windows"]),
            settled=bool(state["settled"]),
            gains={float(cf): _Gain(float(v), int(n)) for cf, v, n in state["gains"]},
            throughput={
                float(cf): _Throughput(float(n), float(t), float(g), int(c))
                for cf, n, t, g, c in state["throughput"]
            },
        )
        self._check_state(st)
        self._s = st

    def _check_state(self, s: _State) -> None:
        """Raise ValueError for a loaded state no run of this policy could reach (nothing is applied)."""
        if not (_is_real(s.floor) and 1.0 <= s.floor <= self._cf_max):
            raise ValueError(f"GravacPolicy state: floor {s.floor!r} outside [1, cf_max={self._cf_max:g}]")
        if not (_is_real(s.candidate) and s.floor <= s.candidate <= self._cf_max):
            raise ValueError(f"GravacPolicy state: candidate {s.candidate!r} outside [floor, cf_max]")
        if not (_is_real(s.scale) and s.scale >= 1.0):
            raise ValueError(f"GravacPolicy state: scale {s.scale!r} must be a finite number >= 1")
        if min(s.step, s.window_step, s.windows) < 0:
            raise ValueError("GravacPolicy state: negative step counters")
        for cf, g in s.gains.items():
            if not (_is_real(cf) and cf >= 1 and _finite_nonneg(g.value) and g.count >= 0):
                raise ValueError(f"GravacPolicy state: bad gain entry {cf!r}: {g!r}")
        for cf, t in s.throughput.items():
            if not (_is_real(cf) and cf >= 1 and all(_finite_nonneg(v) for v in (t.samples, t.time_s, t.gain_sum))
                    and t.count >= 0):
                raise ValueError(f"GravacPolicy state: bad throughput entry {cf!r}: {t!r}")

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> GravacPolicy:
        """Build a policy with the saved config and restore its state."""
        policy = cls(**dict(state["config"]))
        policy.load_state_dict(state)
        return policy

    def __repr__(self) -> str:
        s = self._s
        return (
            f"GravacPolicy(step={s.step}, floor={s.floor:g}, candidate={s.candidate:g}, settled={s.settled})"
        )
