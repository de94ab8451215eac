"""crossover: adaptive gradient compression and crossover scheduling for Horovod.

Importing this package is cheap and silent: Horovod and the frameworks are imported only when a
name that needs them is first used (`from crossover import AdaptiveCompression`). The compression
names resolve to the horovod.torch objects, or to the horovod.tensorflow ones (`crossover.tensorflow`)
when the script imported horovod.tensorflow and not horovod.torch; import from `crossover.tensorflow`
to be explicit.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["AdaptiveCompression", "DqsgdCompression", "FP16Compression", "QSGDCompression", "StaticCompression",
           "__version__"]

_TORCH_NAMES = {"AdaptiveCompression", "FP16Compression", "StaticCompression"}
_QUANT_NAMES = {"DqsgdCompression", "QSGDCompression"}


def _tensorflow_script() -> bool:
    """Whether this process uses horovod.tensorflow rather than horovod.torch."""
    import sys

    return "horovod.tensorflow" in sys.modules and "horovod.torch" not in sys.modules


def __getattr__(name: str) -> Any:
    """Lazy exports: the framework glue is imported on first use only."""
    if name in _TORCH_NAMES | _QUANT_NAMES and _tensorflow_script():
        from crossover import tensorflow

        return getattr(tensorflow, name)
    if name in _TORCH_NAMES:
        from horovod_ext import torch_compression

        return getattr(torch_compression, name)
    if name in _QUANT_NAMES:
        from horovod_ext import torch_quantization

        return getattr(torch_quantization, name)
    raise AttributeError(f"module 'crossover' has no attribute {name!r}")
