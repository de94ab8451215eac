"""`from crossover import AdaptiveCompression` before the framework is known: pick it at first use.

crossover/__init__.py hands out the horovod.torch class when the script imported horovod.torch and
not horovod.tensorflow (or, before any Horovod import, torch and not tensorflow), the horovod.tensorflow
class in the opposite case; otherwise (nothing imported yet, or both) it hands out a class made here.
Constructing it is the first use:
* if by then the framework is known by the same rule (`script_framework`), the call returns that
  framework's object itself (`__new__` builds it; nothing of this module stays in the way);
* otherwise it returns a `LazyCompression` that keeps the arguments and builds the framework's object
  at the first `compress`, from the tensor's type (torch.Tensor or a TensorFlow tensor). From then on
  Horovod's calls go straight to that object (its bound `compress`/`decompress` replace ours on the
  instance). Other attributes (`stats()`, `state_dict()`, ...) before the first `compress` resolve
  the framework from the imported modules, or raise a clear error when that is ambiguous.
A `LazyCompression` checks at construction every setting that needs no framework (`check_settings`: the policy,
GraVAC's and DQ-SGD's settings, momentum, seed, flags, log_csv), as both frameworks' objects do; only what differs
between them (the compressor names, transports, tensorboard targets) waits for the framework.
Importing this module imports neither torch nor TensorFlow nor Horovod.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from horovod_ext._class_guard import CompressionType

__all__ = ["FRAMEWORKS", "check_settings", "lazy_class", "script_framework", "tensor_framework"]

# name -> (horovod.torch module, horovod.tensorflow module) that define it
FRAMEWORKS: dict[str, tuple[str, str]] = {
    "AdaptiveCompression": ("horovod_ext.torch_compression", "horovod_ext.tf_compression"),
    "FP16Compression": ("horovod_ext.torch_compression", "horovod_ext.tf_compression"),
    "StaticCompression": ("horovod_ext.torch_compression", "horovod_ext.tf_compression"),
    "DqsgdCompression": ("horovod_ext.torch_quantization", "horovod_ext.tf_quantization"),
    "QSGDCompression": ("horovod_ext.torch_quantization", "horovod_ext.tf_quantization"),
}
AMBIGUOUS = ("crossover.{name} was created before the script imported horovod.torch or horovod.tensorflow "
             "(or it imported both), so which framework it is for is decided by its first compress(). "
             "To say it up front: from crossover.tensorflow import {name} (TensorFlow), or "
             "from {torch_module} import {name} (PyTorch); or import horovod first.")


def script_framework() -> str | None:
    """"torch" or "tensorflow": the one of horovod.torch / horovod.tensorflow this process imported, else
    the one of torch / tensorflow; None when that is not one (neither, or both)."""
    for torch_mod, tf_mod in (("horovod.torch", "horovod.tensorflow"), ("torch", "tensorflow")):
        has_torch, has_tf = torch_mod in sys.modules, tf_mod in sys.modules
        if has_torch != has_tf:
            return "torch" if has_torch else "tensorflow"
        if has_torch:
            return None  # both frameworks' Horovod (or both frameworks): the tensor decides
    return None


def tensor_framework(tensor: Any) -> str:
    """"torch" or "tensorflow" from a gradient's type (without importing either)."""
    module = type(tensor).__module__
    if module.split(".")[0] == "torch":
        return "torch"
    if module.split(".")[0] in ("tensorflow", "keras", "tf_keras"):
        return "tensorflow"
    raise TypeError(f"crossover compression got a {type(tensor).__module__}.{type(tensor).__name__}: "
                    "expected a torch.Tensor (horovod.torch) or a TensorFlow tensor (horovod.tensorflow)")


def _framework_class(name: str, framework: str) -> type:
    torch_mod, tf_mod = FRAMEWORKS[name]
    if framework == "tensorflow":
        from horovod_ext.keras_guard import install_keras_guard

        install_keras_guard()  # what `from crossover.tensorflow import` does, without importing the public face
    return getattr(importlib.import_module(tf_mod if framework == "tensorflow" else torch_mod), name)


