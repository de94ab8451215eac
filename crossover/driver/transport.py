"""Every transport decision, in one vocabulary (``cost_model``'s names: dense, allreduce, allgather, agreed, scatter).

* **what the user may ask for** (``TRANSPORTS``, ``QUANT_TRANSPORTS``, ``check_transport``) and each host's default;
* **the cost-model rule** per tensor (``sparse_route``, ``quant_route``): what a tensor of this size at this k or
  these bits sends, the fewest bytes (pure functions of sizes, k, bits and the world size: identical on every rank);
* **the timed choice** (``TransportChoice``) of ``transport="auto"``: the cost model's cheapest in bytes, unless
  measured step times say otherwise. Plain numbers in, decisions out, like the CF policies, and identical on every
  rank: it is fed the same reduced step times as the CF policy, the CF policy's own state (settled, held CF,
  searches begun), and per step the cost model's bytes per worker of every candidate transport at the CF sent.

The codecs take the decided transport; the step session (``session.py``) asks here and hands it to them.

The timed choice, per compressed CF:

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
* the decision holds until the CF policy begins another search. See docs/scaling.md.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from crossover.adaptive.gravac.types import DENSE, is_real, median
from crossover.compression import cost_model
from crossover.compression.cost_model import AGREED, ALLGATHER, ALLREDUCE, SCATTER
from crossover.compression.wire import k_for

__all__ = ["ALLTOALL_DEFAULT_TRANSPORT", "CfState", "DEFAULT_TRANSPORT", "QUANT_TRANSPORTS", "TRANSPORTS",
           "TransportChoice", "auto_candidates", "candidate_costs", "check_quant_transport", "check_transport",
           "choose_transport", "quant_route", "sparse_route"]

#: ``transport=`` of a rank-specific selector (top-k, DGC, RedSync): "auto" (the cost model's cheapest, then
#: measured time: ``TransportChoice``), "agreed" (always the agreed index set), "scatter" (always the sparse
#: reduce-scatter; hosts with an alltoall: Horovod) or "allgather" (always each rank's own pairs).
#: Shared-index selectors (random-k) always allreduce: pass None.
TRANSPORTS = ("auto", AGREED, SCATTER, ALLGATHER)
#: The DDP hook's default: each rank's own pairs ("auto" and "agreed" are opt-in: the agreed set at CF 10 lost
#: 1.3-1.4 points against dense on 4-8 ranks, reports/transport-study.md).
DEFAULT_TRANSPORT = ALLGATHER
#: Horovod's default (a host with an alltoall): "auto" over the sparse reduce-scatter and the allgather, which kept
#: the allgather's accuracy at CF 10 and 100 on 4 and 8 ranks at 0.21x dense's bytes (reports/transport-study.md).
ALLTOALL_DEFAULT_TRANSPORT = "auto"
#: ``transport=`` of the quantizers: "auto" (the fewer bytes of the two), packed codes by allgather, or
#: dequantized fp16 values by allreduce.
QUANT_TRANSPORTS = ("auto", ALLGATHER, ALLREDUCE)

#: Steps each transport is timed for at a settled CF: twice the shortest CF window (a median of 4 is noise).
TRANSPORT_WINDOW = 8
#: Steps at the start of a transport's window that are not timed: a switch renegotiates the collectives.
TRANSPORT_SKIP = 1
#: Step times kept per (CF, transport) for the seconds-per-byte estimate: recent enough to follow the link.
TRANSPORT_HISTORY = 32


def auto_candidates(alltoall: bool) -> tuple[str, str]:
    """What ``transport="auto"`` chooses between: the allgather and the sparse reduce-scatter on a host with an
    alltoall (Horovod; the allgather first: on 2 ranks, where the two send the same bytes, it is the one used),
    else the agreed index set and the allgather (the DDP hook)."""
    return (ALLGATHER, SCATTER) if alltoall else (AGREED, ALLGATHER)


def check_transport(transport: object, *, none_ok: bool = False) -> str | None:
    """`transport` if it is one of TRANSPORTS (or None where `none_ok`), else ValueError naming the choices."""
    if (transport is None and none_ok) or (isinstance(transport, str) and transport in TRANSPORTS):
        return transport
    raise ValueError(f"transport must be one of {', '.join(repr(t) for t in TRANSPORTS)}"
                     f"{' (or None for a shared-index compressor)' if none_ok else ''}, got {transport!r}")


def check_quant_transport(transport: object) -> str:
    """`transport` if it is one of QUANT_TRANSPORTS, else ValueError naming the choices."""
    if isinstance(transport, str) and transport in QUANT_TRANSPORTS:
        return transport
    raise ValueError(f"transport must be one of {', '.join(QUANT_TRANSPORTS)}; got {transport!r}")


# ---------------------------------------------------------------------------------------------
# The cost-model rules, per tensor
# ---------------------------------------------------------------------------------------------
def choose_transport(numel: int, k: int, world_size: int, shared_indices: bool, asked: str | None = None) -> str:
    """DENSE, ALLREDUCE, ALLGATHER, AGREED or SCATTER for a tensor of ``numel`` elements compressed to ``k``.

    Shared indices sum correctly, so they always go by allreduce of k values. Rank-specific selections
    go by ALLGATHER, or by AGREED or SCATTER when ``asked`` (the step's plan asks for it), as long as it sends
    fewer bytes than the dense allreduce; beyond that the tensor goes dense (exact). SCATTER needs every owner
    to hold an index (``numel >= W``) and three ranks: on two it receives the allgather's bytes in two
    collectives instead of one, so it is the allgather there.
    A pure function of its arguments: identical on every rank.
    """
    if world_size < 1 or numel < 1 or k < 1:
        raise ValueError(f"need world_size, numel and k >= 1, got {world_size}, {numel}, {k}")
    if asked not in (None, ALLGATHER, AGREED, SCATTER):
        raise ValueError(f"asked must be None, {ALLGATHER!r}, {AGREED!r} or {SCATTER!r}, got {asked!r}")
    if k >= numel:
        return cost_model.DENSE
    if shared_indices:
        return ALLREDUCE
    if asked == SCATTER and (world_size < 3 or numel < world_size):
        asked = None
    if asked in (AGREED, SCATTER):
        dense = cost_model.transport_cost(cost_model.DENSE, numel, k, world_size).bytes
        return asked if cost_model.transport_cost(asked, numel, k, world_size).bytes < dense else cost_model.DENSE
    # the pairs alone against the dense values alone (horovod_ext/tf_compression.py's graph has the same rule)
    if cost_model.allgather_bytes(k, world_size) < cost_model.allreduce_bytes(numel, world_size):
        return ALLGATHER
    return cost_model.DENSE


@functools.lru_cache(maxsize=4096)  # called per gradient with few distinct arguments: a hit skips the arithmetic
def sparse_route(numel: int, world: int, sent_cf: float, probes: tuple[float, ...], planned: str | None,
                 shared_indices: bool, alltoall: bool) -> tuple[str, int]:
    """(transport, k) of one tensor of ``numel`` elements in a step that sends ``sent_cf``, probes ``probes`` and
    asks for the transport ``planned`` (the step driver's record's fields; None: the cost model's):
    ``choose_transport`` at that CF.

    The agreed set holds k indices of the lowest level, so it serves only plans that send it; the sparse
    reduce-scatter needs a host with an alltoall (``alltoall``). A dense step sends all ``numel`` (DENSE)."""
    compressed = sent_cf > 1
    k = k_for(numel, sent_cf) if compressed else numel
    planned = planned if compressed else None
    if planned == AGREED and sent_cf != min(cf for cf in (*probes, sent_cf) if cf > 1):
        planned = None
    if planned == SCATTER and not alltoall:
        raise RuntimeError("crossover compression: transport 'scatter' needs a host with an alltoall (Horovod); "
                           "use transport='allgather' or 'agreed' here")
    return choose_transport(numel, k, world, shared_indices, planned if planned in (AGREED, SCATTER) else None), k


def candidate_costs(numel: int, k: int, world: int, nstats: int) -> dict[str, float]:
    """Bytes per worker of one tensor sent at k elements by each transport a rank-specific selector can use
    (each falling back to dense where that is cheaper, as `choose_transport` does): what the timed choice weighs."""
    out = {}
    for kind in (AGREED, SCATTER, ALLGATHER):
        real = choose_transport(numel, k, world, False, kind)
        out[kind] = cost_model.transport_cost(real, numel, k, world, nstats).bytes
    return out


def quant_route(setting: str, numel: int, bits: int, world: int) -> str:
    """The quantizers' transport of one tensor: the user's ``setting``, or for "auto" ALLGATHER of the packed codes
    and their scale or ALLREDUCE of fp16 values, whichever sends fewer bytes (torch and TensorFlow alike)."""
    if setting != "auto":
        return setting
    packed = (numel * bits + 7) // 8  # quantize.packed_nbytes
    gather = cost_model.allgather_bytes(packed + 4, world, 1)
    return ALLGATHER if gather < cost_model.allreduce_bytes(numel, world, 2) else ALLREDUCE


# ---------------------------------------------------------------------------------------------
# The timed choice of transport="auto"
# ---------------------------------------------------------------------------------------------
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
