"""Checks of the settings every compression object shares (codecs, step drivers, framework glue), at construction.

A setting that Python would coerce silently is refused instead: ``bool("False")`` is True, ``int(1.5)`` is 1,
``int("0")`` is 0. Each check raises ValueError naming the setting and what to pass.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["SEED_MAX", "check_flag", "check_int", "check_real", "check_seed"]

#: Seeds are mixed into 63-bit per-(step, tensor) seeds (``wire.shared_seed``) and saved in checkpoints as
#: JSON-able ints: one signed 64-bit range keeps them exact everywhere.
SEED_MAX = 2 ** 63 - 1


def check_flag(name: str, value: object) -> bool:
    """`value` if it is a bool (numpy's too), else ValueError: ``enabled="False"`` would read as true."""
    kind = type(value)
    if isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def check_seed(value: object, name: str = "seed") -> int:
    """`value` as an int in [-2**63, 2**63 - 1] (numpy integers too), else ValueError (no float, str or bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not -SEED_MAX - 1 <= value <= SEED_MAX:
        raise ValueError(f"{name} must be an int in [-2**63, 2**63 - 1], the same on every rank; got {value!r}")
    return int(value)


def check_int(what: str, v: object, lo: int) -> int:
    """`v` as an int (numpy integers too) if it is one and >= lo, else ValueError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")
    return int(v)


def check_real(what: str, v: object, lo: float) -> float:
    """`v` as a float if it is a finite real number >= lo, else ValueError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < lo:
        raise ValueError(f"{what} must be a finite number >= {lo:g}, got {v!r}")
    return float(v)
