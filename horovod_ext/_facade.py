"""`AdaptiveCompression`: one documented class whose `policy=` picks the implementation.

Shared by the horovod.torch and horovod.tensorflow glue (each names its two implementations).
`policy="gravac"` (default) builds the framework's GraVAC compression with the given settings,
`policy="dqsgd"` its DQ-SGD compression. Horovod calls the chosen object's `compress`/`decompress`
directly (they are bound on the instance, so no extra frame sits between Horovod and them); every
other attribute (stats(), state_dict(), sync(), reset(), policy, ...) is the chosen object's.
"""

from __future__ import annotations

from typing import Any, ClassVar

from crossover.driver import DQSGD_PARAMS
from horovod_ext._class_guard import CompressionType

__all__ = ["AdaptiveFacade", "POLICIES", "check_policy", "dqsgd_call_error"]

POLICIES = ("gravac", "dqsgd")


def check_policy(policy: object, args: tuple[Any, ...]) -> None:
    """`policy=` is one of POLICIES, and DQ-SGD got no positional argument; ValueError saying what to pass."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if policy == "dqsgd" and args:
        raise ValueError("policy='dqsgd' quantizes: it takes no compressor name")


def dqsgd_call_error(exc: TypeError) -> ValueError:
    """A DQ-SGD call with a missing or unknown setting, as the ValueError that names DQ-SGD's settings."""
    return ValueError(f"policy='dqsgd': {exc} (DQ-SGD takes {DQSGD_PARAMS})")


class AdaptiveFacade(metaclass=CompressionType):
    """Base of the frameworks' `AdaptiveCompression`; subclasses set `_gravac` and `_dqsgd`."""

    _gravac: ClassVar[type]
    _dqsgd: ClassVar[type]

    def __init__(self, *args: Any, policy: str = "gravac", **settings: Any) -> None:
        check_policy(policy, args)
        if policy == "gravac":
            impl: Any = self._gravac(*args, **settings)
        else:
            try:
                impl = self._dqsgd(**settings)
            except TypeError as exc:
                raise dqsgd_call_error(exc) from None
        object.__setattr__(self, "_impl", impl)
        object.__setattr__(self, "compress", impl.compress)
        object.__setattr__(self, "decompress", impl.decompress)
        impl._hook_owner = self  # what Horovod holds (TensorFlow's frame lookup compares it)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_impl"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._impl, name, value)

    __hash__ = object.__hash__  # Horovod's TF glue keys a cache by the compression object

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self._impl).__name__})"
