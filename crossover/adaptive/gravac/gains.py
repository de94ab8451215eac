"""Compression gain: how much of the gradient a CF keeps, per step and smoothed.

Three definitions (docs/gravac.md), each a ratio of a numerator and a denominator read from
:class:`~crossover.adaptive.gravac.types.StepStats`:

* ``"delivered"`` (default): sqrt(sum ||C_cf(g + e)||^2 / sum ||g||^2), capped at 1: what is sent, against the
  fresh gradient (the residual it delivers counts);
* ``"norm"``: sqrt(sum ||C_cf(g + e)||^2 / sum ||g + e||^2): the paper's fraction of the norm kept;
* ``"authors"``: sum ||C_cf(g + e)|| / sum ||g||, as the GraVAC authors' code sums per-layer norms (may exceed 1).

``"norm"`` smooths the per-step ratio; the other two smooth numerator and denominator apart, then divide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from crossover.adaptive.gravac.types import StepStats, finite_nonneg, is_real

__all__ = ["GAINS", "GainBook"]

#: Names accepted for ``gain``.
GAINS = ("delivered", "authors", "norm")


@dataclass
class _Gain:
    """Smoothed gain of one CF: ``value`` is what decisions read; ``num`` and ``den`` the smoothed terms."""

    value: float
    count: int
    num: float = 0.0
    den: float = 0.0


class GainBook:
    """The smoothed gain of every CF ever probed, under one definition and one EWMA weight."""

    def __init__(self, kind: str, alpha: float) -> None:
        self.kind = kind
        self.alpha = alpha
        self._gains: dict[float, _Gain] = {}

    @property
    def needs_grad_norms(self) -> bool:
        """Whether the definition reads the raw gradient's norm (``grad_sq_norm``, ``grad_norm_sum``)."""
        return self.kind in ("delivered", "authors")

    def terms(self, stats: StepStats, cf: float) -> tuple[float, float] | None:
        """(numerator, denominator) of this step's gain of ``cf``; None where the step did not measure it."""
        if self.kind == "norm":
            num, den = stats.compressed_sq_norms.get(cf), stats.dense_sq_norm
        elif self.kind == "authors":
            num, den = stats.compressed_norm_sums.get(cf), stats.grad_norm_sum
        else:
            num, den = stats.compressed_sq_norms.get(cf), stats.grad_sq_norm
        if num is None or not (finite_nonneg(num) and finite_nonneg(den) and den > 0.0):
            return None
        return float(num), float(den)

    def ratio(self, num: float, den: float) -> float:
        """Gain from (possibly summed or smoothed) numerator and denominator."""
        if self.kind == "authors":
            return num / den  # the authors' ratio of summed norms: may exceed 1
        return min(1.0, math.sqrt(num / den))

    def update(self, stats: StepStats) -> dict[float, float]:
        """Smooth in every CF the step measured; return this step's raw gain of each."""
        measured: dict[float, float] = {}
        for cf in sorted(set(stats.compressed_sq_norms) | set(stats.compressed_norm_sums)):
            if not (math.isfinite(cf) and cf >= 1.0):
                continue
            terms = self.terms(stats, cf)
            if terms is None:
                continue
            num, den = terms
            gain = self.ratio(num, den)
            measured[cf] = gain
            old = self._gains.get(cf)
            if old is None:
                self._gains[cf] = _Gain(value=gain, count=1, num=num, den=den)
                continue
            a = self.alpha
            old.count += 1
            if self.kind == "norm":
                old.value += a * (gain - old.value)
            else:
                old.num += a * (num - old.num)
                old.den += a * (den - old.den)
                old.value = self.ratio(old.num, old.den)
        return measured

    def get(self, cf: float) -> float | None:
        """Smoothed gain of ``cf``; None before it was measured."""
        g = self._gains.get(cf)
        return None if g is None else g.value

    def values(self) -> dict[float, float]:
        """Smoothed gain of every CF measured, ascending CF (a copy)."""
        return {cf: g.value for cf, g in sorted(self._gains.items())}

    # ------------------------------------------------------------------ state
    def to_state(self) -> list[list[float]]:
        return [[cf, g.value, g.count, g.num, g.den] for cf, g in sorted(self._gains.items())]

    @staticmethod
    def check_state(rows: Any) -> dict[float, _Gain]:
        """Saved rows as gains; ValueError for anything no run could have saved (nothing is applied)."""
        out: dict[float, _Gain] = {}
        for row in rows:
            if not isinstance(row, (list, tuple)) or len(row) != 5:
                raise ValueError(f"GravacPolicy state: bad gain entry {row!r}")
            cf, value, count, num, den = row
            if not (is_real(cf) and cf >= 1 and is_real(value) and value >= 0 and isinstance(count, int)
                    and not isinstance(count, bool) and count >= 0 and is_real(num) and is_real(den)):
                raise ValueError(f"GravacPolicy state: bad gain entry {row!r}")
            out[float(cf)] = _Gain(float(value), int(count), float(num), float(den))
        return out

    def load(self, gains: dict[float, _Gain]) -> None:
        self._gains = gains
