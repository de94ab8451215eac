"""Which transport a compressed step uses: the cost model's cheapest in bytes, unless measured time says otherwise.

Plain numbers in, decisions out, like :class:`GravacPolicy`, and identical on every rank: it is fed the same
reduced step times as the CF policy, the CF policy's own state (settled, held CF, searches begun), and per step
the cost model's bytes per worker of every candidate transport at the CF sent (a function of the tensors'
sizes, k and the world size: the same on every rank). It never touches a tensor.

Per compressed CF:

* **default**: the candidate with the fewest predicted bytes, the earlier candidate on a tie (for rank-specific
  top-k: the sparse reduce-scatter from 3 ranks on Horovod, the agreed index set at any W >= 2 on the DDP hook,
  whose bytes per worker do not grow with W; the allgather of pairs grows linearly);
* **measured**: once the CF policy has settled on a CF and the default has been timed there for a window, each
  other candidate is timed for a window too, unless the cost model predicts it slower by more than omega:
  predicted time = the default's median + (its bytes - the default's) x the seconds per byte measured between
  the groups of steps seen so far (CFs and transports that sent different bytes). A candidate that sends more
  bytes replaces the default only when its median step time is lower by more than omega (fewer bytes is what
  keeps paying as workers are added, as the ladder prefers the lower CF within omega); one that sends fewer
  replaces it when it is no slower than omega allows;
* a candidate predicted to send exactly the current one's bytes is the same transport in effect (the sparse
  reduce-scatter on 2 ranks is the allgather) and is not timed;
* the decision holds until the CF policy begins another search.

Tunables: ``tunables.py`` (TRANSPORT_WINDOW, TRANSPORT_SKIP, TRANSPORT_HISTORY). See docs/scaling.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crossover.adaptive.gravac.tunables import TRANSPORT_HISTORY, TRANSPORT_SKIP, TRANSPORT_WINDOW
from crossover.adaptive.gravac.types import DENSE, is_real, median

__all__ = ["CfState", "TransportChoice"]

log = logging.getLogger("crossover.gravac")

_STATE_VERSION = 1


@dataclass(frozen=True)
class CfState:
    """What the transport choice reads of the CF policy after an observation (its ``summary()``)."""

    settled: bool
    held_cf: float
    searches: int

    @classmethod
    def of(cls, summary: Mapping[str, Any]) -> CfState:
        """From a CF policy's ``summary()`` (GravacPolicy, StaticPolicy: settled, always)."""
        searches = summary.get("searches")
        return cls(bool(summary.get("settled", False)), float(summary.get("send_cf", DENSE)),
                   int(searches) if isinstance(searches, int) and not isinstance(searches, bool) else 0)


@dataclass
class _Trial:
    cf: float
    transport: str
    against: str  # the transport it is timed against (the current one at cf)
    times: list[float] = field(default_factory=list)