# ------------------------------------------------------------------ settings checked before the framework is known
# Names each object takes in either framework (GraVAC: besides GravacPolicy's own settings).
_SPARSE_NAMES = frozenset({"compressor", "error_feedback", "min_compress_numel", "seed", "log_csv", "tensorboard",
                           "transport"})
_GRAVAC_HOST_NAMES = _SPARSE_NAMES | {"enabled", "momentum", "clock"}
_STATIC_NAMES = _SPARSE_NAMES | {"cf"}
_QUANT_NAMES = frozenset({"error_feedback", "min_compress_numel", "seed", "transport", "tensorboard"})
_QSGD_NAMES = _QUANT_NAMES | {"bits"}
_DQSGD_NAMES = _QUANT_NAMES | {"total_steps", "lr", "error_budget", "target_bits", "b_min", "b_max", "decay"}


def _given(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], positional: tuple[str, ...],
           known: frozenset[str] | None) -> dict[str, Any]:
    """The call's settings by name; TypeError for a call Python would refuse (too many positional arguments, a
    setting given twice, an unknown name where `known` is given)."""
    if len(args) > len(positional):
        takes = f"at most {len(positional)} ({', '.join(positional)})" if positional else "no"
        raise TypeError(f"{name}() takes {takes} positional argument(s), got {len(args)}: pass settings by name")
    given = dict(zip(positional, args))
    for key in kwargs:
        if key in given:
            raise TypeError(f"{name}() got multiple values for argument {key!r}")
    given.update(kwargs)
    unknown = sorted(set(given) - known) if known is not None else []
    if unknown:
        raise TypeError(f"{name}() got an unexpected keyword argument {unknown[0]!r}")
    return given


def _check_shared(given: dict[str, Any], *, sparse: bool = False) -> None:
    """The settings both frameworks' objects check alike (`sparse`: and the sparse objects' transport, which only
    horovod.torch's take)."""
    from crossover.compression.checks import check_flag, check_seed
    from crossover.driver.settings import check_min_numel, check_momentum
    from crossover.driver.steplog import check_log_pattern
    from crossover.driver.transport import check_transport

    checks: dict[str, Callable[[Any], object]] = {
        "error_feedback": lambda v: check_flag("error_feedback", v), "enabled": lambda v: check_flag("enabled", v),
        "seed": check_seed, "min_compress_numel": check_min_numel, "momentum": check_momentum,
        "log_csv": check_log_pattern, "compressor": _check_compressor, "clock": _check_clock,
    }
    for key, check in checks.items():
        if key in given:
            check(given[key])
    if sparse and "transport" in given:
        check_transport(given["transport"])


def _check_compressor(compressor: object) -> None:
    if not isinstance(compressor, str):
        raise ValueError(f"compressor must be a name (str) such as 'topk' or 'randomk', got {compressor!r}")


def _check_clock(clock: object) -> None:
    if clock is not None and not callable(clock):
        raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")


