"""GravacPolicy: GraVAC's compression-factor choice as a deterministic state machine (arXiv 2305.12201).

Pure Python, standard library only: plain numbers in, decisions out. The policy never touches a tensor; the
caller (the step driver, ``crossover/driver/``, for the Horovod objects and the DDP hook, or the simulator
``benchmarks/sim_gravac.py``) compresses, measures and reports global (all-rank) statistics.

Why the interface looks like this: in a data-parallel job every rank must take the same decision on every step
without extra communication. So :meth:`GravacPolicy.plan` is a pure function of the observations fed in so far,
and the caller feeds every rank the same *global* statistics (summed across ranks inside the gradient payload,
possibly one step late). Same observations in the same order give the same plans on every rank. Per step::

    plan = policy.plan()                 # send_cf (1.0 = dense) and probe_cfs to measure
    ...compress with plan.send_cf, measure the norms of C_cf(g + e) for every cf in plan.probe_cfs...
    policy.observe(StepStats(sent_cf=plan.send_cf, dense_sq_norm=..., compressed_sq_norms={...},
                             step_time_s=..., samples=..., grad_sq_norm=..., ...))

This module validates the settings, keeps the step count and the warm-up, and delegates to one of two searches
that share the smoothed gains (``gains.py``): ``search="ladder"`` (default, ``ladder.py``) or ``search="paper"``
(``paper.py``). See docs/gravac.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Union

from crossover.adaptive._state import Restorable, check_saved_state
from crossover.adaptive.gravac import tunables as T
from crossover.adaptive.gravac.gains import GAINS, GainBook
from crossover.adaptive.gravac.ladder import LadderSearch, ladder_rungs, log, momentum_cap
from crossover.adaptive.gravac.ladder_state import LadderState
from crossover.adaptive.gravac.paper import SCALINGS, PaperSearch
from crossover.adaptive.gravac.saved import StateReader
from crossover.adaptive.gravac.types import DENSE, Plan, StepStats, is_int, is_real

__all__ = ["SEARCHES", "GravacPolicy"]

#: Names accepted for ``search``.
SEARCHES = ("ladder", "paper")

_STATE_VERSION = 6
#: State versions :meth:`GravacPolicy.load_state_dict` still reads (3: no end-of-trial gain per timed CF;
#: 4: no tie-break between dense and cf_min; 5: no momentum cap).
_OLD_STATE_VERSIONS = (3, 4, 5)
_AUTO = "auto"
#: The ladder fields a paper search saves at their initial values (one saved layout for both searches).
_LADDER_UNUSED = {k: v for k, v in LadderState(held=DENSE, last_tried=DENSE).to_state().items()
                  if k not in ("floor", "candidate", "windows", "settled")}

Window = Union[int, str]


class GravacPolicy(Restorable):
    """GraVAC compression-factor search as a deterministic state machine.

    The decision for step t depends only on the observations fed before it, so ranks that feed the
    same global statistics in the same order make the same plans (no extra communication).

    Keyword-only parameters (defaults and their reasons: ``tunables.py``):
      cf_min: lowest compressed CF, >= 1 (paper 10).
      cf_max: largest CF ever probed or sent, >= cf_min (paper 1000 to 2000; default 100).
      epsilon: gain a CF needs to be sent, in (0, 1] (paper 0.7 or 0.9; meaning depends on ``gain``).
      omega: relative tolerance, in [0, 1): a higher CF must beat a lower one's compression
        throughput by more than omega to be preferred, and a lower CF within omega of the best wins
        (paper 0.01, its authors' script 0.05); dense near cf_min is timed longer against it instead.
      window: observations per decision, int >= 1, or "auto": 2% of the steps observed so far,
        at least 4 and at most 500 (a short run adapts within its first steps, a long one measures
        over longer windows).
      scaling: paper search: "exponential" (CF_s = 2, 4, 16, 256, ...) or "geometric" (2, 4, 8, ...).
      warmup_steps: first observed steps sent dense, int >= 0.
      ewma_alpha: weight of the newest value in the gain EWMAs, in (0, 1].
      gain: "delivered", "authors" or "norm" (``gains.py``).
      search: "ladder" or "paper".
      cf_step: ladder search: ratio between neighbouring CFs of the ladder, > 1.
      reopen_drift: ladder search: once settled, a median step time that moved by more than this
        factor (relative) from the one measured when settling re-opens the search; 0 disables.
      start_cf: ladder search: the first search starts at the highest rung <= start_cf and walks up first
        (None: from the top, walking down).
    """

    def __init__(
        self,
        *,
        cf_min: float = T.CF_MIN,
        cf_max: float = T.CF_MAX,
        epsilon: float = T.EPSILON,
        omega: float = T.OMEGA,
        window: Window = _AUTO,
        scaling: str = "exponential",
        warmup_steps: int = 0,
        ewma_alpha: float = T.EWMA_ALPHA,
        gain: str = "delivered",
        search: str = "ladder",
        cf_step: float = T.CF_STEP,
        reopen_drift: float = T.REOPEN_DRIFT,
        start_cf: float | None = None,
    ) -> None:
        if not is_real(cf_min) or cf_min < 1:
            raise ValueError(f"cf_min must be a finite number >= 1, got {cf_min!r}")
        if not is_real(cf_max):
            raise ValueError(f"cf_max must be a finite number >= cf_min, got {cf_max!r}")
        if cf_max < cf_min:
            raise ValueError(f"cf_min must be <= cf_max, got cf_min={cf_min!r} cf_max={cf_max!r}")
        if not is_real(epsilon) or not 0.0 < epsilon <= 1.0:
            raise ValueError(f"epsilon must be in (0, 1], got {epsilon!r}")
        if not is_real(omega) or not 0.0 <= omega < 1.0:
            raise ValueError(f"omega must be in [0, 1), got {omega!r}")
        if window != _AUTO and (not is_int(window) or window < 1):
            raise ValueError(f"window must be an int >= 1 or 'auto', got {window!r}")
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}; got {scaling!r}")
        if not is_int(warmup_steps) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not is_real(ewma_alpha) or not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha!r}")
        if gain not in GAINS:
            raise ValueError(f"gain must be one of {', '.join(GAINS)}; got {gain!r}")
        if search not in SEARCHES:
            raise ValueError(f"search must be one of {', '.join(SEARCHES)}; got {search!r}")
        if not is_real(cf_step) or cf_step <= 1.0:
            raise ValueError(f"cf_step must be a finite number > 1, got {cf_step!r}")
        if not is_real(reopen_drift) or reopen_drift < 0.0:
            raise ValueError(f"reopen_drift must be a finite number >= 0, got {reopen_drift!r}")
        if start_cf is not None and (not is_real(start_cf) or not cf_min <= start_cf <= cf_max):
            raise ValueError(f"start_cf must be None or a number in [cf_min, cf_max], got {start_cf!r}")
        self._config: dict[str, Any] = {
            "cf_min": float(cf_min), "cf_max": float(cf_max), "epsilon": float(epsilon), "omega": float(omega),
            "window": window, "scaling": scaling, "warmup_steps": warmup_steps, "ewma_alpha": float(ewma_alpha),
            "gain": gain, "search": search, "cf_step": float(cf_step), "reopen_drift": float(reopen_drift),
            "start_cf": None if start_cf is None else float(start_cf)}
        self._window: Window = window
        self._warmup = warmup_steps
        self._search_kind = search
        self._step = 0
        self._momentum: float | None = None  # the optimizers' momentum, as last reported (mean over ranks)
        self._rungs = ladder_rungs(float(cf_min), float(cf_max), float(cf_step))
        self._gains = GainBook(gain, float(ewma_alpha))
        self._search = self._new_search()
        if isinstance(self._search, LadderSearch) and warmup_steps == 0:
            self._search.first_search()

    def _new_search(self) -> PaperSearch | LadderSearch:
        c = self._config
        if self._search_kind == "paper":
            return PaperSearch(cf_min=c["cf_min"], cf_max=c["cf_max"], epsilon=c["epsilon"], omega=c["omega"],
                               scaling=c["scaling"], gains=self._gains, window_at=self.window_at)
        return LadderSearch(rungs=self._rungs, epsilon=c["epsilon"], omega=c["omega"], drift=c["reopen_drift"],
                            start_cf=c["start_cf"], gains=self._gains, window_at=self.window_at)

    def window_at(self, step: int) -> int:
        """Window length (observations) for a window starting after ``step`` observations."""
        if self._window != _AUTO:
            return int(self._window)
        return max(T.AUTO_WINDOW_MIN, min(T.AUTO_WINDOW_MAX, int(step * T.AUTO_WINDOW_FRACTION)))

    # ------------------------------------------------------------------ decisions
    def plan(self) -> Plan:
        """Decision for the next step; pure (no side effects), same result until observe()."""
        return self._search.plan(self._step < self._warmup)

    def observe(self, stats: StepStats) -> None:
        """Feed the global statistics of one step (in step order; may lag the plans)."""
        step_gains = self._gains.update(stats)
        self._step += 1
        search = self._search
        if self._step <= self._warmup:
            if isinstance(search, LadderSearch):
                self._note_momentum(stats.momentum)  # before the first search: it only bounds it
                if self._step == self._warmup:
                    search.step = self._step
                    search.first_search()
            return  # warm-up: gains only, no throughput and no search
        if isinstance(search, PaperSearch):
            search.observe(stats, step_gains, self._step)
        else:
            search.step = self._step
            search.observe(stats)
            self._note_momentum(stats.momentum)

    def expect_momentum(self) -> None:
        """The host reports the optimizer's momentum in every step's statistics (the step drivers do). It arrives
        one step late, after the first plans: until then the ladder is capped at cf_min, the cap of the commonest
        momentum (0.9), and its first search starts there. The first statistics then set the cap (no momentum: the
        whole ladder, searched from its top). Only before the first observation."""
        search = self._search
        if not isinstance(search, LadderSearch) or self._step > 0 or self._momentum is not None:
            return
        top = min(1, len(self._rungs) - 1)  # rung 1 is cf_min (rung 0 is dense)
        if search.s.top == top:
            return
        self._search = search = self._new_search()
        search.s.top = top
        if self._warmup == 0:
            search.first_search()

    def _note_momentum(self, m: float) -> None:
        """Ladder: the optimizer's momentum caps the CF (``ladder.momentum_cap``); a new value moves the cap."""
        assert isinstance(self._search, LadderSearch)
        if not (math.isfinite(m) and 0.0 <= m <= 1.0):  # 1 (never forgets) is a momentum: the cap is cf_min
            full = len(self._rungs) - 1
            if self._momentum is None and self._search.s.top < full:  # expect_momentum's cap, and none came
                self._search.set_top(full, why="no optimizer momentum reported: the whole ladder")
            return
        if m == self._momentum:
            return
        first, self._momentum = self._momentum is None, m
        c = self._config
        cap = momentum_cap(c["cf_min"], c["cf_max"], m) * (1.0 + 1e-6)  # the reduced mean is float32
        top = max(i for i, cf in enumerate(self._rungs) if cf <= cap or i <= 1)
        if top != self._search.s.top or first:
            log.info("step %d: optimizer momentum %.3g %s", self._step, m,
                     f"caps the CF at {self._rungs[top]:g} (higher CFs lost accuracy under momentum: docs/accuracy.md;"
                     " momentum= overrides what is read)" if top < len(self._rungs) - 1
                     else f"allows the whole ladder, up to CF {self._rungs[top]:g}")
        self._search.set_top(top, why=f"momentum {m:.3g} caps the CF at {self._rungs[top]:g}")

    @property
    def needs_grad_norms(self) -> bool:
        """Whether the gain reads the raw gradient's norm (``grad_sq_norm``, ``grad_norm_sum``): the
        caller then measures ``||g||`` apart from ``||g + e||`` (one more read pass per tensor)."""
        return self._gains.needs_grad_norms

    # ------------------------------------------------------------------ telemetry
    @property
    def step(self) -> int:
        """Number of observations fed so far."""
        return self._step

    @property
    def warming_up(self) -> bool:
        """True while the next plan is a warm-up (dense) step."""
        return self._step < self._warmup

    @property
    def send_cf(self) -> float:
        """CF the next plan sends (1.0 = dense)."""
        return self.plan().send_cf

    @property
    def floor_cf(self) -> float:
        """Paper search: current floor CF_min. Ladder: the best CF of the search so far (the settled CF)."""
        return self._search.floor_cf

    @property
    def candidate_cf(self) -> float:
        """Paper search: candidate CF_min * CF_s. Ladder: the CF on trial (the settled CF once settled)."""
        return self._search.candidate_cf

    @property
    def cf_s(self) -> float:
        """Candidate / floor (the paper's effective CF_s after the cf_max bound)."""
        return self.candidate_cf / self.floor_cf

    @property
    def floor_gain(self) -> float | None:
        """Smoothed gain of the floor CF, None before it was measured."""
        return self._gains.get(self.floor_cf)

    @property
    def candidate_gain(self) -> float | None:
        """Smoothed gain of the candidate CF, None before it was measured."""
        return self._gains.get(self.candidate_cf)

    @property
    def gains(self) -> dict[float, float]:
        """Smoothed gain of every CF ever probed (a copy)."""
        return self._gains.values()

    @property
    def settled(self) -> bool:
        """True while the search is stopped; floor and candidate are then the settled CF."""
        return self._search.s.settled

    @property
    def searches(self) -> int:
        """Searches begun so far: the ladder search counts each (re)opening; the paper search is one."""
        return int(getattr(self._search.s, "searches", 1))

    @property
    def throughput(self) -> dict[float, float]:
        """Compression throughput (samples/s * gain) per CF: paper search over all steps each CF was
        sent after warm-up; ladder search from each CF's latest trial window (a copy)."""
        if isinstance(self._search, PaperSearch):
            return self._search.throughput
        return {cf: r.rate for cf, r in sorted(self._search.s.rates.items())}

    @property
    def ladder(self) -> tuple[float, ...]:
        """The CFs the ladder search can send, ascending (1.0 = dense)."""
        return self._rungs

    @property
    def config(self) -> dict[str, Any]:
        """Constructor arguments, as plain values."""
        return dict(self._config)

    def summary(self) -> dict[str, Any]:
        """Read-only snapshot for telemetry (plain values; float dict keys are CFs)."""
        search = self._search
        paper = isinstance(search, PaperSearch)
        out = {
            "step": self._step,
            "warming_up": self.warming_up,
            "send_cf": self.send_cf,
            "floor_cf": self.floor_cf,
            "candidate_cf": self.candidate_cf,
            "cf_s": self.cf_s,
            "floor_gain": self.floor_gain,
            "candidate_gain": self.candidate_gain,
            "settled": self.settled,
            "windows": search.s.windows,
            "window_step": search.s.window_step if paper else (
                len(search.s.trial.times) if search.s.trial is not None else 0),
            "gains": self.gains,
            "throughput": self.throughput,
            "throughput_steps": search.throughput_steps() if paper else {},
            "search": self._search_kind,
        }
        if not paper:
            s = search.s
            out.update({
                "trial_cf": s.trial.cf if s.trial is not None else None,
                "searches": s.searches,
                "settled_reason": s.reason if s.settled else None,
                "reference_step_time_s": s.ref_time if s.settled else None,
                "retry_cf": s.retry_rung,
                "retry_at_step": s.retry_at if s.retry_rung is not None else None,
                "max_cf": self._rungs[s.top],  # the highest CF allowed: cf_max, unless the momentum caps it
                "momentum": self._momentum,
            })
        return out

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Full state as JSON-serialisable plain values (lists instead of float-keyed dicts); one layout for both
        searches, the other search's fields at their initial values."""
        search = self._search
        own = {**search.to_state(), **_LADDER_UNUSED} if isinstance(search, PaperSearch) else \
            {**LadderState.PAPER_FIELDS, **search.s.to_state()}
        return {"version": _STATE_VERSION, "config": self.config, "step": self._step,
                "gains": self._gains.to_state(), "momentum": self._momentum, **own}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the saved config must equal this policy's config. Every field is
        checked first: ValueError naming the field, and nothing changed, for a state no run could reach."""
        if not isinstance(state, Mapping):
            raise ValueError(f"GravacPolicy state must be a mapping, got {type(state).__name__}")
        if state.get("version") in _OLD_STATE_VERSIONS:
            # version 3 kept no end-of-trial gain: its gain over the window's second half stands in; versions 3
            # and 4 kept no trial times and had no tie-break; versions 3 to 5 had no momentum cap (all rungs)
            rates = state.get("rates")
            if not isinstance(rates, list):
                raise ValueError(f"GravacPolicy state: rates must be a list, got {rates!r}")
            top = 0 if self._search_kind == "paper" else len(self._rungs) - 1
            state = {"trial_times": [], "tie": None, "top": top, "momentum": None, **state, "version": _STATE_VERSION,
                     "rates": [[*r, r[2]] if isinstance(r, list) and len(r) == 6 else r for r in rates]}
        check_saved_state("GravacPolicy", state, _STATE_VERSION, self.config)
        unused = _LADDER_UNUSED if self._search_kind == "paper" else LadderState.PAPER_FIELDS
        for name, initial in unused.items():  # the other search's fields: saved at their initial values
            if name not in state or state[name] != initial:
                raise ValueError(f"GravacPolicy state: {name} must be {initial!r} for search={self._search_kind!r} "
                                 f"(a field of the other search), got {state.get(name, '<missing>')!r}")
        read = StateReader(state)
        step = read.count("step")
        momentum = read._get("momentum")
        if momentum is not None and not (is_real(momentum) and 0.0 <= momentum <= 1.0):
            raise ValueError(f"GravacPolicy state: momentum must be None or a number in [0, 1], got {momentum!r}")
        gains = GainBook.check_state(read.rows("gains", 5))
        search = self._new_search()
        if isinstance(search, PaperSearch):
            search.load(search.check_state(state, read))
        else:
            search.load(LadderState.from_state(state, self._rungs))
        # checked: apply
        self._step = step
        self._momentum = None if momentum is None else float(momentum)
        self._gains.load(gains)
        self._search = search

    def __repr__(self) -> str:
        return (f"GravacPolicy(step={self._step}, floor={self.floor_cf:g}, candidate={self.candidate_cf:g}, "
                f"settled={self.settled})")
