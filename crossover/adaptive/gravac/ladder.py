"""The ladder search: GraVAC's compression throughput judged on CFs actually sent (the default search).

The paper probes a floor and a candidate on every step and compares throughputs estimated from all the steps
each CF was sent; on a shared machine those estimates mix phases, and the probes cost a pass per step. The
ladder instead runs a short *trial* of each CF it may send (cf_max, cf_max / cf_step, ..., cf_min, dense):

* **Walk down** from the top: a lower CF within omega of the best compression throughput so far is preferred
  (it loses less information); the walk stops at the first CF that is slower by more than omega, or when the
  CFs timed so far predict the next one hopeless (communication time ~ 1 / CF, :meth:`LadderSearch._hopeless`).
* **Dense against cf_min** within (1 + omega) ** TIE_BAND is a near-tie, decided on pooled steps of both timed
  in alternating windows; the faster wins.
* **Settled**, it probes nothing beyond what it sends, and re-opens a search when the settled CF's gain falls
  under epsilon (walk down), its step time drifts (walk towards the neighbour the change favours), or a higher
  CF that lost only on its gain is due for a retry (walk up); false alarms grow the wait before the next.

Every number it tunes is in ``tunables.py``. Decisions are logged to ``crossover.gravac`` (INFO for searches
and settling, DEBUG for every judged trial); every rank logs the same.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

from crossover.adaptive.gravac.gains import GainBook
from crossover.adaptive.gravac.ladder_state import LadderState, Timing, Trial, step_time
from crossover.adaptive.gravac.tunables import (
    DENSE_MARGIN,
    DRIFT_MIN_STEPS,
    FALSE_ALARM_GROWTH,
    FIRST_TRIAL_SKIP,
    SKIP_MARGIN,
    SWITCH_MARGIN,
    SWITCH_SKIP,
    TIE_BAND,
    TIE_EARLY,
    TIE_STEPS,
    TIE_WINDOW,
    WALK_UP_STEPS,
)
from crossover.adaptive.gravac.types import DENSE, Plan, StepStats, median

__all__ = ["LadderSearch", "ladder_rungs", "momentum_cap"]

log = logging.getLogger("crossover.gravac")


def ladder_rungs(cf_min: float, cf_max: float, cf_step: float) -> tuple[float, ...]:
    """Dense, then cf_min * cf_step^i below cf_max, then cf_max (ascending)."""
    rungs = [DENSE]
    cf = cf_min
    while cf < cf_max * (1.0 - 1e-9):
        if cf > DENSE:
            rungs.append(cf)
        cf *= cf_step
    if cf_max > DENSE:
        rungs.append(cf_max)
    return tuple(rungs)


def momentum_cap(cf_min: float, cf_max: float, momentum: float) -> float:
    """The highest CF the ladder may send when the optimizer has this momentum m.

    An optimizer with momentum m carries each delivered update into the following steps, so a coordinate that
    top-k held back for many steps and then sends at once moves the weights 1 / (1 - m) times as far as the burst
    itself: the staleness error of CF c weighs like that of c / (1 - m) without momentum. cf_max is the highest CF
    that keeps accuracy without momentum (top-k 1000x did not), so the cap is cf_max * (1 - m), never below cf_min.
    Measured (real 2-rank jobs, digits MLP, SGD momentum 0.9): top-k 30x, 50x and 100x ended up to 3 to 5 points
    under dense on 2 of 3 seeds, top-k 10x within 0.6 (docs/accuracy.md). Re-measured after 492e94a fixed top-k's
    threshold sample: top-k 100x still ended 2.7 points under dense on the MNIST CNN (3 seeds).
    """
    return max(cf_min, cf_max * (1.0 - momentum))


class LadderSearch:
    """The ladder search over ``rungs``; ``step`` is the number of observations, set by the policy."""

    def __init__(self, *, rungs: tuple[float, ...], epsilon: float, omega: float, drift: float,
                 start_cf: float | None, gains: GainBook, window_at: Callable[[int], int]) -> None:
        self.rungs = rungs
        self._epsilon, self._omega, self._drift, self._start_cf = epsilon, omega, drift, start_cf
        self._gains = gains
        self._window_at = window_at
        self.step = 0
        self.s = LadderState(held=rungs[-1], last_tried=rungs[-1], top=len(rungs) - 1)

    @property
    def floor_cf(self) -> float:
        """The held CF: the settled one, or the best of the search so far."""
        return self.s.held

    @property
    def candidate_cf(self) -> float:
        """The CF of the latest trial (the settled CF once settled)."""
        return self.s.last_tried

    # ------------------------------------------------------------------ plans
    def plan(self, warming_up: bool) -> Plan:
        """Dense while warming up, else the CF on trial or the held one. The ladder counts its windows, retries
        and drift in observed steps: a dense step must be observed too, so every plan asks to be measured."""
        if warming_up:
            return Plan(send_cf=DENSE, probe_cfs=(), measure=True)
        s = self.s
        cf = s.trial.cf if s.trial is not None else s.held
        return Plan(send_cf=cf, probe_cfs=(cf,) if cf > DENSE else (), measure=True)

    # ------------------------------------------------------------------ searches
    def first_search(self) -> None:
        """From the top of the ladder: walk down. From a middle rung (``start_cf``): walk up first, then down."""
        top = self.s.top
        if self._start_cf is None:
            i = top
        else:
            i = max(j for j, cf in enumerate(self.rungs[:top + 1]) if cf <= self._start_cf * (1.0 + 1e-9))
        if i == top:  # under a momentum cap: from the cap, never above it (one window above cost 4 % of an LM's loss)
            self._start_search(i, -1, why="first search, from the top")
        else:
            self._start_search(i, +1, turn_down=True, why="first search, from start_cf")

    def _start_search(self, rung: int, direction: int, best: float | None = None, best_rate: float = 0.0,
                      turn_down: bool = False, keep_times: bool = False, why: str = "") -> None:
        """Begin a search: try ``rungs[rung]``, then walk in ``direction`` (-1 down, +1 up); with ``turn_down``,
        an upward walk that stops at its first rung continues downward from there; with ``keep_times``, step
        times of the previous search still count for predictions (nothing changed but a gain)."""
        s = self.s
        s.settled = False
        s.direction = direction
        s.turn_down = turn_down
        s.best = best
        s.best_rate = best_rate
        s.searches += 1
        if not keep_times:
            s.search_step = self.step
        s.recent = []
        s.trial_times = {}
        s.tie = None
        log.info("step %d: search %d (%s): trying CF %g, walking %s", self.step, s.searches, why,
                 self.rungs[rung], "down" if direction < 0 else "up")
        self._try(self.rungs[rung])

    def _try(self, cf: float) -> None:
        s = self.s
        s.trial = Trial(cf=cf)
        s.last_tried = cf
        s.held = s.best if s.best is not None else cf

    # ------------------------------------------------------------------ observations
    def observe(self, stats: StepStats) -> None:
        """A step after warm-up: time the trial, or watch the settled CF."""
        s = self.s
        cf, t, n = float(stats.sent_cf), float(stats.step_time_s), float(stats.samples)
        if not (math.isfinite(t) and t > 0.0 and math.isfinite(n) and n > 0.0):
            return
        if s.trial is not None:
            self._observe_trial(s.trial, stats, cf, t, n)
        elif cf == s.held:
            self._watch_settled(t)

    def _observe_trial(self, tr: Trial, stats: StepStats, cf: float, t: float, n: float) -> None:
        if cf != tr.cf:
            return  # a late observation of a step sent before this trial began
        tr.times.append(t)
        tr.samples += n
        terms = self._gains.terms(stats, cf) if cf > DENSE else None
        if terms is not None:
            tr.terms.append([terms[0], terms[1]])
        timed = len(tr.times) - self._skip()
        if timed >= self._trial_length(self.step - len(tr.times)) or self._losing(tr):
            self._judge(tr)  # before counting it: its timing leaves out the steps this trial skipped
            self.s.windows += 1

    def _watch_settled(self, t: float) -> None:
        """Settled: the gain test, a due retry, then step-time drift, in that order."""
        s = self.s
        w = self._window_at(self.step)
        dw = max(w, DRIFT_MIN_STEPS)
        s.recent.append(t)
        del s.recent[:-dw]
        if s.held > DENSE:
            s.settled_gain_steps += 1
            g = self._gains.get(s.held)
            if g is not None and s.settled_gain_steps >= w and g < self._epsilon:
                self._note_gain_failure(s.held)
                self._start_search(self.rungs.index(s.held) - 1, -1, keep_times=True,  # walk down from below
                                   why=f"CF {s.held:g}'s gain {g:.2f} fell under epsilon {self._epsilon:g}")
                return
        if s.retry_rung is not None and self.step >= s.retry_at:
            self._retry()
            return
        if self._drift > 0.0 and len(s.recent) >= dw:
            med = step_time(s.recent)
            if s.ref_stale:
                # A trial's few steps are a noisy reference: the settled CF's own first full window is it.
                s.ref_time, s.ref_stale = med, False
            elif self.step >= s.reopen_at and (med > s.ref_time * (1.0 + self._drift)
                                               or med * (1.0 + self._drift) < s.ref_time):
                self._drift_search(med, slower=med > s.ref_time)

    def _skip(self) -> int:
        """Observations at the start of the current trial that its timing leaves out."""
        return FIRST_TRIAL_SKIP if self.s.windows == 0 else SWITCH_SKIP

    def _timed(self, tr: Trial) -> list[float]:
        """The trial's step times that count (its switch step when it was ended on that alone)."""
        return tr.times[self._skip():] or tr.times

    def _trial_length(self, start: int) -> int:
        """Steps a trial runs (unless it is clearly losing): a window; a walk up (a retry, or a check after
        the step time drifted) at least ``WALK_UP_STEPS``: it must beat the settled CF by more than omega,
        and a few steps' median on a busy machine can do that by chance (a higher CF loses information)."""
        w = self._window_at(start)
        if self.s.tie is not None:
            return max(w, TIE_WINDOW)
        return max(w, WALK_UP_STEPS) if self.s.direction > 0 and self.s.best is not None else w

    def _losing(self, tr: Trial) -> bool:
        """True when the CF on trial is already far behind the best of the search: its median step time
        over the shortest window gives a system throughput short of the best compression throughput by
        more than ``SKIP_MARGIN`` times omega's allowance (its gain could only lower it further), judged from its
        second timed step on. A wrong rung then costs a few steps, not a whole window (a dense window on a slow
        link is long); a rung further behind still (``SWITCH_MARGIN``) costs its switch step alone."""
        s = self.s
        if s.best is None or s.tie is not None:
            return False
        times = self._timed(tr)
        rate = tr.samples / len(tr.times) / step_time(times)
        if len(tr.times) <= self._skip():  # the switch step alone: only a loss no switch could cost ends it
            return s.windows > 0 and rate * SWITCH_MARGIN * (1.0 + self._omega) < s.best_rate
        if len(times) < 2:
            return False
        if s.drift_from is not None and s.direction < 0:
            # A drift check downward must find a CF at least as fast as the settled one is now (best_rate
            # is that throughput x (1 + omega)): two steps slower by more than omega end it.
            return rate * (1.0 + self._omega) ** 2 < s.best_rate
        return rate * SKIP_MARGIN * (1.0 + self._omega) < s.best_rate

    def _drift_search(self, med: float, slower: bool) -> None:
        """The settled CF's step time moved: check the neighbour the change favours, walking on from it
        while each next CF beats the settled one's current throughput (up: by more than omega; down: at
        all, not merely within omega as in a first search: a few fast steps of a noisy machine then
        cannot walk the run down to a CF that is slower in fact). Slower steps (the link or the load got
        worse) favour more compression, faster steps less. A false alarm costs one short trial of a
        neighbour, not a whole search."""
        s = self.s
        cf = s.held
        i = self.rungs.index(cf)
        rate = self._rate_now(cf, med)
        self._retime(cf, med, rate)
        s.drift_from = cf
        nxt = i + 1 if slower else i - 1
        if not slower and nxt >= 0 and (self._hopeless(nxt) or self._out_of_reach(nxt, cf, med)):
            # Faster steps, but the CF below is still predicted far behind: no trial, the new step time is the
            # reference.
            log.info("step %d: CF %g's step time moved from %.1f to %.1f ms; CF %g is still far behind", self.step,
                     cf, 1e3 * s.ref_time, 1e3 * med, self.rungs[nxt])
            self._settle(cf, med)  # as a false alarm: the wait before the next check grows
        elif 0 <= nxt <= s.top:
            if slower:
                s.retry_rung = None  # the walk up tries the CFs above anyway
            self._start_search(nxt, +1 if slower else -1, best=cf,
                               best_rate=rate if slower else rate * (1.0 + self._omega),
                               why=f"CF {cf:g}'s step time moved from {1e3 * s.ref_time:.1f} to {1e3 * med:.1f} ms")
        else:  # nothing in that direction: the new step time is the reference
            self._settle(cf, med)

    # ------------------------------------------------------------------ judging a trial
    def _judge(self, tr: Trial) -> None:
        """End of a trial window: record its timing, then walk on or settle."""
        s = self.s
        rec = self._record(tr)
        passes = not rec.gain < self._epsilon  # dense (gain 1) and an unmeasured gain (NaN) pass
        if s.tie is not None:
            self._tie_window(tr.cf, passes)
            return
        i = self.rungs.index(tr.cf)
        if i > s.top:  # a trial above the cap (restored from an older state): the search starts at the cap
            self._try(self.rungs[s.top])
            return
        if tr.cf == DENSE and rec.rate * SKIP_MARGIN * (1.0 + self._omega) < s.best_rate:
            # Dense lost clearly: do not time it again before the run has doubled (O(log steps) trials).
            s.dense_after = self.step + max(DRIFT_MIN_STEPS, self.step)
        if not passes:
            self._note_gain_failure(tr.cf)
        if s.direction < 0:
            self._walk_down(tr.cf, i, rec, passes)
        else:
            self._walk_up(tr.cf, i, rec, passes)

    def _record(self, tr: Trial) -> Timing:
        """The trial's timing, kept in ``rates`` (and its timed steps in ``trial_times``)."""
        s = self.s
        times = self._timed(tr)
        # The run's first trial still carries the process's warm-up, which only slows steps: its faster half.
        st = step_time(times) if s.windows > 0 else median(sorted(times)[:(len(times) + 1) // 2])
        per_step = tr.samples / len(tr.times)
        terms = tr.gain_terms() if tr.cf > DENSE else None
        gain = self._gains.ratio(*terms) if terms is not None else None
        end_terms = tr.end_gain_terms() if tr.cf > DENSE else None
        end_gain = self._gains.ratio(*end_terms) if end_terms is not None else gain
        rate = per_step / st * (1.0 if gain is None else min(1.0, gain))
        rec = Timing(rate=rate, gain=1.0 if tr.cf == DENSE else (math.nan if gain is None else gain), step_time=st,
                     per_step=per_step, judged_at=float(self.step),
                     end_gain=1.0 if tr.cf == DENSE else (math.nan if end_gain is None else end_gain))
        s.rates[tr.cf] = rec
        log.debug("step %d: CF %g judged on %d steps: median %.1f ms, gain %s, %.1f samples/s (best so far: %s)",
                  self.step, tr.cf, len(times), 1e3 * st, "-" if gain is None else f"{gain:.2f}", rate,
                  "none" if s.best is None else f"CF {s.best:g} at {s.best_rate:.1f}")
        s.trial_times[tr.cf] = times
        return rec

    def _walk_down(self, cf: float, i: int, rec: Timing, passes: bool) -> None:
        """Walking down: a lower CF within omega of the best compression throughput is preferred."""
        s = self.s
        if passes and self._near_tie(cf, rec.rate):
            self._start_tie()
            return
        if passes and (s.best is None or rec.rate * (1.0 + self._omega) >= s.best_rate):
            s.best = cf
            s.best_rate = max(s.best_rate, rec.rate)
            if i > 0 and not self._hopeless(i - 1):
                self._try(self.rungs[i - 1])
            else:
                self._settle(cf, rec.step_time)
        elif s.best is None:
            self._try(self.rungs[i - 1])  # failed the gain test, nothing chosen yet: look lower
        elif i > 0 and not self._hopeless(0):
            # A lower CF lost, but maybe to its compression cost, which dense does not pay: time
            # dense too, unless the CFs measured so far put it far out of reach.
            self._try(DENSE)
        else:
            self._settle(s.best, s.rates[s.best].step_time)

    def _walk_up(self, cf: float, i: int, rec: Timing, passes: bool) -> None:
        """Walking up: a higher CF must beat the best by more than omega."""
        s = self.s
        if passes and (s.best is None or rec.rate > s.best_rate * (1.0 + self._omega)):
            first = s.best is None
            s.best, s.best_rate = cf, max(s.best_rate, rec.rate)
            s.turn_down = s.turn_down and first  # once the walk up has moved, it never turns down
            if i + 1 <= s.top:
                self._try(self.rungs[i + 1])
                return
            if not s.turn_down:
                self._settle(cf, rec.step_time)
                return
        elif s.best is not None and not (s.turn_down and self.rungs.index(s.best) == i - 1):
            self._settle(s.best, s.rates[s.best].step_time)  # the walk up stopped after moving: settle there
            return
        # the first rung did not beat what is below it: walk down from there, as from the top
        s.direction, s.turn_down = -1, False
        j = self.rungs.index(s.best) if s.best is not None else i
        if j > 0 and not self._hopeless(j - 1):
            self._try(self.rungs[j - 1])
        elif s.best is not None:
            self._settle(s.best, s.rates[s.best].step_time)
        else:
            self._try(self.rungs[j - 1])

    # ------------------------------------------------------------------ dense against cf_min
    def _near_tie(self, cf: float, rate: float) -> bool:
        """Whether dense, judged at ``rate`` walking down, is in a near-tie with the best CF of the search, cf_min:
        their compression throughputs within (1 + omega) ** ``TIE_BAND`` of each other.

        Among compressed CFs a lower one within omega is preferred (a higher CF loses information that its gain
        does not show as accuracy). Between dense and cf_min that preference is not applied: top-k 10x reached
        dense's accuracy on every workload measured, and a dense that is slower by up to omega on every step
        costs up to omega of the run's time. The faster of the two wins, timed long enough to tell."""
        s = self.s
        if cf != DENSE or s.drift_from is not None or len(self.rungs) < 2 or s.best != self.rungs[1]:
            return False
        band = (1.0 + self._omega) ** TIE_BAND
        return s.rates[s.best].rate / band <= rate <= s.rates[s.best].rate * band

    def _start_tie(self) -> None:
        """Decide dense against cf_min on pooled steps: alternate windows of each, cf_min's first."""
        s = self.s
        assert s.best is not None
        s.tie = {DENSE: list(s.trial_times.get(DENSE, [])), s.best: list(s.trial_times.get(s.best, []))}
        log.info("step %d: dense and CF %g are close: timing both in turn", self.step, s.best)
        self._try(s.best)

    def _tie_window(self, cf: float, passes: bool) -> None:
        """A window of the tie-break ended: alternate, or settle on the faster once both have ``TIE_STEPS`` timed
        steps (``TIE_EARLY`` when they are apart by more than (1 + omega) ** 2)."""
        s = self.s
        assert s.tie is not None and s.best is not None
        low = s.best
        s.tie[cf].extend(s.trial_times[cf])
        if not passes:  # cf_min failed the gain test: dense
            self._note_gain_failure(cf)
            self._end_tie(DENSE)
            return
        pooled = min(len(t) for t in s.tie.values())
        step_times = {c: step_time(times) for c, times in s.tie.items()}
        rates = {}
        for c, t in step_times.items():
            r = s.rates[c]
            gain = 1.0 if c == DENSE or not math.isfinite(r.gain) else min(1.0, r.gain)
            rates[c] = r.per_step / t * gain
        apart = max(rates.values()) > min(rates.values()) * (1.0 + self._omega) ** 2
        if pooled < TIE_STEPS and not (pooled >= TIE_EARLY and apart):
            self._try(low if cf == DENSE else DENSE)
            return
        for c, t in step_times.items():
            s.rates[c].step_time, s.rates[c].rate = t, rates[c]
        log.info("step %d: dense %.1f ms vs CF %g %.1f ms over %d and %d steps", self.step,
                 1e3 * s.rates[DENSE].step_time, low, 1e3 * s.rates[low].step_time, len(s.tie[DENSE]),
                 len(s.tie[low]))
        self._end_tie(low if rates[low] > rates[DENSE] else DENSE)

    def _end_tie(self, cf: float) -> None:
        s = self.s
        s.tie = None
        s.best = cf
        s.best_rate = s.rates[cf].rate
        self._settle(cf, s.rates[cf].step_time)

    # ------------------------------------------------------------------ predictions
    def _hopeless(self, rung: int) -> bool:
        """True when CFs timed in this search predict ``rung`` far too slow to be worth a trial.

        Communication time scales as 1 / CF, so two measured step times T(a) and T(b) give
        T(cf) ~ T(a) + slope * (1 / cf - 1 / a). A CF predicted to fall short of the best compression
        throughput by more than ``SKIP_MARGIN`` times omega's allowance is not tried: on a slow link a
        window at CF 10 or dense can cost more than the whole search saves.

        A lower CF is predicted from the two nearest CFs above it. Dense differs: it pays no compression
        cost, and an allgathered sparse payload costs more per element than a dense allreduce, so the
        extrapolation overrates dense's time: dense is skipped only beyond ``DENSE_MARGIN``. Where the
        step time does not fall with the CF (a fast link, a compute-bound model) the slope is about zero
        and dense is timed.
        """
        s = self.s
        timed = [cf for cf in self.rungs[rung + 1:] if cf in s.rates and s.rates[cf].judged_at >= s.search_step]
        if rung == 0 and self.step < s.dense_after:
            return True  # dense lost clearly not long ago
        if rung == 0 and len(timed) < 2:  # a short search (after a drift): the latest times of every CF
            timed = [cf for cf in self.rungs[1:] if cf in s.rates]
        if len(timed) < 2:
            return False
        a, b = timed[:2]
        ra, rb = s.rates[a], s.rates[b]
        slope = (ra.step_time - rb.step_time) / (1.0 / a - 1.0 / b)
        if not slope > 0.0:
            return False
        predicted = ra.step_time + slope * (1.0 / self.rungs[rung] - 1.0 / a)
        margin = DENSE_MARGIN if rung == 0 else SKIP_MARGIN
        return ra.per_step / predicted * margin * (1.0 + self._omega) < s.best_rate

    def _out_of_reach(self, rung: int, cf: float, st: float) -> bool:
        """True when the settled ``cf``, now faster (from ``ref_time`` to ``st``), still beats ``rung`` by more than
        omega even in the lower CF's best case. Its step time T was measured in an earlier search; the settled CF's
        drop d came from compute, the compression or the link, and only the link's share grows with the bytes, at
        most cf / (the rung's CF) times: the rung now steps in at least T - d x cf / CF. A bound, not a fit: no
        margin beyond omega. (The warm-up of a process speeds every CF alike; without this, each such drift timed
        dense: 3-4 dense steps of 4.5x a CF-10 step, twice before the target on the momentum MLP.)"""
        s = self.s
        low = self.rungs[rung]
        r = s.rates.get(low)
        if r is None:
            return False
        best_case = r.step_time - (s.ref_time - st) * cf / low
        return best_case > 0.0 and r.per_step / best_case * (1.0 + self._omega) < self._rate_now(cf, st)

    def _retime(self, cf: float, st: float, rate: float) -> None:
        """The settled CF's timing is now its recent median ``st``: a search that starts from it predicts the
        CFs below from this, not from the trial that chose it long ago (warm-up steps, another load; the run that
        showed it: docs/gravac.md, "Re-open on drift")."""
        r = self.s.rates.get(cf)
        if r is not None:
            r.step_time, r.rate, r.judged_at = st, rate, float(self.step)

    def _rate_now(self, cf: float, st: float) -> float:
        """Compression throughput of the settled CF at step time ``st``: samples per step (from its trial; 1 if
        never tried) / step time x its smoothed gain (1 for dense or while unmeasured)."""
        g = self._gains.get(cf)
        factor = 1.0 if cf == DENSE or g is None else min(1.0, g)
        per_step = self.s.rates[cf].per_step if cf in self.s.rates else 1.0
        return per_step / st * factor

    # ------------------------------------------------------------------ settling and retries
    def _note_gain_failure(self, cf: float) -> None:
        """A CF failed the gain test: if the search settles below it, try it again later."""
        s = self.s
        if s.retry_rung is None or cf < s.retry_rung:
            s.retry_rung = cf

    def _settle(self, cf: float, st: float) -> None:
        s = self.s
        s.trial = None
        s.settled = True
        s.held = s.last_tried = cf
        s.ref_time, s.ref_stale = st, True
        s.recent = []
        s.settled_gain_steps = 0
        if s.drift_from is not None:
            # Each drift re-open doubles the wait before the next one, a false alarm (back where it started)
            # multiplies it by FALSE_ALARM_GROWTH; a real change of the link is still seen within a few times
            # as many steps as the run has had since the previous one.
            grow = FALSE_ALARM_GROWTH if cf == s.drift_from else 2
            s.reopen_gap = max(DRIFT_MIN_STEPS, grow * s.reopen_gap)
            s.drift_from = None
        s.reopen_at = self.step + s.reopen_gap
        # A higher CF timed in this search that lost only through its gain deficit may keep up once its
        # residual has built: retry it too, if the gain it had reached by the end of its trial (the residual
        # still building) would have won. A CF that loses even at that gain is in a near-tie at best: its
        # retries (a walk-up trial each, from the lower CF's residual) cost more than the tie can return.
        best = s.rates[cf].rate if cf in s.rates else s.best_rate
        for hi, r in sorted(s.rates.items()):
            if hi > cf and self.rungs.index(hi) <= s.top and r.judged_at >= s.search_step and r.gain < 1.0 \
                    and self._may_keep_up(r, best):
                self._note_gain_failure(hi)
                break
        if s.retry_rung is not None and s.retry_rung <= cf:
            s.retry_rung = None
        s.reason = "gain" if s.retry_rung is not None else "time"
        if s.retry_rung is not None:  # doubling gaps: a CF that keeps failing costs O(log steps) trials
            s.retry_gap = max(2 * self._window_at(self.step), 2 * s.retry_gap, self.step // 2)
            s.retry_at = self.step + s.retry_gap
        if log.isEnabledFor(logging.INFO):
            log.info("step %d: settled on %s (median step %.1f ms): %s; timed in this search: %s", self.step,
                     _cf_name(cf), 1e3 * st,
                     f"CF {s.retry_rung:g} kept too little of the gradient yet (retried at step {s.retry_at})"
                     if s.reason == "gain" else "the best throughput times the gradient kept",
                     ", ".join(f"{_cf_name(c)} {1e3 * t.step_time:.1f} ms" for c, t in sorted(s.rates.items())
                               if t.judged_at >= s.search_step) or "none")

    def _may_keep_up(self, r: Timing, best: float) -> bool:
        """Whether a CF timed at ``r`` that lost on its gain would beat ``best`` by more than omega at the gain
        it had reached by the end of its trial (a gain above 1 counts as 1)."""
        if not math.isfinite(r.end_gain):
            return False
        return r.per_step / r.step_time * min(1.0, r.end_gain) > best * (1.0 + self._omega)

    def _retry(self) -> None:
        """Try the CF above the settled one again (it failed the gain test before), walking up."""
        s = self.s
        cf = s.held
        i = self.rungs.index(cf)
        rate = s.rates[cf].rate if cf in s.rates else 0.0
        if cf in s.rates and s.recent:
            rate = self._rate_now(cf, step_time(s.recent))
        s.retry_rung = None
        if i + 1 <= s.top:
            self._start_search(i + 1, +1, best=cf, best_rate=rate,
                               why=f"CF {self.rungs[i + 1]:g} lost on its gain earlier, not on step time: retrying it")

    # ------------------------------------------------------------------ the optimizer's momentum
    def set_top(self, top: int, why: str) -> None:
        """Allow the rungs up to index ``top`` only; a trial or settled CF above it starts a search from ``top``
        walking down (as does a higher ``top``: the CFs it allows are worth a trial). Before the first search,
        only the bound changes."""
        s = self.s
        if top == s.top:
            return
        raised = top > s.top
        s.top = top
        if s.retry_rung is not None and self.rungs.index(s.retry_rung) > top:
            s.retry_rung = None
        if s.searches == 0:
            return
        current = s.trial.cf if s.trial is not None else s.held
        if raised or self.rungs.index(current) > top:
            s.drift_from = None
            self._start_search(top, -1, why=why)

    # ------------------------------------------------------------------ state
    def throughput_steps(self) -> dict[float, int]:
        return {}

    def load(self, st: LadderState) -> None:
        self.s = st


def _cf_name(cf: float) -> str:
    return "dense" if cf <= DENSE else f"CF {cf:g}"