class TransportChoice:
    """The transport per compressed CF among ``candidates`` (names; the first is preferred while nothing
    is known), judged on measured step times with tolerance ``omega``."""

    def __init__(self, candidates: Sequence[str], *, omega: float) -> None:
        cands = tuple(candidates)
        if not cands or not all(isinstance(c, str) and c for c in cands) or len(set(cands)) != len(cands):
            raise ValueError(f"candidates must be distinct non-empty names, got {candidates!r}")
        if not is_real(omega) or not 0.0 <= omega < 1.0:
            raise ValueError(f"omega must be in [0, 1), got {omega!r}")
        self.candidates = cands
        self.omega = float(omega)
        self._bytes: dict[float, dict[str, float]] = {}  # cf -> candidate -> predicted bytes per worker per step
        self._times: dict[tuple[float, str], list[float]] = {}  # (cf, transport) -> latest step times
        self._decided: dict[float, str] = {}  # cf -> transport, until the CF policy searches again
        self._judged: dict[float, set[str]] = {}  # cf -> candidates timed (or ruled out) against the default
        self._ref: list[float] = []  # the current transport's step times at the settled CF, before a trial
        self._ref_cf = DENSE
        self._trial: _Trial | None = None
        self._searches = 0

    # ------------------------------------------------------------------ decisions
    def plan(self, send_cf: float) -> str | None:
        """The transport for a step sending ``send_cf`` (None for a dense step). Pure."""
        if send_cf <= DENSE:
            return None
        if self._trial is not None and self._trial.cf == send_cf:
            return self._trial.transport
        return self._decided.get(send_cf) or self.default(send_cf)

    def default(self, cf: float) -> str:
        """The candidate with the fewest predicted bytes at ``cf`` (the first candidate while none is known)."""
        known = self._bytes.get(cf, {})
        if not all(c in known for c in self.candidates):
            return self.candidates[0]
        return min(self.candidates, key=lambda c: (known[c], self.candidates.index(c)))

    def observe(self, *, sent_cf: float, transport: str | None, step_time_s: float,
                predicted_bytes: Mapping[str, float], cf_state: CfState) -> None:
        """One observed step (in step order, as the CF policy observes it), then the CF policy's state."""
        if cf_state.searches != self._searches:  # a new search: the link or the gains moved, judge anew
            self._searches = cf_state.searches
            self._decided.clear()
            self._judged.clear()
            self._trial, self._ref = None, []
        t = float(step_time_s)
        if sent_cf <= DENSE or transport is None or not (math.isfinite(t) and t > 0.0):
            return
        clean = {str(k): float(v) for k, v in predicted_bytes.items()
                 if k in self.candidates and is_real(v) and v >= 0.0}  # the costs of other transports: not ours
        if clean:
            self._bytes[sent_cf] = clean
        times = self._times.setdefault((sent_cf, transport), [])
        times.append(t)
        del times[:-TRANSPORT_HISTORY]
        tr = self._trial
        if tr is not None:
            if (sent_cf, transport) == (tr.cf, tr.transport):
                tr.times.append(t)
                if len(tr.times) >= TRANSPORT_SKIP + TRANSPORT_WINDOW:
                    self._judge(tr)
            return
        if not cf_state.settled or sent_cf != cf_state.held_cf or transport != self.plan(sent_cf):
            return
        if self._ref and self._ref_cf != sent_cf:
            self._ref = []
        self._ref_cf = sent_cf
        self._ref.append(t)
        del self._ref[:-(TRANSPORT_SKIP + TRANSPORT_WINDOW)]
        if len(self._ref) >= TRANSPORT_SKIP + TRANSPORT_WINDOW:
            self._next_trial(sent_cf, transport)

    def _next_trial(self, cf: float, current: str) -> None:
        """Time the next candidate not yet judged at ``cf``, unless the cost model rules it out."""
        judged = self._judged.setdefault(cf, {current})
        ref = median(self._ref[TRANSPORT_SKIP:])
        for alt in self.candidates:
            if alt in judged:
                continue
            judged.add(alt)
            known = self._bytes.get(cf, {})
            if alt in known and current in known and known[alt] == known[current]:
                continue  # the same bytes to the byte: the same transport in effect (the reduce-scatter on 2 ranks)
            predicted = self._predict(cf, current, alt, ref)
            if predicted is not None and predicted > ref * (1.0 + self.omega):
                log.debug("CF %g: transport %s predicted %.1f ms against %s's %.1f ms: not timed", cf, alt,
                          1e3 * predicted, current, 1e3 * ref)
                continue
            self._trial = _Trial(cf, alt, current)
            log.info("CF %g: timing transport %s against %s (median %.1f ms)", cf, alt, current, 1e3 * ref)
            return
        self._decided[cf] = current
        self._ref = []

    def _predict(self, cf: float, current: str, alt: str, ref: float) -> float | None:
        """Predicted step time of ``alt`` at ``cf``: ``ref`` + (its bytes - current's) x measured seconds per
        byte; None when the bytes or the seconds per byte are not known."""
        known = self._bytes.get(cf, {})
        if current not in known or alt not in known:
            return None
        slope = self.seconds_per_byte()
        if slope is None:
            return None
        return ref + slope * (known[alt] - known[current])

    def seconds_per_byte(self) -> float | None:
        """Step time per byte between the two groups of observed steps (CF, transport) with the fewest and most
        predicted bytes, each with at least TRANSPORT_WINDOW steps; None while unknown or not positive."""
        groups = []
        for (cf, tr), times in self._times.items():
            b = self._bytes.get(cf, {}).get(tr)
            if b is not None and len(times) >= TRANSPORT_WINDOW:
                groups.append((b, median(times)))
        if len(groups) < 2:
            return None
        lo, hi = min(groups), max(groups)
        if not hi[0] > lo[0]:
            return None
        slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
        return slope if slope > 0.0 else None

    def _judge(self, tr: _Trial) -> None:
        """End of a trial: keep the faster as omega and the bytes say, then time the next candidate (if any)."""
        ref = median(self._ref[TRANSPORT_SKIP:])
        got = median(tr.times[TRANSPORT_SKIP:])
        known = self._bytes.get(tr.cf, {})
        lighter = tr.transport in known and tr.against in known and known[tr.transport] < known[tr.against]
        wins = got <= ref * (1.0 + self.omega) if lighter else got * (1.0 + self.omega) < ref
        log.info("CF %g: transport %s %.1f ms vs %s %.1f ms: %s", tr.cf, tr.transport, 1e3 * got, tr.against,
                 1e3 * ref, f"switching to {tr.transport}" if wins else f"keeping {tr.against}")
        self._trial = None
        if wins:
            self._ref = list(tr.times)  # the reference for any candidate still to time
        self._next_trial(tr.cf, tr.transport if wins else tr.against)

    # ------------------------------------------------------------------ telemetry and state
    def summary(self) -> dict[str, Any]:
        """Plain values: decisions per CF, the trial in progress, the measured seconds per byte."""
        return {"decided": dict(sorted(self._decided.items())),
                "trial": None if self._trial is None else {"cf": self._trial.cf, "transport": self._trial.transport,
                                                           "steps": len(self._trial.times)},
                "seconds_per_byte": self.seconds_per_byte()}

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {"version": _STATE_VERSION, "candidates": list(self.candidates), "omega": self.omega,
                "bytes": [[cf, dict(b)] for cf, b in sorted(self._bytes.items())],
                "times": [[cf, tr, list(ts)] for (cf, tr), ts in sorted(self._times.items())],
                "decided": [[cf, tr] for cf, tr in sorted(self._decided.items())],
                "judged": [[cf, sorted(s)] for cf, s in sorted(self._judged.items())],
                "ref": [self._ref_cf, list(self._ref)],
                "trial": None if self._trial is None else [self._trial.cf, self._trial.transport,
                                                            self._trial.against, list(self._trial.times)],
                "searches": self._searches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; everything is checked first (ValueError naming what is wrong)."""
        try:
            new = self._parse(state)
        except (KeyError, TypeError, AttributeError, IndexError) as exc:
            raise ValueError(f"not a valid transport choice state: {type(exc).__name__}: {exc}") from exc
        self.__dict__.update(new)

    def _parse(self, state: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"transport choice state must be a version {_STATE_VERSION} mapping, got {state!r:.80}")
        if list(state["candidates"]) != list(self.candidates) or state["omega"] != self.omega:
            raise ValueError(f"transport choice state is for candidates {state['candidates']!r}, omega "
                             f"{state['omega']!r}; this run has {list(self.candidates)!r}, {self.omega!r}")

        def cf(x: object) -> float:
            if not is_real(x) or x <= DENSE:
                raise ValueError(f"transport choice state: a CF must be a number > 1, got {x!r}")
            return float(x)

        def name(x: object) -> str:
            if x not in self.candidates:
                raise ValueError(f"transport choice state: unknown transport {x!r}")
            return str(x)

        def seconds(xs: object) -> list[float]:
            out = [float(v) for v in xs]  # type: ignore[union-attr]
            if not all(math.isfinite(v) and v > 0.0 for v in out):
                raise ValueError("transport choice state: step times must be finite and > 0")
            return out

        nbytes = {}
        for c, b in state["bytes"]:
            vals = {name(k): float(v) for k, v in b.items()}
            if not all(math.isfinite(v) and v >= 0.0 for v in vals.values()):
                raise ValueError("transport choice state: bytes must be finite and >= 0")
            nbytes[cf(c)] = vals
        trial = state["trial"]
        ref_cf, ref = state["ref"]
        searches = state["searches"]
        if isinstance(searches, bool) or not isinstance(searches, int) or searches < 0:
            raise ValueError(f"transport choice state: searches must be an int >= 0, got {searches!r}")
        return {"_bytes": nbytes,
                "_times": {(cf(c), name(t)): seconds(ts) for c, t, ts in state["times"]},
                "_decided": {cf(c): name(t) for c, t in state["decided"]},
                "_judged": {cf(c): {name(t) for t in ts} for c, ts in state["judged"]},
                "_ref_cf": DENSE if ref_cf == DENSE else cf(ref_cf), "_ref": seconds(ref),
                "_trial": None if trial is None else _Trial(cf(trial[0]), name(trial[1]), name(trial[2]),
                                                            seconds(trial[3])),
                "_searches": searches}
