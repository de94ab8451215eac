"""Wrap horovod.tensorflow.keras.DistributedOptimizer: refuse Keras 3 optimizers, show ours the optimizer.

`horovod.tensorflow.keras.DistributedOptimizer` only synchronizes tf-keras (Keras 2) optimizers. With
TensorFlow >= 2.16, `tf.keras` is Keras 3 unless `TF_USE_LEGACY_KERAS=1` is set (with the `tf-keras`
package installed), and Horovod's wrapper then silently skips the allreduce. `install_keras_guard()`
wraps Horovod's function (a patch of Horovod: checked against its version in horovod_ext/_internals.py);
`check_keras_optimizer(opt)` does the same check on its own. The wrapper also hands the optimizer to a
`compression=` object of ours (its `_optimizer_seen`), which reads the optimizer's momentum as the torch
objects do at every step: the ladder's cap (docs/accuracy.md). Nothing here imports torch.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any

from horovod_ext._class_guard import guard_constructors
from horovod_ext._internals import check_version

__all__ = ["KERAS3_MESSAGE", "KerasVersionError", "check_keras_optimizer", "install_keras_guard"]

log = logging.getLogger(__name__)

KERAS3_MESSAGE = (
    "horovod.tensorflow.keras.DistributedOptimizer got a Keras 3 optimizer ({cls}). Horovod 0.28.1 cannot "
    "hook Keras 3 optimizers: training would run WITHOUT synchronizing gradients across ranks. Use Keras 2 "
    "(tf-keras): `pip install tf-keras` (the version matching TensorFlow) and set TF_USE_LEGACY_KERAS=1 in "
    "the environment before TensorFlow is imported (then tf.keras is tf-keras), and build the model and "
    "optimizer with tf.keras. Or keep Keras 3 and use horovod.tensorflow.DistributedGradientTape in a custom "
    "training step."
)


class KerasVersionError(RuntimeError):
    """A Keras 3 optimizer was given to Horovod's Keras wrapper, which would not synchronize it."""


def is_keras3_optimizer(optimizer: Any) -> bool:
    """True when `optimizer` is a Keras 3 optimizer (module `keras...` with keras >= 3), not tf-keras."""
    for cls in type(optimizer).__mro__:
        mod = getattr(cls, "__module__", "") or ""
        if mod == "keras" or mod.startswith("keras."):
            keras = sys.modules.get("keras")
            version = getattr(keras, "__version__", "0")
            try:
                return int(str(version).split(".")[0]) >= 3
            except ValueError:
                return False
    return False


def check_keras_optimizer(optimizer: Any) -> None:
    """Raise KerasVersionError when Horovod's Keras DistributedOptimizer would not synchronize `optimizer`."""
    if is_keras3_optimizer(optimizer):
        raise KerasVersionError(KERAS3_MESSAGE.format(cls=f"{type(optimizer).__module__}.{type(optimizer).__name__}"))


def _show_optimizer(original: Any, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Hand `optimizer` to the `compression=` of a DistributedOptimizer call when it is one of ours."""
    try:
        bound = inspect.signature(original).bind_partial(optimizer, *args, **kwargs)
    except (TypeError, ValueError):  # Horovod will say what is wrong with the call
        return
    seen = getattr(bound.arguments.get("compression"), "_optimizer_seen", None)
    if callable(seen):
        seen(optimizer)


def install_keras_guard() -> bool:
    """Make horovod.tensorflow.keras.DistributedOptimizer (and horovod.keras's) refuse Keras 3 optimizers.

    Idempotent; returns False when horovod.tensorflow.keras cannot be imported here.
    """
    if not check_version("the Keras 3 guard on horovod.tensorflow.keras.DistributedOptimizer"):
        return False
    try:
        import horovod.tensorflow.keras as hvd_keras
    except Exception as exc:  # Horovod built without TensorFlow, or Keras missing
        log.debug("horovod.tensorflow.keras not importable (%s): no Keras guard installed", exc)
        return False
    modules = [hvd_keras]
    if "horovod.keras" in sys.modules:
        modules.append(sys.modules["horovod.keras"])
    for mod in modules:
        original = getattr(mod, "DistributedOptimizer", None)
        if original is None or getattr(original, "_crossover_guard", False):
            continue

        @functools.wraps(original)
        def guarded(optimizer: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            check_keras_optimizer(optimizer)
            _show_optimizer(_original, optimizer, args, kwargs)
            return _original(optimizer, *args, **kwargs)

        guarded._crossover_guard = True  # type: ignore[attr-defined]
        mod.DistributedOptimizer = guarded
    for mod in modules:
        guard_constructors(mod, ("DistributedOptimizer", "PartialDistributedOptimizer"))  # compression=<class>
    return True
