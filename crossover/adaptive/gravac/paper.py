"""GraVAC's own search, as the paper describes it (Tyagi and Swany, arXiv 2305.12201, Algorithm 1).

Kept apart from the practical ladder search (``ladder.py``) so it reads against the paper. Per step:

1. Multi-level compression: the floor CF_min and the candidate CF_min * CF_s are both probed; the candidate
   compresses the floor's selection further, so measuring it costs little (:meth:`PaperSearch.plan`).
2. Each probed CF's gain is smoothed (``gains.py``).
3. Send the candidate if its gain >= epsilon, else the floor if its gain >= epsilon, else dense
   (:meth:`PaperSearch.choose`); record compression throughput = samples/s x gain of what was sent.
4. Every window: settle on the lower of the two best compression throughputs if they are within omega;
   else raise the floor to the candidate when their gains are within omega (compressing further loses
   nothing extra), grow CF_s (exponential 2, 4, 16, 256, ... or geometric 2, 4, 8, ...) up to CF_max,
   and settle on the best CF once the candidate can move no further (:meth:`PaperSearch.end_window`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from crossover.adaptive.gravac.gains import GainBook
from crossover.adaptive.gravac.types import DENSE, Plan, StepStats, finite_nonneg, is_real

__all__ = ["SCALINGS", "PaperSearch"]

#: Names accepted for ``scaling``: how the candidate step CF_s grows each window.
SCALINGS = ("exponential", "geometric")


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
class PaperState:
    """The paper search's state: floor CF_min, the candidate's step CF_s (``scale``), the candidate itself."""

    floor: float
    scale: float
    candidate: float
    window_step: int = 0  # observations in the current window
    windows: int = 0  # windows ended
    settled: bool = False
    throughput: dict[float, _Throughput] = field(default_factory=dict)


class PaperSearch:
    """The paper's floor / candidate search over the smoothed gains in ``gains``."""

    def __init__(self, *, cf_min: float, cf_max: float, epsilon: float, omega: float, scaling: str,
                 gains: GainBook, window_at: Callable[[int], int]) -> None:
        self._cf_max, self._epsilon, self._omega, self._scaling = cf_max, epsilon, omega, scaling
        self._gains = gains
        self._window_at = window_at
        self.s = PaperState(floor=cf_min, scale=2.0, candidate=min(cf_min * 2.0, cf_max))

    def plan(self, warming_up: bool) -> Plan:
        s = self.s
        probes = (s.floor,) if s.candidate == s.floor else (s.floor, s.candidate)
        return Plan(send_cf=DENSE if warming_up else self.choose(), probe_cfs=probes)

    def choose(self) -> float:
        """Step 3: the candidate if its gain >= epsilon, else the floor if so, else dense."""
        s = self.s
        for cf in (s.candidate, s.floor):
            g = self._gains.get(cf)
            if g is not None and g >= self._epsilon:
                return cf
        return DENSE

    def observe(self, stats: StepStats, step_gains: Mapping[float, float], step: int) -> None:
        """A step after warm-up (``step`` observed so far, this one included)."""
        s = self.s
        self._record_throughput(stats, step_gains)
        if s.settled:
            return
        s.window_step += 1
        if s.window_step >= self._window_at(step - s.window_step):
            s.window_step = 0
            self.end_window(step)

    def _record_throughput(self, stats: StepStats, step_gains: Mapping[float, float]) -> None:
        """Add the step to the sent CF's entry: system throughput * gain of what was sent."""
        cf = float(stats.sent_cf)
        t, n = float(stats.step_time_s), float(stats.samples)
        if not (math.isfinite(cf) and cf >= 1.0 and math.isfinite(t) and math.isfinite(n)):
            return
        if t <= 0.0 or n <= 0.0:
            return
        if cf == DENSE:
            gain = 1.0
        elif cf in step_gains:
            gain = step_gains[cf]
        else:
            smoothed = self._gains.get(cf)
            if smoothed is None:
                return
            gain = smoothed
        entry = self.s.throughput.setdefault(cf, _Throughput())
        entry.samples += n
        entry.time_s += t
        entry.gain_sum += gain
        entry.count += 1

    def end_window(self, step: int) -> None:
        """Step 4: settle, else raise the floor, step CF_s up, settle if exhausted."""
        s = self.s
        s.windows += 1
        ranked = self._ranked_throughput(step)
        if len(ranked) >= 2:
            (cf1, t1), (cf2, t2) = ranked[0], ranked[1]
            if t1 - t2 <= self._omega * t1:
                self._settle(min(cf1, cf2))
                return
        at_bound = s.candidate >= self._cf_max
        raised = False
        if s.candidate != s.floor:
            g_floor, g_cand = self._gains.get(s.floor), self._gains.get(s.candidate)
            if g_cand is None:
                return  # candidate not measured yet (observation lag > window): retry next window
            if g_floor is not None and abs(g_floor - g_cand) <= self._omega * g_floor:
                s.floor = s.candidate  # compressing further loses nothing extra: raise the floor
                raised = True
        grown = s.scale * s.scale if self._scaling == "exponential" else s.scale * 2.0
        s.scale = min(grown, max(self._cf_max, 2.0))  # beyond cf_max it changes nothing
        s.candidate = min(s.floor * s.scale, self._cf_max)
        if at_bound and not raised and ranked:
            self._settle(ranked[0][0])  # the candidate can move no further: take the best CF

    def _ranked_throughput(self, step: int) -> list[tuple[float, float]]:
        """Compressed CFs with enough steps, best compression throughput first (ties: lower CF)."""
        need = max(1, self._window_at(step) // 2)
        rows = [(cf, e.value) for cf, e in self.s.throughput.items() if cf != DENSE and e.count >= need]
        rows.sort(key=lambda r: (-r[1], r[0]))
        return rows

    def _settle(self, cf: float) -> None:
        s = self.s
        s.settled = True
        s.floor = s.candidate = cf

    # ------------------------------------------------------------------ telemetry and state
    @property
    def floor_cf(self) -> float:
        return self.s.floor

    @property
    def candidate_cf(self) -> float:
        return self.s.candidate

    @property
    def throughput(self) -> dict[float, float]:
        """Compression throughput per CF over all steps each CF was sent after warm-up (a copy)."""
        return {cf: e.value for cf, e in sorted(self.s.throughput.items())}

    def throughput_steps(self) -> dict[float, int]:
        return {cf: e.count for cf, e in sorted(self.s.throughput.items())}

    def to_state(self) -> dict[str, Any]:
        s = self.s
        return {"floor": s.floor, "scale": s.scale, "candidate": s.candidate, "window_step": s.window_step,
                "windows": s.windows, "settled": s.settled,
                "throughput": [[cf, e.samples, e.time_s, e.gain_sum, e.count]
                               for cf, e in sorted(s.throughput.items())]}

    def load(self, st: PaperState) -> None:
        self.s = st

    def check_state(self, state: Mapping[str, Any], read: Any) -> PaperState:
        """The saved fields as a state; ValueError for anything no run could have saved."""
        st = PaperState(floor=read.cf("floor", self._cf_max), scale=read.real("scale", 1.0),
                        candidate=read.cf("candidate", self._cf_max), window_step=read.count("window_step"),
                        windows=read.count("windows"), settled=read.flag("settled"))
        for row in read.rows("throughput", 5):
            cf, n, t, g, c = row
            if not (is_real(cf) and cf >= 1 and all(is_real(v) and finite_nonneg(v) for v in (n, t, g))
                    and isinstance(c, int) and not isinstance(c, bool) and c >= 0):
                raise ValueError(f"GravacPolicy state: bad throughput entry {row!r}")
            st.throughput[float(cf)] = _Throughput(float(n), float(t), float(g), int(c))
        return st
