"""A fixed compression factor behind the same plan/observe interface as the adaptive policies.

Static compressors (top-k 100x, random-k 10x, ...) reuse the whole AdaptiveCompression machinery
with this policy, so static and adaptive runs differ only in the decisions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .gravac import Plan, StepStats

__all__ = ["StaticPolicy"]


class StaticPolicy:
    """Always send at `cf` (1.0 = dense); measures nothing."""

    def __init__(self, *, cf: float) -> None:
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf) or cf < 1:
            raise ValueError(f"cf (compression factor) must be a finite number >= 1, got {cf!r}")
        self._cf = float(cf)
        self._step = 0

    def plan(self) -> Plan:
        """The same plan every step: send at cf, probe only what is sent."""
        return Plan(send_cf=self._cf, probe_cfs=(self._cf,) if self._cf > 1 else ())

    def observe(self, stats: StepStats) -> None:
        """Count the step; a static policy learns nothing."""
        self._step += 1

    @property
    def step(self) -> int:
        return self._step

    def summary(self) -> dict[str, Any]:
        return {"step": self._step, "send_cf": self._cf, "settled": True}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "static", "cf": self._cf, "step": self._step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "static" or float(state.get("cf", -1)) != self._cf:
            raise ValueError(f"state is not a StaticPolicy(cf={self._cf}) state: {dict(state)!r}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"StaticPolicy state: step must be an int >= 0, got {step!r}")
        self._step = step
