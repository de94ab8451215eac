"""Refuse `compression=AdaptiveCompression` (the class) where Horovod needs a compression object.

Horovod's own compressions are classes with static methods (`hvd.Compression.fp16`), so users pass
a class out of habit. crossover's compressions keep state (step counter, policy, error-feedback
residuals, byte counters) that belongs to one optimizer, so a class is refused, never used:
* when the optimizer or tape is built: `guard_constructors` wraps Horovod's public constructors
  (`hvd.DistributedOptimizer`, `DistributedGradientTape`, ...) to check their `compression` argument;
  the glue installs it when it is imported (horovod_ext/_torch_host.py, _tf_host.py, keras_guard.py);
* otherwise (a constructor bound before crossover's glue was imported, `hvd.allreduce(...,
  compression=cls)`, or a class from `from crossover import ...` taken before Horovod was imported),
  at the first `compress`: every crossover compression class has the metaclass `CompressionType`,
  whose class-level `compress`/`decompress` raise the same message instead of an AttributeError.
Instances are untouched: the metaclass only changes attribute lookups on the class itself.
Importing this module imports neither torch nor TensorFlow nor Horovod.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, NoReturn

__all__ = ["CLASS_MESSAGE", "CompressionClassError", "CompressionType", "check_compression", "guard_constructors"]

CLASS_MESSAGE = (
    "crossover: compression={name} passes the class, and crossover's compressions are objects that keep state "
    "(policy, step counter, error-feedback residuals, byte counters). Pass an instance: compression={name}() "
    "(settings, if any, go in the parentheses), one per optimizer for the adaptive, static and quantizing ones. "
    "Horovod's own hvd.Compression.fp16 / .none are classes; crossover's are not.")


class CompressionClassError(TypeError, AttributeError):
    """A crossover compression class was used where an object is needed.

    A TypeError (the wrong kind of argument) that is also an AttributeError, so `hasattr(cls, "compress")`
    stays False and introspection (help, inspect) keeps working on the classes."""


def _refuse(cls: type) -> NoReturn:
    raise CompressionClassError(CLASS_MESSAGE.format(name=cls.__name__))


class CompressionType(type):
    """Metaclass of crossover's compression classes: `Cls.compress(...)` raises CLASS_MESSAGE."""

    @property
    def compress(cls) -> NoReturn:
        _refuse(cls)

    @property
    def decompress(cls) -> NoReturn:
        _refuse(cls)


def check_compression(compression: Any) -> None:
    """Raise CompressionClassError when `compression` is a crossover compression class, not an object."""
    if isinstance(compression, CompressionType):
        _refuse(compression)


def _guarded(original: Callable[..., Any]) -> Callable[..., Any]:
    try:
        signature: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        compression = kwargs.get("compression")
        if compression is None and signature is not None:
            try:
                compression = signature.bind_partial(*args, **kwargs).arguments.get("compression")
            except TypeError:
                compression = None  # bad arguments: Horovod's own call says what is wrong
        check_compression(compression)
        return original(*args, **kwargs)

    guarded._crossover_class_guard = True  # type: ignore[attr-defined]
    return guarded


def guard_constructors(module: Any, names: tuple[str, ...]) -> None:
    """Wrap `module.<name>` for each name it has, so that a crossover class as `compression=` is refused
    when the object is built. Idempotent; classes (not functions) and missing names are left alone."""
    for name in names:
        original = getattr(module, name, None)
        if not inspect.isfunction(original) or getattr(original, "_crossover_class_guard", False):
            continue
        setattr(module, name, _guarded(original))
