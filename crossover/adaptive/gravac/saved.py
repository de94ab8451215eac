"""Strict reading of a saved policy state: every field present, of its type, in its range.

A checkpoint may come from a crashed run, another version or a careless edit; loading it must either restore a
state some run could have reached or raise ValueError naming the field, with nothing applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from crossover.adaptive.gravac.types import is_int, is_real

__all__ = ["StateReader"]


class StateReader:
    """Typed accessors over a saved state mapping; each raises ValueError naming the bad field."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self._state = state

    def _get(self, name: str) -> Any:
        if name not in self._state:
            raise ValueError(f"GravacPolicy state: missing field {name!r}")
        return self._state[name]

    def _bad(self, name: str, want: str) -> ValueError:
        return ValueError(f"GravacPolicy state: {name} must be {want}, got {self._state[name]!r}")

    def real(self, name: str, lo: float) -> float:
        v = self._get(name)
        if not (is_real(v) and v >= lo):
            raise self._bad(name, f"a finite number >= {lo:g}")
        return float(v)

    def cf(self, name: str, hi: float) -> float:
        v = self._get(name)
        if not (is_real(v) and 1.0 <= v <= hi):
            raise self._bad(name, f"a CF in [1, cf_max={hi:g}]")
        return float(v)

    def optional_cf(self, name: str, hi: float) -> float | None:
        return None if self._get(name) is None else self.cf(name, hi)

    def count(self, name: str) -> int:
        v = self._get(name)
        if not (is_int(v) and v >= 0):
            raise self._bad(name, "an int >= 0")
        return int(v)

    def flag(self, name: str) -> bool:
        v = self._get(name)
        if not isinstance(v, bool):
            raise self._bad(name, "true or false")
        return v

    def text(self, name: str, allowed: tuple[str, ...]) -> str:
        v = self._get(name)
        if v not in allowed:
            raise self._bad(name, f"one of {allowed}")
        return str(v)

    def times(self, name: str, values: Any = None) -> list[float]:
        """A list of finite numbers >= 0 (step times)."""
        v = self._get(name) if values is None else values
        if not isinstance(v, (list, tuple)) or not all(is_real(x) and x >= 0 for x in v):
            raise ValueError(f"GravacPolicy state: {name} must be a list of finite numbers >= 0, got {v!r}")
        return [float(x) for x in v]

    def rows(self, name: str, width: int) -> list[list[Any]]:
        """A list of lists of ``width`` values each (checked by the caller)."""
        v = self._get(name)
        if not isinstance(v, (list, tuple)) or not all(isinstance(r, (list, tuple)) and len(r) == width for r in v):
            raise ValueError(f"GravacPolicy state: {name} must be a list of {width}-value entries, got {v!r}")
        return [list(r) for r in v]

    def cf_lists(self, name: str, hi: float) -> dict[float, list[float]] | None:
        """``[[cf, [times...]], ...]`` as a dict; None when saved as None."""
        v = self._get(name)
        if v is None:
            return None
        out: dict[float, list[float]] = {}
        for row in self.rows(name, 2):
            cf, xs = row
            if not (is_real(cf) and 1.0 <= cf <= hi):
                raise ValueError(f"GravacPolicy state: {name} entry CF {cf!r} outside [1, cf_max={hi:g}]")
            out[float(cf)] = self.times(name, xs)
        return out
