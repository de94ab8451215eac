"""GraVAC compression-factor policy (Tyagi and Swany, IEEE CLOUD 2023, arXiv 2305.12201).

Pure Python, standard library only: plain numbers in, decisions out. The policy never touches a
tensor; the caller (``horovod_ext/torch_compression.py``, ``horovod_ext/tf_compression.py``, or the
simulator ``benchmarks/sim_gravac.py``) compresses, measures and reports global (all-rank) statistics.

Why the interface looks like this: in a data-parallel job every rank must take the same decision on
every step without extra communication. So :meth:`GravacPolicy.plan` is a pure function of the
observations fed in so far, and the caller feeds every rank the same *global* statistics (summed
across ranks inside the gradient payload, possibly one step late). Same observations in the same
order give the same plans on every rank. See ``docs/gravac.md``.

Per step::

    plan = policy.plan()                 # send_cf (1.0 = dense) and probe_cfs to measure
    ...compress with plan.send_cf, measure the norms of C_cf(g + e) for every cf in plan.probe_cfs...
    policy.observe(StepStats(sent_cf=plan.send_cf, dense_sq_norm=..., compressed_sq_norms={...},
                             step_time_s=..., samples=..., grad_sq_norm=..., grad_norm_sum=...,
                             dense_norm_sum=..., compressed_norm_sums={...}))

Two searches share the gain bookkeeping:

* ``search="ladder"`` (default): a short trial of each CF on a ladder (cf_max, cf_max / cf_step, ...,
  cf_min, dense), judged on compression throughput (samples/s x gain, as GraVAC) measured while that
  CF is actually sent, walking down while the next lower CF is within ``omega`` of the best (dense against
  cf_min: both timed in turn, the faster wins); then it settles, probes nothing beyond what it sends, and
  re-opens the search when the step time drifts or the sent CF's gain falls under ``epsilon``.
* ``search="paper"``: the paper's floor / candidate search (multi-level probes every step, CF_s
  growing each window, settle when the two best throughputs are within ``omega``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Union

from crossover.adaptive._state import check_saved_state

__all__ = ["GAINS", "SCALINGS", "SEARCHES", "GravacPolicy", "Plan", "StepStats"]

#: Decisions of the ladder (a search begins, a trial is judged, a CF is settled) are logged here: INFO for
#: searches and settling (a few per run), DEBUG for every judged trial. Every rank logs the same.
log = logging.getLogger("crossover.gravac")

#: Names accepted for ``scaling``: how the paper search's candidate step CF_s grows each window.
SCALINGS = ("exponential", "geometric")
#: Names accepted for ``gain``: how the compression gain of a CF is computed (docs/gravac.md).
GAINS = ("delivered", "authors", "norm")
#: Names accepted for ``search``.
SEARCHES = ("ladder", "paper")

_STATE_VERSION = 5
#: State versions :meth:`GravacPolicy.load_state_dict` still reads (3: no end-of-trial gain per timed CF;
#: 4: no tie-break between dense and cf_min).
_OLD_STATE_VERSIONS = (3, 4)
_DENSE = 1.0
_AUTO = "auto"
#: ``window="auto"``: a window is this fraction of the steps observed so far, within the bounds below.
AUTO_WINDOW_FRACTION = 0.02
AUTO_WINDOW_MIN = 4
AUTO_WINDOW_MAX = 500
#: Ladder search, settled: step-time drift is judged on the median of at least this many steps.
DRIFT_MIN_STEPS = 20
#: Ladder search: a drift re-open that settles back on the CF it left multiplies the wait before the next
#: one by this (one that moves doubles it).
FALSE_ALARM_GROWTH = 4
#: Ladder search: a walk up from a settled CF times each higher CF for at least this many steps.
WALK_UP_STEPS = 12
#: Ladder search: observations at the start of a trial that are not timed. A CF switch changes the
#: payload's shapes, and its first step renegotiates the collectives (often 1.2x to 1.5x a later step).
SWITCH_SKIP = 1
#: ... at the start of a run's first trial: the process's own warm-up (memory, first negotiations). Seen on
#: 4 ranks sharing 2 cores: 1.06 s, 0.30 s, 0.37 s, then 0.10 s; its median made CF 100 look as slow as CF
#: 10, and the run settled on CF 10 (2x slower steps).
FIRST_TRIAL_SKIP = 3
#: Ladder search: dense against the lowest compressed rung (cf_min) is a near-tie when their first windows put
#: their compression throughputs within (1 + omega) ** TIE_BAND of each other. It is then decided on pooled steps
#: of both, timed in alternating windows (``TIE_WINDOW`` steps or more): once each has ``TIE_EARLY`` timed steps
#: when they are apart by more than (1 + omega) ** 2, else at ``TIE_STEPS``. Windows of 4 steps cannot tell the
#: two apart on a busy machine: in run F the LSTM's dense stepped in 170 ms and CF 10 in 150 ms over whole runs,
#: yet dense's window came out within omega on all three seeds; in run G ResNet-18's dense window was 1.21x and
#: 1.30x CF 10's on two seeds, and the static runs put CF 10 12 % slower than dense.
TIE_BAND = 3
TIE_EARLY = 10
TIE_STEPS = 16
TIE_WINDOW = 6
#: Ladder search: a lower CF is skipped when predicted this many times beyond omega's allowance.
_SKIP_MARGIN = 2.0
#: ... dense when predicted this many times beyond it (the 1 / CF extrapolation overrates dense's time).
_DENSE_MARGIN = 4.0

Window = Union[int, str]


@dataclass(frozen=True)
class Plan:
    """What to do on one step; identical on every rank fed the same observations.

    ``send_cf``: compression factor to send (dense size / compressed size); 1.0 means dense.
    ``probe_cfs``: CFs whose norms ``||C_cf(g + e)||`` the caller must measure this step, ascending
    and without duplicates (multi-level: higher CFs compress the lowest one's selection further).
    Empty means "measure nothing": with a dense ``send_cf`` the caller can skip compression entirely.
    The paper search probes the floor CF_min and the candidate CF_min * CF_s; the ladder search
    probes only the CF it sends (free: the selection is made anyway), nothing while dense.
    """

    send_cf: float
    probe_cfs: tuple[float, ...]
    #: Report this step's statistics even when it is dense and probes nothing: the step time (and the
    #: step itself) must reach the policy. False lets the caller pass every tensor through untouched.
    measure: bool = False

    @property
    def dense(self) -> bool:
        """True when this step sends the uncompressed gradient."""
        return self.send_cf == _DENSE

    @property
    def floor_cf(self) -> float:
        """The lowest probed CF (the floor CF_min of the paper search); send_cf when nothing is probed."""
        return self.probe_cfs[0] if self.probe_cfs else self.send_cf

    @property
    def candidate_cf(self) -> float:
        """The highest probed CF (the candidate CF_min * CF_s; equals the floor when one CF is probed)."""
        return self.probe_cfs[-1] if self.probe_cfs else self.send_cf

    @property
    def cf_s(self) -> float:
        """Second-level factor: compress the floor-compressed tensor by this to get the candidate."""
        return self.candidate_cf / self.floor_cf


@dataclass(frozen=True)
class StepStats:
    """Global statistics of one step, identical on every rank (the caller reduces them).

    Every number is a sum over the step's compressed tensors and over ranks of a per-(tensor, rank)
    value; g is the raw local gradient, e the error-feedback residual, C_cf the compressor at cf.

    ``sent_cf``: the ``Plan.send_cf`` actually used on that step.
    ``dense_sq_norm``: sum of ``||g + e||^2``.
    ``compressed_sq_norms``: ``{cf: sum of ||C_cf(g + e)||^2}`` for the CFs in that step's
    ``Plan.probe_cfs`` (keys are those exact floats; extra or missing keys are allowed).
    ``step_time_s``: wall time of the step in seconds (averaged over ranks, communication included).
    ``samples``: samples processed by the step (global, summed over ranks).
    ``grad_sq_norm``: sum of ``||g||^2`` (no residual).
    ``grad_norm_sum``: sum of ``||g||`` (per-tensor L2 norms, as the GraVAC authors' code sums layers).
    ``dense_norm_sum``: sum of ``||g + e||``.
    ``compressed_norm_sums``: ``{cf: sum of ||C_cf(g + e)||}`` for the probed CFs.

    The last four were added later and default to "not measured" (NaN, empty): a gain definition
    that needs a missing number simply has no measurement on that step. Values that are not finite,
    or negative, are ignored by the policy (a NaN gradient on one step must not crash training); a
    zero denominator carries no gain information and is skipped. A step that measured nothing
    (dense, no probes) still counts: its time and samples feed the throughput.
    """

    sent_cf: float
    dense_sq_norm: float
    compressed_sq_norms: Mapping[float, float]
    step_time_s: float
    samples: float
    grad_sq_norm: float = math.nan
    grad_norm_sum: float = math.nan
    dense_norm_sum: float = math.nan
    compressed_norm_sums: Mapping[float, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Freeze private copies so a caller mutating its dict cannot change a recorded step.
        for name in ("compressed_sq_norms", "compressed_norm_sums"):
            frozen = MappingProxyType({float(k): float(v) for k, v in getattr(self, name).items()})
            object.__setattr__(self, name, frozen)


@dataclass
class _Gain:
    """Smoothed gain of one CF: ``value`` is what decisions read.

    ``norm`` smooths the per-step ratio (``value`` itself); ``authors`` and ``delivered`` smooth the
    numerator and the denominator separately (``num``, ``den``) and divide.
    """

    value: float
    count: int
    num: float = 0.0
    den: float = 0.0


@dataclass
class _Throughput:
    """Running totals for one sent CF: compression throughput = samples/s * mean gain (paper search)."""

    samples: float = 0.0
    time_s: float = 0.0
    gain_sum: float = 0.0
    count: int = 0

    @property
    def value(self) -> float:
        return (self.samples / self.time_s) * (self.gain_sum / self.count)


@dataclass
class _Trial:
    """Observations of the CF on trial (ladder search) during its current window."""

    cf: float
    times: list[float] = field(default_factory=list)
    samples: float = 0.0
    terms: list[list[float]] = field(default_factory=list)  # [numerator, denominator] per measured step

    def gain_terms(self) -> tuple[float, float] | None:
        """Summed gain terms of the second half of the window: the first steps after a switch still
        flush (or build) the previous CF's residual and measure the switch, not this CF."""
        return self._summed(len(self.terms) // 2)

    def end_gain_terms(self) -> tuple[float, float] | None:
        """Summed gain terms of the window's last quarter (at least its last 2 measured steps): where the gain
        had got to when the trial ended, while the residual of a higher CF was still building."""
        return self._summed(-max(2, len(self.terms) // 4))

    def _summed(self, start: int) -> tuple[float, float] | None:
        """Summed [numerator, denominator] of the measured steps from index ``start`` on; None if none."""
        if not self.terms:
            return None
        part = self.terms[start:]
        return sum(t[0] for t in part), sum(t[1] for t in part)


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
    # ladder search
    trial: _Trial | None = None
    direction: int = -1
    best: float | None = None
    best_rate: float = 0.0  # best compression throughput of the current search
    # cf -> [compression throughput, gain, median step time, samples per step, step judged, end gain]
    rates: dict[float, list[float]] = field(default_factory=dict)
    ref_time: float = 0.0  # step time of the settled CF: its trial's, then its first full drift window's
    ref_stale: bool = False  # ref_time still comes from the trial (re-based on the first drift window)
    reopen_at: int = 0  # no drift re-open before this step
    reopen_gap: int = 0  # wait after settling before a drift re-open; grows with every drift re-open
    drift_from: float | None = None  # the settled CF a drift re-open left (None: not a drift search)
    dense_after: int = 0  # dense is not timed again before this step (it lost clearly last time)
    recent: list[float] = field(default_factory=list)  # step times of the settled CF, newest last
    settled_gain_steps: int = 0
    retry_rung: float | None = None  # a higher CF that failed the gain test: tried again at retry_at
    retry_at: int = 0
    retry_gap: int = 0
    searches: int = 0
    search_step: int = 0  # observations when the current search began
    turn_down: bool = False  # an upward walk that stops at its first rung then walks down
    reason: str = ""
    trial_times: dict[float, list[float]] = field(default_factory=dict)  # timed steps of each CF's latest trial
    tie: dict[float, list[float]] | None = None  # dense vs cf_min, being decided: pooled timed steps of each


def _finite_nonneg(x: float) -> bool:
    return math.isfinite(x) and x >= 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


#: A step longer than this many times the median of the faster half of its window is a pause between steps
#: (an evaluation, a checkpoint, logging), not the step's own cost: step-time estimates leave it out.
PAUSE_FACTOR = 2.0


def _step_time(xs: list[float]) -> float:
    """Step time of a window: the median of its steps, leaving out pauses (``PAUSE_FACTOR``). The glue times
    a step from one first gradient to the next, so whatever the training loop does between steps lands in
    one step's time; in a 4-step trial one such step moves the plain median by a third."""
    s = sorted(xs)
    low = _median(s[:max(1, (len(s) + 1) // 2)])
    kept = [x for x in s if x <= PAUSE_FACTOR * low]
    return _median(kept)


class GravacPolicy:
    """GraVAC compression-factor search as a deterministic state machine.

    The decision for step t depends only on the observations fed before it, so ranks that feed the
    same global statistics in the same order make the same plans (no extra communication).

    Keyword-only parameters (defaults chosen by ``benchmarks/sim_gravac.py``, see docs/gravac.md):
      cf_min: lowest compressed CF, >= 1 (paper 10).
      cf_max: largest CF ever probed or sent, >= cf_min (paper 1000 to 2000).
      epsilon: gain a CF needs to be sent, in (0, 1] (paper 0.7 or 0.9; meaning depends on ``gain``).
      omega: relative tolerance, in [0, 1): a higher CF must beat a lower one's compression
        throughput by more than omega to be preferred, and a lower CF within omega of the best wins
        (paper 0.01, its authors' script 0.05); dense within omega of cf_min starts a longer timing of
        both in turn instead (``TIE_BAND``), and the faster wins. Default 0.1 (CF 1000, which omega 0.2
        once kept out, is off the default ladder: cf_max 100; docs/gravac.md).
      window: observations per decision, int >= 1, or "auto": 2% of the steps observed so far,
        at least 4 and at most 500 (a short run adapts within its first steps, a long one measures
        over longer windows).
      scaling: paper search: "exponential" (CF_s = 2, 4, 16, 256, ...) or "geometric" (2, 4, 8, ...).
      warmup_steps: first observed steps sent dense, int >= 0.
      ewma_alpha: weight of the newest value in the gain EWMAs, in (0, 1].
      gain: "delivered", "authors" or "norm" (docs/gravac.md has the formulas).
      search: "ladder" or "paper".
      cf_step: ladder search: ratio between neighbouring CFs of the ladder, > 1.
      reopen_drift: ladder search: once settled, a median step time that moved by more than this
        factor (relative) from the one measured when settling re-opens the search; 0 disables.
    """

    def __init__(
        self,
        *,
        cf_min: float = 10.0,
        cf_max: float = 100.0,
        epsilon: float = 0.5,
        omega: float = 0.1,
        window: Window = _AUTO,
        scaling: str = "exponential",
        warmup_steps: int = 0,
        ewma_alpha: float = 0.1,
        gain: str = "delivered",
        search: str = "ladder",
        cf_step: float = 10.0,
        reopen_drift: float = 0.25,
        start_cf: float | None = None,
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
        if window != _AUTO and (not _is_int(window) or window < 1):
            raise ValueError(f"window must be an int >= 1 or 'auto', got {window!r}")
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}; got {scaling!r}")
        if not _is_int(warmup_steps) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not _is_real(ewma_alpha) or not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha!r}")
        if gain not in GAINS:
            raise ValueError(f"gain must be one of {', '.join(GAINS)}; got {gain!r}")
        if search not in SEARCHES:
            raise ValueError(f"search must be one of {', '.join(SEARCHES)}; got {search!r}")
        if not _is_real(cf_step) or cf_step <= 1.0:
            raise ValueError(f"cf_step must be a finite number > 1, got {cf_step!r}")
        if not _is_real(reopen_drift) or reopen_drift < 0.0:
            raise ValueError(f"reopen_drift must be a finite number >= 0, got {reopen_drift!r}")
        if start_cf is not None and (not _is_real(start_cf) or not cf_min <= start_cf <= cf_max):
            raise ValueError(f"start_cf must be None or a number in [cf_min, cf_max], got {start_cf!r}")
        self._cf_min0 = float(cf_min)
        self._cf_max = float(cf_max)
        self._epsilon = float(epsilon)
        self._omega = float(omega)
        self._window: Window = window
        self._scaling = scaling
        self._warmup = warmup_steps
        self._alpha = float(ewma_alpha)
        self._gain = gain
        self._search_kind = search
        self._cf_step = float(cf_step)
        self._drift = float(reopen_drift)
        self._start_cf = None if start_cf is None else float(start_cf)
        self._rungs = self._ladder()
        self._s = self._initial_state()
        if search == "ladder" and warmup_steps == 0:
            self._first_search()

    def _start_rung(self) -> int:
        """Index of the rung the first search tries: the top, or the highest rung <= start_cf."""
        if self._start_cf is None:
            return len(self._rungs) - 1
        return max(i for i, cf in enumerate(self._rungs) if cf <= self._start_cf * (1.0 + 1e-9))

    def _first_search(self) -> None:
        """From the top of the ladder: walk down. From a middle rung: walk up first, then down."""
        i = self._start_rung()
        if i == len(self._rungs) - 1:
            self._start_search(i, -1, why="first search, from the top")
        else:
            self._start_search(i, +1, turn_down=True, why="first search, from start_cf")

    def _ladder(self) -> tuple[float, ...]:
        """Dense, then cf_min * cf_step^i below cf_max, then cf_max (ascending)."""
        rungs = [_DENSE]
        cf = self._cf_min0
        while cf < self._cf_max * (1.0 - 1e-9):
            if cf > _DENSE:
                rungs.append(cf)
            cf *= self._cf_step
        if self._cf_max > _DENSE:
            rungs.append(self._cf_max)
        return tuple(rungs)

    def _initial_state(self) -> _State:
        floor = self._cf_min0
        s = _State(floor=floor, scale=2.0, candidate=min(floor * 2.0, self._cf_max))
        if self._search_kind == "ladder":
            s.floor = s.candidate = self._rungs[-1]
        return s

    # ------------------------------------------------------------------ windows
    def window_at(self, step: int) -> int:
        """Window length (observations) for a window starting after ``step`` observations."""
        if self._window != _AUTO:
            return int(self._window)
        return max(AUTO_WINDOW_MIN, min(AUTO_WINDOW_MAX, int(step * AUTO_WINDOW_FRACTION)))

    # ------------------------------------------------------------------ decisions
    def plan(self) -> Plan:
        """Decision for the next step; pure (no side effects), same result until observe()."""
        s = self._s
        if self._search_kind == "paper":
            probes = (s.floor,) if s.candidate == s.floor else (s.floor, s.candidate)
            if s.step < self._warmup:
                return Plan(send_cf=_DENSE, probe_cfs=probes)
            return Plan(send_cf=self._choose(), probe_cfs=probes)
        # The ladder counts its windows, retries and drift in observed steps: a dense step must be
        # observed too (warm-up, dense on trial, settled on dense), so it always asks to be measured.
        if s.step < self._warmup:
            return Plan(send_cf=_DENSE, probe_cfs=(), measure=True)
        cf = s.trial.cf if s.trial is not None else s.floor
        return Plan(send_cf=cf, probe_cfs=(cf,) if cf > _DENSE else (), measure=True)

    def _choose(self) -> float:
        """Paper search: candidate if its gain >= epsilon, else the floor if so, else dense."""
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
            if s.step == self._warmup and self._search_kind == "ladder":
                self._first_search()
            return  # warm-up: gains only, no throughput and no search
        if self._search_kind == "paper":
            self._observe_paper(stats, step_gains)
        else:
            self._observe_ladder(stats)

    @property
    def needs_grad_norms(self) -> bool:
        """Whether the gain reads the raw gradient's norm (``grad_sq_norm``, ``grad_norm_sum``): the
        caller then measures ``||g||`` apart from ``||g + e||`` (one more read pass per tensor)."""
        return self._gain in ("delivered", "authors")

    # ------------------------------------------------------------------ gains
    def _step_terms(self, stats: StepStats, cf: float) -> tuple[float, float] | None:
        """(numerator, denominator) of this step's gain of ``cf`` under the configured definition."""
        if self._gain == "norm":
            num, den = stats.compressed_sq_norms.get(cf), stats.dense_sq_norm
        elif self._gain == "authors":
            num, den = stats.compressed_norm_sums.get(cf), stats.grad_norm_sum
        else:
            num, den = stats.compressed_sq_norms.get(cf), stats.grad_sq_norm
        if num is None or not (_finite_nonneg(num) and _finite_nonneg(den) and den > 0.0):
            return None
        return float(num), float(den)

    def _ratio(self, num: float, den: float) -> float:
        """Gain from (possibly summed or smoothed) numerator and denominator."""
        if self._gain == "authors":
            return num / den  # the authors' ratio of summed norms: may exceed 1
        return min(1.0, math.sqrt(num / den))

    def _update_gains(self, stats: StepStats) -> dict[float, float]:
        """Update the smoothed gain of every probed CF; return this step's raw gains."""
        measured: dict[float, float] = {}
        keys = set(stats.compressed_sq_norms) | set(stats.compressed_norm_sums)
        for cf in sorted(keys):
            if not (math.isfinite(cf) and cf >= 1.0):
                continue
            terms = self._step_terms(stats, cf)
            if terms is None:
                continue
            num, den = terms
            gain = self._ratio(num, den)
            measured[cf] = gain
            old = self._s.gains.get(cf)
            if old is None:
                self._s.gains[cf] = _Gain(value=gain, count=1, num=num, den=den)
                continue
            a = self._alpha
            old.count += 1
            if self._gain == "norm":
                old.value += a * (gain - old.value)
            else:
                old.num += a * (num - old.num)
                old.den += a * (den - old.den)
                old.value = self._ratio(old.num, old.den)
        return measured

    # ------------------------------------------------------------------ paper search
    def _observe_paper(self, stats: StepStats, step_gains: Mapping[float, float]) -> None:
        s = self._s
        self._record_throughput(stats, step_gains)
        if s.settled:
            return
        s.window_step += 1
        if s.window_step >= self.window_at(s.step - s.window_step):
            s.window_step = 0
            self._search_paper()

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

    def _search_paper(self) -> None:
        """One window decision: settle, else raise the floor, step CF_s up, settle if exhausted."""
        s = self._s
        s.windows += 1
        ranked = self._ranked_throughput()
        if len(ranked) >= 2:
            (cf1, t1), (cf2, t2) = ranked[0], ranked[1]
            if t1 - t2 <= self._omega * t1:
                self._settle_paper(min(cf1, cf2))
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
            self._settle_paper(ranked[0][0])  # the candidate can move no further: take the best CF

    def _ranked_throughput(self) -> list[tuple[float, float]]:
        """Compressed CFs with enough steps, best compression throughput first (ties: lower CF)."""
        need = max(1, self.window_at(self._s.step) // 2)
        rows = [(cf, e.value) for cf, e in self._s.throughput.items() if cf != _DENSE and e.count >= need]
        rows.sort(key=lambda r: (-r[1], r[0]))
        return rows

    def _settle_paper(self, cf: float) -> None:
        s = self._s
        s.settled = True
        s.floor = s.candidate = cf

    # ------------------------------------------------------------------ ladder search
    def _start_search(self, rung: int, direction: int, best: float | None = None, best_rate: float = 0.0,
                      turn_down: bool = False, keep_times: bool = False, why: str = "") -> None:
        """Begin a search: try ``self._rungs[rung]``, then walk in ``direction`` (-1 down, +1 up); with
        ``turn_down``, an upward walk that stops at its first rung continues downward from there; with
        ``keep_times``, step times of the previous search still count for predictions (nothing changed
        but a gain)."""
        s = self._s
        s.settled = False
        s.direction = direction
        s.turn_down = turn_down
        s.best = best
        s.best_rate = best_rate
        s.searches += 1
        if not keep_times:
            s.search_step = s.step
        s.recent = []
        s.trial_times = {}
        s.tie = None
        log.info("crossover.gravac: step %d: search %d (%s): trying CF %g, walking %s", s.step, s.searches, why,
                 self._rungs[rung], "down" if direction < 0 else "up")
        self._try(self._rungs[rung])

    def _try(self, cf: float) -> None:
        s = self._s
        s.trial = _Trial(cf=cf)
        s.candidate = cf
        s.floor = s.best if s.best is not None else cf

    def _observe_ladder(self, stats: StepStats) -> None:
        s = self._s
        cf, t, n = float(stats.sent_cf), float(stats.step_time_s), float(stats.samples)
        if not (math.isfinite(t) and t > 0.0 and math.isfinite(n) and n > 0.0):
            return
        if s.trial is not None:
            tr = s.trial
            if cf != tr.cf:
                return  # a late observation of a step sent before this trial began
            tr.times.append(t)
            tr.samples += n
            terms = self._step_terms(stats, cf) if cf > _DENSE else None
            if terms is not None:
                tr.terms.append([terms[0], terms[1]])
            timed = len(tr.times) - self._skip()
            if timed >= self._trial_length(s.step - len(tr.times)) or self._losing(tr):
                s.windows += 1
                self._judge(tr)
            return
        if cf != s.floor:
            return
        w = self.window_at(s.step)
        dw = max(w, DRIFT_MIN_STEPS)
        s.recent.append(t)
        del s.recent[:-dw]
        if s.floor > _DENSE:
            s.settled_gain_steps += 1
            g = s.gains.get(s.floor)
            if g is not None and s.settled_gain_steps >= w and g.value < self._epsilon:
                self._note_gain_failure(s.floor)
                self._start_search(self._rungs.index(s.floor) - 1, -1, keep_times=True,  # walk down from below
                                   why=f"CF {s.floor:g}'s gain {g.value:.2f} fell under epsilon {self._epsilon:g}")
                return
        if s.retry_rung is not None and s.step >= s.retry_at:
            self._retry()
            return
        if self._drift > 0.0 and len(s.recent) >= dw:
            med = _step_time(s.recent)
            if s.ref_stale:
                # A trial's few steps are a noisy reference: the settled CF's own first full window is it.
                s.ref_time, s.ref_stale = med, False
            elif s.step >= s.reopen_at and (med > s.ref_time * (1.0 + self._drift)
                                            or med * (1.0 + self._drift) < s.ref_time):
                self._drift_search(med, slower=med > s.ref_time)

    def _skip(self) -> int:
        """Observations at the start of the current trial that its timing leaves out (``SWITCH_SKIP``,
        ``FIRST_TRIAL_SKIP`` for the run's first trial: no trial judged yet)."""
        return FIRST_TRIAL_SKIP if self._s.windows == 0 else SWITCH_SKIP

    def _timed(self, tr: _Trial) -> list[float]:
        """The trial's step times that count."""
        return tr.times[self._skip():]

    def _trial_length(self, start: int) -> int:
        """Steps a trial runs (unless it is clearly losing): a window; a walk up (a retry, or a check after
        the step time drifted) at least ``WALK_UP_STEPS``: it must beat the settled CF by more than omega,
        and a few steps' median on a busy machine can do that by chance (a higher CF loses information)."""
        w = self.window_at(start)
        if self._s.tie is not None:
            return max(w, TIE_WINDOW)
        return max(w, WALK_UP_STEPS) if self._s.direction > 0 and self._s.best is not None else w

    def _losing(self, tr: _Trial) -> bool:
        """True when the CF on trial is already far behind the best of the search: its median step time
        over the shortest window gives a system throughput short of the best compression throughput by
        more than ``_SKIP_MARGIN`` times omega's allowance (its gain could only lower it further). A
        wrong rung then costs a few steps, not a whole window (a dense window on a slow link is long)."""
        s = self._s
        times = self._timed(tr)
        if s.best is None or s.tie is not None or len(times) < 2:
            return False
        rate = tr.samples / len(tr.times) / _step_time(times)
        if s.drift_from is not None and s.direction < 0:
            # A drift check downward must find a CF at least as fast as the settled one is now (best_rate
            # is that throughput x (1 + omega)): two steps slower by more than omega end it.
            return rate * (1.0 + self._omega) ** 2 < s.best_rate
        # two steps suffice when it is more than twice that far behind (dense on a slow link)
        margin = _SKIP_MARGIN * (1.0 if len(times) >= AUTO_WINDOW_MIN else 2.0)
        return rate * margin * (1.0 + self._omega) < s.best_rate

    def _drift_search(self, med: float, slower: bool) -> None:
        """The settled CF's step time moved: check the neighbour the change favours, walking on from it
        while each next CF beats the settled one's current throughput (up: by more than omega; down: at
        all, not merely within omega as in a first search: a few fast steps of a noisy machine then
        cannot walk the run down to a CF that is slower in fact). Slower steps (the link or the load got
        worse) favour more compression, faster steps less. A false alarm costs one short trial of a
        neighbour, not a whole search."""
        s = self._s
        cf = s.floor
        i = self._rungs.index(cf)
        rate = self._rate_now(cf, med)
        s.drift_from = cf
        nxt = i + 1 if slower else i - 1
        if 0 <= nxt < len(self._rungs):
            if slower:
                s.retry_rung = None  # the walk up tries the CFs above anyway
            self._start_search(nxt, +1 if slower else -1, best=cf,
                               best_rate=rate if slower else rate * (1.0 + self._omega),
                               why=f"CF {cf:g}'s step time moved from {1e3 * s.ref_time:.1f} to {1e3 * med:.1f} ms")
        else:  # nothing in that direction: the new step time is the reference
            self._settle(cf, med)

    def _judge(self, tr: _Trial) -> None:
        """End of a trial window: keep walking, or settle on the best CF of this search."""
        s = self._s
        step_time = _step_time(self._timed(tr))
        per_step = tr.samples / len(tr.times)
        terms = tr.gain_terms() if tr.cf > _DENSE else None
        gain = self._ratio(*terms) if terms is not None else None
        end_terms = tr.end_gain_terms() if tr.cf > _DENSE else None
        end_gain = self._ratio(*end_terms) if end_terms is not None else gain
        passes = gain is None or gain >= self._epsilon
        rate = per_step / step_time * (1.0 if gain is None else min(1.0, gain))
        s.rates[tr.cf] = [rate, 1.0 if tr.cf == _DENSE else (math.nan if gain is None else gain), step_time,
                          per_step, float(s.step),
                          1.0 if tr.cf == _DENSE else (math.nan if end_gain is None else end_gain)]
        log.debug("crossover.gravac: step %d: CF %g judged on %d steps: median %.1f ms, gain %s, %.1f samples/s "
                  "(best so far: %s)", s.step, tr.cf, len(self._timed(tr)), 1e3 * step_time,
                  "-" if gain is None else f"{gain:.2f}", rate,
                  "none" if s.best is None else f"CF {s.best:g} at {s.best_rate:.1f}")
        s.trial_times[tr.cf] = self._timed(tr)
        if s.tie is not None:
            self._tie_window(tr.cf, passes)
            return
        i = self._rungs.index(tr.cf)
        if tr.cf == _DENSE and rate * _SKIP_MARGIN * (1.0 + self._omega) < s.best_rate:
            # Dense lost clearly: do not time it again before the run has doubled (O(log steps) trials).
            s.dense_after = s.step + max(DRIFT_MIN_STEPS, s.step)
        if not passes:
            self._note_gain_failure(tr.cf)
        if s.direction < 0:
            if passes and self._near_tie(tr.cf, rate):
                self._start_tie()
                return
            # walking down: a lower CF within omega of the best compression throughput is preferred
            if passes and (s.best is None or rate * (1.0 + self._omega) >= s.best_rate):
                s.best = tr.cf
                s.best_rate = max(s.best_rate, rate)
                if i > 0 and not self._hopeless(i - 1):
                    self._try(self._rungs[i - 1])
                else:
                    self._settle(tr.cf, step_time)
            elif s.best is None:
                self._try(self._rungs[i - 1])  # failed the gain test, nothing chosen yet: look lower
            elif i > 0 and not self._hopeless(0):
                # A lower CF lost, but maybe to its compression cost, which dense does not pay: time
                # dense too, unless the CFs measured so far put it far out of reach.
                self._try(_DENSE)
            else:
                self._settle(s.best, s.rates[s.best][2])
            return
        # walking up: a higher CF must beat the best by more than omega
        if passes and (s.best is None or rate > s.best_rate * (1.0 + self._omega)):
            first = s.best is None
            s.best, s.best_rate = tr.cf, max(s.best_rate, rate)
            s.turn_down = s.turn_down and first  # once the walk up has moved, it never turns down
            if i + 1 < len(self._rungs):
                self._try(self._rungs[i + 1])
                return
            if not s.turn_down:
                self._settle(tr.cf, step_time)
                return
        elif s.best is not None and not (s.turn_down and self._rungs.index(s.best) == i - 1):
            self._settle(s.best, s.rates[s.best][2])  # the walk up stopped after moving: settle there
            return
        # the first rung did not beat what is below it: walk down from there, as from the top
        s.direction, s.turn_down = -1, False
        j = self._rungs.index(s.best) if s.best is not None else i
        if j > 0 and not self._hopeless(j - 1):
            self._try(self._rungs[j - 1])
        elif s.best is not None:
            self._settle(s.best, s.rates[s.best][2])
        else:
            self._try(self._rungs[j - 1])

    def _near_tie(self, cf: float, rate: float) -> bool:
        """Whether dense, judged at ``rate`` walking down, is in a near-tie with the best CF of the search, cf_min:
        their compression throughputs within (1 + omega) ** ``TIE_BAND`` of each other.

        Among compressed CFs a lower one within omega is preferred (a higher CF loses information that its gain
        does not show as accuracy: CF 1000, "Why cf_max is 100" in docs/gravac.md). Between dense and cf_min
        that preference is not applied: top-k 10x reached dense's accuracy on every workload of the matrix, and
        a dense that is slower by up to omega on every step costs up to omega of the run's time (the LSTM of run
        F: 1.13x). The faster of the two wins, timed long enough to tell (``TIE_EARLY``, ``TIE_STEPS``)."""
        s = self._s
        if cf != _DENSE or s.drift_from is not None or len(self._rungs) < 2 or s.best != self._rungs[1]:
            return False
        band = (1.0 + self._omega) ** TIE_BAND
        return s.rates[s.best][0] / band <= rate <= s.rates[s.best][0] * band

    def _start_tie(self) -> None:
        """Decide dense against cf_min on pooled steps: alternate windows of each, cf_min's first."""
        s = self._s
        assert s.best is not None
        s.tie = {_DENSE: list(s.trial_times.get(_DENSE, [])), s.best: list(s.trial_times.get(s.best, []))}
        log.info("crossover.gravac: step %d: dense and CF %g are close: timing both in turn", s.step, s.best)
        self._try(s.best)

    def _tie_window(self, cf: float, passes: bool) -> None:
        """A window of the tie-break ended: alternate, or settle on the faster once both have ``TIE_STEPS`` timed
        steps (``TIE_EARLY`` when they are apart by more than (1 + omega) ** 2)."""
        s = self._s
        assert s.tie is not None and s.best is not None
        low = s.best
        s.tie[cf].extend(s.trial_times[cf])
        if not passes:  # cf_min failed the gain test: dense
            self._note_gain_failure(cf)
            self._end_tie(_DENSE)
            return
        pooled = min(len(t) for t in s.tie.values())
        step_times = {c: _step_time(times) for c, times in s.tie.items()}
        rates = {}
        for c, t in step_times.items():
            r = s.rates[c]
            gain = 1.0 if c == _DENSE or not math.isfinite(r[1]) else min(1.0, r[1])
            rates[c] = r[3] / t * gain
        apart = max(rates.values()) > min(rates.values()) * (1.0 + self._omega) ** 2
        if pooled < TIE_STEPS and not (pooled >= TIE_EARLY and apart):
            self._try(low if cf == _DENSE else _DENSE)
            return
        for c, t in step_times.items():
            s.rates[c][2], s.rates[c][0] = t, rates[c]
        log.info("crossover.gravac: step %d: dense %.1f ms vs CF %g %.1f ms over %d and %d steps", s.step,
                 1e3 * s.rates[_DENSE][2], low, 1e3 * s.rates[low][2], len(s.tie[_DENSE]), len(s.tie[low]))
        self._end_tie(low if rates[low] > rates[_DENSE] else _DENSE)

    def _end_tie(self, cf: float) -> None:
        s = self._s
        s.tie = None
        s.best = cf
        s.best_rate = s.rates[cf][0]
        self._settle(cf, s.rates[cf][2])

    def _hopeless(self, rung: int) -> bool:
        """True when CFs timed in this search predict ``rung`` far too slow to be worth a trial.

        Communication time scales as 1 / CF, so two measured step times T(a) and T(b) give
        T(cf) ~ T(a) + slope * (1 / cf - 1 / a). A CF predicted to fall short of the best compression
        throughput by more than ``_SKIP_MARGIN`` times omega's allowance is not tried: on a slow link a
        window at CF 10 or dense can cost more than the whole search saves.

        A lower CF is predicted from the two nearest CFs above it. Dense differs: it pays no compression
        cost, and an allgathered sparse payload costs more per element than a dense allreduce, so the
        extrapolation overrates dense's time: dense is skipped only beyond ``_DENSE_MARGIN``. Where the
        step time does not fall with the CF (a fast link, a compute-bound model) the slope is about zero
        and dense is timed. (Judging the link by the two *highest* CFs instead, as before, timed dense on
        every drift check at 100 Mbit/s: CF 1000 was no faster than CF 100 there, yet dense was 12x
        slower than CF 100, as CF 10 vs CF 100 predicts.)
        """
        s = self._s
        timed = [cf for cf in self._rungs[rung + 1:] if cf in s.rates and s.rates[cf][4] >= s.search_step]
        if rung == 0 and s.step < s.dense_after:
            return True  # dense lost clearly not long ago
        if rung == 0 and len(timed) < 2:  # a short search (after a drift): the latest times of every CF
            timed = [cf for cf in self._rungs[1:] if cf in s.rates]
        if len(timed) < 2:
            return False
        a, b = timed[:2]
        ra, rb = s.rates[a], s.rates[b]
        slope = (ra[2] - rb[2]) / (1.0 / a - 1.0 / b)
        if not slope > 0.0:
            return False
        predicted = ra[2] + slope * (1.0 / self._rungs[rung] - 1.0 / a)
        margin = _DENSE_MARGIN if rung == 0 else _SKIP_MARGIN
        return ra[3] / predicted * margin * (1.0 + self._omega) < s.best_rate

    def _note_gain_failure(self, cf: float) -> None:
        """A CF failed the gain test: if the search settles below it, try it again later."""
        s = self._s
        if s.retry_rung is None or cf < s.retry_rung:
            s.retry_rung = cf

    def _settle(self, cf: float, step_time: float) -> None:
        s = self._s
        log.info("crossover.gravac: step %d: settled on CF %g (median step %.1f ms)", s.step, cf, 1e3 * step_time)
        s.trial = None
        s.settled = True
        s.floor = s.candidate = cf
        s.ref_time, s.ref_stale = step_time, True
        s.recent = []
        s.settled_gain_steps = 0
        if s.drift_from is not None:
            # Each drift re-open doubles the wait before the next one, a false alarm (back where it
            # started) quadruples it: on a noisy, shared machine 20-step medians of a fixed CF move by
            # more than 25 % in 15 % to 60 % of windows (benchmarks, 2 cores), so false alarms must cost
            # O(log steps) searches; a real change of the link is still seen within a few times as many
            # steps as the run has had since the previous one.
            grow = FALSE_ALARM_GROWTH if cf == s.drift_from else 2
            s.reopen_gap = max(DRIFT_MIN_STEPS, grow * s.reopen_gap)
            s.drift_from = None
        s.reopen_at = s.step + s.reopen_gap
        # A higher CF timed in this search that lost only through its gain deficit may keep up once its
        # residual has built: retry it too, if the gain it had reached by the end of its trial (the residual
        # still building) would have won. A CF that loses even at that gain is in a near-tie at best: its
        # retries (a walk-up trial each, from the lower CF's residual) cost more than the tie can return.
        best = s.rates[cf][0] if cf in s.rates else s.best_rate
        for hi, r in sorted(s.rates.items()):
            if hi > cf and r[4] >= s.search_step and r[1] < 1.0 and self._may_keep_up(r, best):
                self._note_gain_failure(hi)
                break
        if s.retry_rung is not None and s.retry_rung <= cf:
            s.retry_rung = None
        s.reason = "gain" if s.retry_rung is not None else "time"
        if s.retry_rung is not None:  # doubling gaps: a CF that keeps failing costs O(log steps) trials
            s.retry_gap = max(2 * self.window_at(s.step), 2 * s.retry_gap, s.step // 2)
            s.retry_at = s.step + s.retry_gap

    def _may_keep_up(self, r: list[float], best: float) -> bool:
        """Whether a CF timed at ``r`` (a ``rates`` row) that lost on its gain would beat ``best`` by more than
        omega at the gain it had reached by the end of its trial (a gain above 1 counts as 1)."""
        end_gain = r[5]
        return math.isfinite(end_gain) and r[3] / r[2] * min(1.0, end_gain) > best * (1.0 + self._omega)

    def _rate_now(self, cf: float, step_time: float) -> float:
        """Compression throughput of the settled CF at ``step_time``: samples per step (from its trial; 1 if
        never tried) / step time x its smoothed gain (1 for dense or while unmeasured)."""
        s = self._s
        g = s.gains.get(cf)
        factor = 1.0 if cf == _DENSE or g is None else min(1.0, g.value)
        per_step = s.rates[cf][3] if cf in s.rates else 1.0
        return per_step / step_time * factor

    def _retry(self) -> None:
        """Try the CF above the settled one again (it failed the gain test before), walking up."""
        s = self._s
        cf = s.floor
        i = self._rungs.index(cf)
        rate = s.rates[cf][0] if cf in s.rates else 0.0
        if cf in s.rates and s.recent:
            rate = self._rate_now(cf, _step_time(s.recent))
        s.retry_rung = None
        if i + 1 < len(self._rungs):
            self._start_search(i + 1, +1, best=cf, best_rate=rate,
                               why=f"CF {self._rungs[i + 1]:g} lost on its gain earlier, not on step time: retrying it")

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
        """Paper search: current floor CF_min. Ladder: the best CF of the search so far (the settled CF)."""
        return self._s.floor

    @property
    def candidate_cf(self) -> float:
        """Paper search: candidate CF_min * CF_s. Ladder: the CF on trial (the settled CF once settled)."""
        return self._s.candidate

    @property
    def cf_s(self) -> float:
        """Candidate / floor (the paper's effective CF_s after the cf_max bound)."""
        return self._s.candidate / self._s.floor

    @property
    def floor_gain(self) -> float | None:
        """Smoothed gain of the floor CF, None before it was measured."""
        g = self._s.gains.get(self._s.floor)
        return None if g is None else g.value

    @property
    def candidate_gain(self) -> float | None:
        """Smoothed gain of the candidate CF, None before it was measured."""
        g = self._s.gains.get(self._s.candidate)
        return None if g is None else g.value

    @property
    def gains(self) -> dict[float, float]:
        """Smoothed gain of every CF ever probed (a copy)."""
        return {cf: g.value for cf, g in sorted(self._s.gains.items())}

    @property
    def settled(self) -> bool:
        """True while the search is stopped; floor and candidate are then the settled CF."""
        return self._s.settled

    @property
    def throughput(self) -> dict[float, float]:
        """Compression throughput (samples/s * gain) per CF: paper search over all steps each CF was
        sent after warm-up; ladder search from each CF's latest trial window (a copy)."""
        if self._search_kind == "paper":
            return {cf: e.value for cf, e in sorted(self._s.throughput.items())}
        return {cf: r[0] for cf, r in sorted(self._s.rates.items())}

    @property
    def ladder(self) -> tuple[float, ...]:
        """The CFs the ladder search can send, ascending (1.0 = dense)."""
        return self._rungs

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
            "gain": self._gain,
            "search": self._search_kind,
            "cf_step": self._cf_step,
            "reopen_drift": self._drift,
            "start_cf": self._start_cf,
        }

    def summary(self) -> dict[str, Any]:
        """Read-only snapshot for telemetry (plain values; float dict keys are CFs)."""
        s = self._s
        out = {
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
            "window_step": s.window_step if self._search_kind == "paper" else (
                len(s.trial.times) if s.trial is not None else 0),
            "gains": self.gains,
            "throughput": self.throughput,
            "throughput_steps": {cf: e.count for cf, e in sorted(s.throughput.items())},
            "search": self._search_kind,
        }
        if self._search_kind == "ladder":
            out.update({
                "trial_cf": s.trial.cf if s.trial is not None else None,
                "searches": s.searches,
                "settled_reason": s.reason if s.settled else None,
                "reference_step_time_s": s.ref_time if s.settled else None,
                "retry_cf": s.retry_rung,
                "retry_at_step": s.retry_at if s.retry_rung is not None else None,
            })
        return out

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Full state as JSON-serialisable plain values (lists instead of float-keyed dicts)."""
        s = self._s
        tr = s.trial
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
            "gains": [[cf, g.value, g.count, g.num, g.den] for cf, g in sorted(s.gains.items())],
            "throughput": [
                [cf, e.samples, e.time_s, e.gain_sum, e.count] for cf, e in sorted(s.throughput.items())
            ],
            "trial": None if tr is None else [tr.cf, list(tr.times), tr.samples, [list(t) for t in tr.terms]],
            "direction": s.direction,
            "best": s.best,
            "best_rate": s.best_rate,
            "rates": [[cf, *r] for cf, r in sorted(s.rates.items())],
            "ref_time": s.ref_time,
            "ref_stale": s.ref_stale,
            "reopen_at": s.reopen_at,
            "reopen_gap": s.reopen_gap,
            "drift_from": s.drift_from,
            "dense_after": s.dense_after,
            "recent": list(s.recent),
            "settled_gain_steps": s.settled_gain_steps,
            "retry_rung": s.retry_rung,
            "retry_at": s.retry_at,
            "retry_gap": s.retry_gap,
            "searches": s.searches,
            "search_step": s.search_step,
            "turn_down": s.turn_down,
            "reason": s.reason,
            "trial_times": [[cf, list(t)] for cf, t in sorted(s.trial_times.items())],
            "tie": None if s.tie is None else [[cf, list(t)] for cf, t in sorted(s.tie.items())],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the saved config must equal this policy's config."""
        if state.get("version") in _OLD_STATE_VERSIONS:
            # version 3 kept no end-of-trial gain: its gain over the window's second half stands in; versions 3
            # and 4 kept no trial times and had no tie-break
            state = {"trial_times": [], "tie": None, **state, "version": _STATE_VERSION,
                     "rates": [[*r, r[2]] if len(r) == 6 else r for r in state["rates"]]}
        check_saved_state("GravacPolicy", state, _STATE_VERSION, self.config)
        tr = state["trial"]
        st = _State(
            floor=float(state["floor"]),
            scale=float(state["scale"]),
            candidate=float(state["candidate"]),
            step=int(state["step"]),
            window_step=int(state["window_step"]),
            windows=int(state["windows"]),
            settled=bool(state["settled"]),
            gains={float(cf): _Gain(float(v), int(n), float(a), float(b)) for cf, v, n, a, b in state["gains"]},
            throughput={
                float(cf): _Throughput(float(n), float(t), float(g), int(c))
                for cf, n, t, g, c in state["throughput"]
            },
            trial=None if tr is None else _Trial(float(tr[0]), [float(x) for x in tr[1]], float(tr[2]),
                                                 [[float(a), float(b)] for a, b in tr[3]]),
            direction=int(state["direction"]),
            best=None if state["best"] is None else float(state["best"]),
            best_rate=float(state["best_rate"]),
            rates={float(r[0]): [float(x) for x in r[1:]] for r in state["rates"]},
            ref_time=float(state["ref_time"]),
            ref_stale=bool(state["ref_stale"]),
            reopen_at=int(state["reopen_at"]),
            reopen_gap=int(state["reopen_gap"]),
            drift_from=None if state["drift_from"] is None else float(state["drift_from"]),
            dense_after=int(state["dense_after"]),
            recent=[float(x) for x in state["recent"]],
            settled_gain_steps=int(state["settled_gain_steps"]),
            retry_rung=None if state["retry_rung"] is None else float(state["retry_rung"]),
            retry_at=int(state["retry_at"]),
            retry_gap=int(state["retry_gap"]),
            searches=int(state["searches"]),
            search_step=int(state["search_step"]),
            turn_down=bool(state["turn_down"]),
            reason=str(state["reason"]),
            trial_times={float(cf): [float(x) for x in t] for cf, t in state["trial_times"]},
            tie=None if state["tie"] is None else {float(cf): [float(x) for x in t] for cf, t in state["tie"]},
        )
        self._check_state(st)
        self._s = st

    def _check_state(self, s: _State) -> None:
        """Raise ValueError for a loaded state no run of this policy could reach (nothing is applied)."""
        if not (_is_real(s.floor) and 1.0 <= s.floor <= self._cf_max):
            raise ValueError(f"GravacPolicy state: floor {s.floor!r} outside [1, cf_max={self._cf_max:g}]")
        if not (_is_real(s.candidate) and 1.0 <= s.candidate <= self._cf_max):
            raise ValueError(f"GravacPolicy state: candidate {s.candidate!r} outside [1, cf_max={self._cf_max:g}]")
        if not (_is_real(s.scale) and s.scale >= 1.0):
            raise ValueError(f"GravacPolicy state: scale {s.scale!r} must be a finite number >= 1")
        if min(s.step, s.window_step, s.windows, s.reopen_at, s.reopen_gap, s.dense_after) < 0:
            raise ValueError("GravacPolicy state: negative step counters")
        if self._search_kind == "ladder":
            named = {"floor": s.floor, "candidate": s.candidate, "best": s.best, "retry": s.retry_rung,
                     "drift_from": s.drift_from, "trial": None if s.trial is None else s.trial.cf}
            if s.tie is not None:
                if len(self._rungs) < 2 or set(s.tie) != {_DENSE, self._rungs[1]} or s.best != self._rungs[1] \
                        or any(cf not in s.rates for cf in s.tie):
                    raise ValueError(f"GravacPolicy state: a tie-break must be between dense and CF "
                                     f"{self._rungs[1]:g}, the best CF, both timed; got {sorted(s.tie)}")
            for what, cf in named.items():
                if cf is not None and cf not in self._rungs:
                    raise ValueError(f"GravacPolicy state: {what} CF {cf!r} is not on this policy's ladder "
                                     f"{list(self._rungs)}")
        for cf, r in s.rates.items():
            if len(r) != 6:
                raise ValueError(f"GravacPolicy state: rates entry of CF {cf!r} has {len(r)} values, expected 6")
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
