"""Shared by the policies' checkpoints: a saved state must match the policy restoring it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self


def check_saved_state(kind: str, state: Mapping[str, Any], version: int, config: Mapping[str, Any]) -> None:
    """Raise ValueError unless ``state`` has ``version`` and was saved with exactly ``config``."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{kind} state must be a mapping, got {type(state).__name__}")
    if state.get("version") != version:
        raise ValueError(f"unsupported {kind} state version {state.get('version')!r}")
    if not isinstance(state.get("config"), Mapping):
        raise ValueError(f"{kind} state: config must be a mapping of settings, got {state.get('config')!r}")
    saved = dict(state["config"])
    diff = sorted(k for k in set(config) | set(saved) if saved.get(k) != config.get(k))
    if diff:
        detail = ", ".join(f"{k}: saved {saved.get(k)!r} vs {config.get(k)!r}" for k in diff)
        raise ValueError(f"state_dict config differs from this policy's: {detail}")


class Restorable:
    """A policy whose ``state_dict()`` keeps its constructor's settings under "config"."""

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Self:
        """Build a policy with the saved config and restore its state."""
        policy = cls(**dict(state["config"]))
        policy.load_state_dict(state)  # type: ignore[attr-defined]
        return policy
