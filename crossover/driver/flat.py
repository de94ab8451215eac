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

__all__ = ["USER_KEYS", "flat_stats", "flatten", "user_stats"]

#: What `stats()` shows a user (documented in docs/compression.md, "Telemetry and state"); `stats(debug=True)` adds
#: the policy's internals (`policy/...`, `transport_choice/...`, `saturated_steps`), which change as the policy does.
USER_KEYS = ("step", "compression_factor", "bits", "gain", "bytes_sent", "bytes_dense", "nonfinite_steps",
             "compressor", "transport")
#: Policy details a user asks about, under plain names: has the search settled, why (its step time or the gain),
#: the CF cap and the momentum that set it.
_PROMOTED = (("policy/settled", "settled"), ("policy/settled_reason", "settled_reason"), ("policy/max_cf", "max_cf"),
             ("policy/momentum", "momentum"))
_MOMENTUM_DIGITS = 6  # an optimizer's float32 0.9 reads 0.8999999761581421: shown as 0.9


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


def user_stats(full: dict[str, Any], debug: bool = False) -> dict[str, Any]:
    """The user-facing view of a compression's flat `full` statistics (`USER_KEYS` and the promoted policy
    details, momentum rounded), or `full` itself with `debug`."""
    if debug:
        return full
    out = {k: full[k] for k in USER_KEYS if k in full}
    for src, name in _PROMOTED:
        if src in full:
            v = full[src]
            out[name] = round(v, _MOMENTUM_DIGITS) if name == "momentum" and isinstance(v, float) else v
    return out
