"""`stats()` is flat: every value a scalar (int, float, bool, str or None), nested details under `/` keys.

A policy's summary ``{"settled": True, "gains": {10.0: 0.93}}`` becomes ``policy/settled`` and
``policy/gains/10``: a CF key is written as an int when it is one (``10``), else as Python writes the float
(``12.5``); a list gives ``name/0``, ``name/1``. So a loop over ``stats().items()`` that keeps the numbers
(``isinstance(v, (int, float))``: bools count as 0/1) can hand each to ``SummaryWriter.add_scalar``.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

__all__ = ["flat_stats", "flatten"]


def flat_stats(top: dict[str, Any], **nested: Any) -> dict[str, Any]:
    """`top` (already scalars) plus each `nested` mapping flattened under its name; None adds nothing."""
    for name, value in nested.items():
        if value is not None:
            flatten(name, value, top)
    return top


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Write `value` into `out` under `prefix`, nested mappings and sequences as `prefix/key` entries."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            flatten(f"{prefix}/{_key(k)}", v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            flatten(f"{prefix}/{i}", v, out)
    elif value is None or isinstance(value, (bool, int, float, str)):
        out[prefix] = value
    elif isinstance(value, numbers.Integral):  # numpy integers
        out[prefix] = int(value)
    elif isinstance(value, numbers.Real):
        out[prefix] = float(value)
    elif callable(getattr(value, "item", None)) and getattr(value, "ndim", None) == 0:  # numpy bool, 0-d arrays
        out[prefix] = value.item()
    else:
        out[prefix] = str(value)


def _key(k: Any) -> str:
    if isinstance(k, float) and k.is_integer():
        return str(int(k))
    return str(k)