def _check_gravac(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from crossover.driver.settings import gravac_or_dense

    given = _given(name, args, kwargs, ("compressor",), None)
    _check_shared(given, sparse=True)
    gravac_or_dense(given.get("enabled", True), **{k: v for k, v in given.items() if k not in _GRAVAC_HOST_NAMES})


def _check_static(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from crossover.adaptive.static import StaticPolicy

    given = _given(name, args, kwargs, ("compressor",), _STATIC_NAMES)
    _check_shared(given, sparse=True)
    if "cf" in given:
        StaticPolicy(cf=given["cf"])


def _check_qsgd(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from crossover.driver.quant import QuantStepDriver

    given = _given(name, args, kwargs, ("bits",), _QSGD_NAMES)
    _check_shared(given)
    if "bits" in given:
        QuantStepDriver(bits=given["bits"])


def _check_dqsgd(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from crossover.driver.settings import DQSGD_DEFAULTS, dqsgd_settings

    given = _given(name, args, kwargs, (), _DQSGD_NAMES)
    if "total_steps" not in given:
        raise TypeError(f"{name}() missing 1 required keyword-only argument: 'total_steps'")
    _check_shared(given)
    settings = {**DQSGD_DEFAULTS, **{k: v for k, v in given.items() if k in _DQSGD_NAMES - _QUANT_NAMES}}
    if hasattr(settings["lr"], "learning_rate"):  # a Keras optimizer (TensorFlow reads its rate)
        settings["lr"] = None
    dqsgd_settings(**settings)


def _check_adaptive(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from horovod_ext._facade import check_policy, dqsgd_call_error

    settings = dict(kwargs)
    policy = settings.pop("policy", "gravac")
    check_policy(policy, args)
    if policy == "gravac":
        _check_gravac(name, args, settings)
        return
    try:
        _check_dqsgd(name, args, settings)
    except TypeError as exc:
        raise dqsgd_call_error(exc) from None


def _check_fp16(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if args or kwargs:
        raise TypeError(f"{name}() takes no arguments")


_CHECKS: dict[str, Callable[[str, tuple[Any, ...], dict[str, Any]], None]] = {
    "AdaptiveCompression": _check_adaptive, "FP16Compression": _check_fp16, "StaticCompression": _check_static,
    "DqsgdCompression": _check_dqsgd, "QSGDCompression": _check_qsgd,
}


def check_settings(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Check `name(*args, **kwargs)` (one of FRAMEWORKS) as far as no framework is needed, the way both frameworks'
    objects check it: ValueError naming the setting, TypeError for a call Python would refuse. Imports no
    framework."""
    _CHECKS[name](name, args, kwargs)


def _inside_tf_function() -> bool:
    tf = sys.modules.get("tensorflow")
    return tf is not None and bool(tf.inside_function()) and not tf.executing_eagerly()


class LazyCompression(metaclass=CompressionType):
    """A compression object whose framework is decided at its first `compress` (see the module doc)."""

    _name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        framework = script_framework()
        if framework is not None:
            return _framework_class(cls._name, framework)(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _inside_tf_function():
            from horovod_ext._tf_host import INSIDE_FUNCTION_ERROR

            raise RuntimeError(INSIDE_FUNCTION_ERROR.format(name=self._name))
        check_settings(self._name, args, kwargs)  # now, not at the first step
        self._args, self._kwargs, self._impl = args, kwargs, None

    __hash__ = object.__hash__  # Horovod's TF glue keys a cache by the compression object

    def _build(self, framework: str) -> Any:
        if self._impl is None:
            cls = _framework_class(self._name, framework)
            if framework == "tensorflow":
                import tensorflow as tf

                with tf.init_scope():  # built once, outside any trace, even if the first compress is traced
                    impl = cls(*self._args, **self._kwargs)
            else:
                impl = cls(*self._args, **self._kwargs)
            impl._hook_owner = self  # what Horovod holds (TensorFlow's frame lookup compares it)
            self._impl = impl
            self.compress, self.decompress = impl.compress, impl.decompress  # Horovod calls them directly
        return self._impl

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """The first compress: build the framework's object for this tensor, then hand over to it."""
        return self._build(tensor_framework(tensor)).compress(tensor)

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return self._build(tensor_framework(tensor)).decompress(tensor, ctx)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_args", "_kwargs", "_impl"):
            raise AttributeError(name)
        impl = self.__dict__.get("_impl")
        if impl is None:
            framework = script_framework()
            if framework is None:
                raise RuntimeError(AMBIGUOUS.format(name=self._name, torch_module=FRAMEWORKS[self._name][0]))
            impl = self._build(framework)
        return getattr(impl, name)

    def __repr__(self) -> str:
        impl = self.__dict__.get("_impl")
        return f"{self._name}({'not built yet' if impl is None else repr(impl)})"


_CLASSES: dict[str, type] = {}


def lazy_class(name: str) -> type:
    """The framework-deciding class for `name` (one of FRAMEWORKS), made once."""
    if name not in _CLASSES:
        doc = f"crossover.{name}: the horovod.torch or horovod.tensorflow object, decided at first use."
        _CLASSES[name] = type(name, (LazyCompression,), {"_name": name, "__doc__": doc,
                                                         "__module__": __name__})
    return _CLASSES[name]
