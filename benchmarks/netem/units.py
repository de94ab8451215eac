"""Rates and durations in ``tc``'s units: parse what users type, format what ``tc`` is given.

Used by :mod:`benchmarks.netem.namespaces` (shaping) and by the command lines that validate
``--rate`` / ``--bandwidth`` / ``--delay`` before building anything. Pure functions, no root needed.
"""

from __future__ import annotations

import re

__all__ = ["fmt_rate", "fmt_time", "parse_rate", "parse_time"]



_RATE_UNITS = {
    "": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2.0**10, "mibit": 2.0**20, "gibit": 2.0**30, "tibit": 2.0**40,
    "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2.0**10, "mibps": 8 * 2.0**20, "gibps": 8 * 2.0**30, "tibps": 8 * 2.0**40,
}
_TIME_UNITS = {
    "s": 1.0, "sec": 1.0, "secs": 1.0, "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
    "us": 1e-6, "usec": 1e-6, "usecs": 1e-6, "": 1e-6,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_rate(rate: str | float) -> float:
    """Return a rate in bits per second, parsed with ``tc``'s units.

    ``"200mbit"`` -> 2e8, ``"1gbit"`` -> 1e9, ``"10mbps"`` -> 8e7 (``bps`` is *bytes* per second in
    ``tc``), a bare number is bits per second.
    """
    if isinstance(rate, (int, float)):
        value, unit = float(rate), ""
    else:
        m = _NUMBER_UNIT.match(rate)
        if not m or m.group(2).lower() not in _RATE_UNITS:
            raise ValueError(f"cannot parse rate {rate!r} (use tc units, e.g. 200mbit, 1gbit, 10mbps)")
        value, unit = float(m.group(1)), m.group(2).lower()
    bits = value * _RATE_UNITS[unit]
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is too low (at least 8kbit)")
    return bits


def parse_time(value: str | float) -> float:
    """Return a duration in seconds, parsed with ``tc``'s units (``"1ms"``, ``"250us"``, ``"0.1s"``).

    A bare string number is microseconds, as in ``tc``; a Python number is seconds.
    """
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _NUMBER_UNIT.match(value)
        if not m or m.group(2).lower() not in _TIME_UNITS:
            raise ValueError(f"cannot parse time {value!r} (use tc units, e.g. 1ms, 250us, 0.1s)")
        seconds = float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    if seconds < 0:
        raise ValueError(f"negative time {value!r}")
    return seconds


def fmt_rate(bits: float) -> str:
    return f"{int(round(bits))}bit"


def fmt_time(seconds: float) -> str:
    return f"{int(round(seconds * 1e6))}us"
