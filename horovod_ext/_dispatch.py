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
Importing this module imports neither torch nor TensorFlow nor Horovod.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from horovod_ext._class_guard import CompressionType

__all__ = ["FRAMEWORKS", "lazy_class", "script_framework", "tensor_framework"]

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
