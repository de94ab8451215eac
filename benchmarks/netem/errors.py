"""The one exception type of :mod:`benchmarks.netem` (its own module so every part can raise it)."""

from __future__ import annotations

__all__ = ["NetemError"]


class NetemError(RuntimeError):
    """Setting up or tearing down the emulated network failed (the message says which command)."""
