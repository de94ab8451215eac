"""What the GraVAC policy takes and gives, and the checks its settings and saved states share.

:class:`Plan` is the policy's decision for one step, :class:`StepStats` the global statistics of one step that
the caller feeds back. Both are plain numbers: the policy never touches a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["DENSE", "Plan", "StepStats", "finite_nonneg", "is_int", "is_real", "median"]

#: The compression factor of an uncompressed (dense) step.
DENSE = 1.0


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
        return self.send_cf == DENSE

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
    ``momentum``: the optimizer's momentum m, mean over ranks (Adam: beta1), or NaN when not reported. The
    optimizer carries each delivered update into later steps, multiplying its weight by 1 / (1 - m): the ladder
    caps the CF by it (``ladder.py``, ``momentum_cap``).

    The last five default to "not measured" (NaN, empty): a gain definition that needs a missing number
    simply has no measurement on that step. Values that are not finite, or negative, are ignored by the
    policy (a NaN gradient on one step must not crash training); a zero denominator carries no gain
    information and is skipped. A step that measured nothing (dense, no probes) still counts: its time and
    samples feed the throughput.
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
    momentum: float = math.nan

    def __post_init__(self) -> None:
        # Freeze private copies so a caller mutating its dict cannot change a recorded step.
        for name in ("compressed_sq_norms", "compressed_norm_sums"):
            frozen = MappingProxyType({float(k): float(v) for k, v in getattr(self, name).items()})
            object.__setattr__(self, name, frozen)


def finite_nonneg(x: float) -> bool:
    """A finite number >= 0."""
    return math.isfinite(x) and x >= 0.0


def is_int(x: object) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def median(xs: list[float]) -> float:
    """The median of a non-empty list (the mean of the middle two for an even count)."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
