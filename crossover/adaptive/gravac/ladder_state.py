"""The ladder search's records: a trial in progress, what each timed CF measured, the search's state.

Kept apart from the decisions (``ladder.py``) so the state, its saved form and its checks read in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from crossover.adaptive.gravac.saved import StateReader
from crossover.adaptive.gravac.tunables import PAUSE_FACTOR
from crossover.adaptive.gravac.types import DENSE, is_real, median

__all__ = ["LadderState", "Timing", "Trial", "step_time"]


def step_time(xs: list[float]) -> float:
    """Step time of a window: the median of its steps, leaving out pauses (``PAUSE_FACTOR``). The glue times
    a step from one first gradient to the next, so whatever the training loop does between steps lands in
    one step's time; in a 4-step trial one such step moves the plain median by a third."""
    s = sorted(xs)
    low = median(s[:max(1, (len(s) + 1) // 2)])
    kept = [x for x in s if x <= PAUSE_FACTOR * low]
    return median(kept)


@dataclass
class Trial:
    """Observations of the CF on trial during its current window."""

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
class Timing:
    """What a CF's latest trial measured (saved as a 6-value list in this field order)."""

    rate: float  # compression throughput: samples/s x gain
    gain: float  # gain over the trial's second half (1 for dense, NaN when unmeasured)
    step_time: float  # pause-robust median step time, seconds
    per_step: float  # samples per step
    judged_at: float  # observations when the trial was judged
    end_gain: float  # gain over the trial's last quarter

    def as_list(self) -> list[float]:
        return [self.rate, self.gain, self.step_time, self.per_step, self.judged_at, self.end_gain]


@dataclass
class LadderState:
    """Where the ladder search is. ``held`` is the CF sent while no trial runs (the settled CF, or the best CF
    of the search so far); ``last_tried`` the CF of the latest trial (the settled CF once settled)."""

    held: float
    last_tried: float
    windows: int = 0  # trials judged
    settled: bool = False
    trial: Trial | None = None
    direction: int = -1  # -1 walking down the ladder, +1 up
    best: float | None = None  # best CF of the current search
    best_rate: float = 0.0  # its compression throughput
    rates: dict[float, Timing] = field(default_factory=dict)
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
    reason: str = ""  # why the search settled: "time" or "gain" (a higher CF is to be retried)
    trial_times: dict[float, list[float]] = field(default_factory=dict)  # timed steps of each CF's latest trial
    tie: dict[float, list[float]] | None = None  # dense vs cf_min, being decided: pooled timed steps of each
    top: int = 0  # index of the highest rung allowed: the last one, unless the optimizer's momentum caps it

    def to_state(self) -> dict[str, Any]:
        tr = self.trial
        return {
            "floor": self.held, "candidate": self.last_tried, "windows": self.windows, "settled": self.settled,
            "trial": None if tr is None else [tr.cf, list(tr.times), tr.samples, [list(t) for t in tr.terms]],
            "direction": self.direction, "best": self.best, "best_rate": self.best_rate,
            "rates": [[cf, *r.as_list()] for cf, r in sorted(self.rates.items())],
            "ref_time": self.ref_time, "ref_stale": self.ref_stale, "reopen_at": self.reopen_at,
            "reopen_gap": self.reopen_gap, "drift_from": self.drift_from, "dense_after": self.dense_after,
            "recent": list(self.recent), "settled_gain_steps": self.settled_gain_steps,
            "retry_rung": self.retry_rung, "retry_at": self.retry_at, "retry_gap": self.retry_gap,
            "searches": self.searches, "search_step": self.search_step, "turn_down": self.turn_down,
            "reason": self.reason,
            "trial_times": [[cf, list(t)] for cf, t in sorted(self.trial_times.items())],
            "tie": None if self.tie is None else [[cf, list(t)] for cf, t in sorted(self.tie.items())],
            "top": self.top,
        }

    #: The saved fields of a paper search that a ladder search leaves at their initial values.
    PAPER_FIELDS = {"scale": 2.0, "window_step": 0, "throughput": []}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], rungs: tuple[float, ...]) -> LadderState:
        """A saved state, checked: every CF on the ladder ``rungs``, every field of its type (ValueError)."""
        top = rungs[-1]
        read = StateReader(state)
        rates = {}
        for row in read.rows("rates", 7):
            if not all(is_real(v) or v != v for v in row) or not (is_real(row[0]) and row[0] in rungs):
                raise ValueError(f"GravacPolicy state: bad rates entry {row!r}")
            rates[float(row[0])] = Timing(*(float(v) for v in row[1:]))
        tr = read._get("trial")
        trial = None
        if tr is not None:
            if not (isinstance(tr, (list, tuple)) and len(tr) == 4 and is_real(tr[0]) and is_real(tr[2])
                    and isinstance(tr[3], (list, tuple))
                    and all(isinstance(t, (list, tuple)) and len(t) == 2 and all(is_real(x) for x in t)
                            for t in tr[3])):
                raise ValueError(f"GravacPolicy state: bad trial {tr!r}")
            trial = Trial(float(tr[0]), read.times("trial times", tr[1]), float(tr[2]),
                          [[float(a), float(b)] for a, b in tr[3]])
        direction = read._get("direction")
        if direction not in (-1, 1) or isinstance(direction, bool):
            raise ValueError(f"GravacPolicy state: direction must be -1 or 1, got {direction!r}")
        st = cls(
            held=read.cf("floor", top), last_tried=read.cf("candidate", top), windows=read.count("windows"),
            settled=read.flag("settled"), trial=trial, direction=int(direction), best=read.optional_cf("best", top),
            best_rate=read.real("best_rate", 0.0), rates=rates, ref_time=read.real("ref_time", 0.0),
            ref_stale=read.flag("ref_stale"), reopen_at=read.count("reopen_at"), reopen_gap=read.count("reopen_gap"),
            drift_from=read.optional_cf("drift_from", top), dense_after=read.count("dense_after"),
            recent=read.times("recent"), settled_gain_steps=read.count("settled_gain_steps"),
            retry_rung=read.optional_cf("retry_rung", top), retry_at=read.count("retry_at"),
            retry_gap=read.count("retry_gap"), searches=read.count("searches"), search_step=read.count("search_step"),
            turn_down=read.flag("turn_down"), reason=read.text("reason", ("", "time", "gain")),
            trial_times=read.cf_lists("trial_times", top) or {}, tie=read.cf_lists("tie", top),
            top=read.count("top"),
        )
        if st.top >= len(rungs):
            raise ValueError(f"GravacPolicy state: top {st.top} is not a rung of the ladder {list(rungs)}")
        named = {"floor": st.held, "candidate": st.last_tried, "best": st.best, "retry": st.retry_rung,
                 "drift_from": st.drift_from, "trial": None if st.trial is None else st.trial.cf}
        for what, cf in named.items():
            if cf is not None and cf not in rungs:
                raise ValueError(f"GravacPolicy state: {what} CF {cf!r} is not on this policy's ladder {list(rungs)}")
        if st.tie is not None and (len(rungs) < 2 or set(st.tie) != {DENSE, rungs[1]} or st.best != rungs[1]
                                   or any(cf not in st.rates for cf in st.tie)):
            raise ValueError(f"GravacPolicy state: a tie-break must be between dense and CF {rungs[1]:g}, the best "
                             f"CF, both timed; got {sorted(st.tie)}")
        return st
