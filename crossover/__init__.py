"""crossover: adaptive gradient compression and crossover scheduling for Horovod.

Importing this package is cheap and silent: Horovod and the frameworks are imported only when a
name that needs them is first used (`from crossover import AdaptiveCompression`). The compression
names resolve to the horovod.torch objects when the script imported horovod.torch (and not
horovod.tensorflow), to the horovod.tensorflow ones (`crossover.tensorflow`) in the opposite case;
otherwise (crossover imported first, or both frameworks) to a class that decides when the object is
created, or at its first `compress` from the tensor's type (horovod_ext/_dispatch.py). Import from
`crossover.tensorflow` to be explicit. Elastic training: `crossover.elastic.TorchState`.
"""

from __future__ import annotations

import os
from typing import Any

__version__ = "0.1.0"
__all__ = ["AdaptiveCompression", "DqsgdCompression", "FP16Compression", "QSGDCompression", "StaticCompression",
           "__version__"]

#: The one switch that shows the library's decisions: CROSSOVER_LOG=info (or debug) prints them on rank 0's stderr.
LOG_ENV = "CROSSOVER_LOG"
_RANK_ENVS = ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")  # horovodrun, torchrun, MPI launchers


def _log_from_env() -> None:
    """CROSSOVER_LOG=info: the "crossover" loggers' records on stderr, from rank 0 only (one line per decision: a
    search begins, what it settled on and why, the momentum cap). Unset (the default), nothing is configured."""
    import logging

    name = os.environ.get(LOG_ENV, "").strip()
    if not name:
        return
    level = logging.getLevelName(name.upper())
    if not isinstance(level, int):
        logging.getLogger(__name__).warning("%s=%r is not a logging level (use info or debug): ignored", LOG_ENV, name)
        return
    rank = next((os.environ[k] for k in _RANK_ENVS if k in os.environ), "0")
    logger = logging.getLogger(__name__)
    if rank.strip() != "0" or any(getattr(h, "_crossover", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler._crossover = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("crossover %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


_log_from_env()

_TORCH_NAMES = {"AdaptiveCompression", "FP16Compression", "StaticCompression"}
_QUANT_NAMES = {"DqsgdCompression", "QSGDCompression"}


def __getattr__(name: str) -> Any:
    """Lazy exports: the framework glue is imported on first use only."""
    if name not in _TORCH_NAMES | _QUANT_NAMES:
        raise AttributeError(f"module 'crossover' has no attribute {name!r}")
    from horovod_ext import _dispatch

    framework = _dispatch.script_framework()
    if framework is None:  # horovod not imported yet (or both frameworks): decide at first use
        return _dispatch.lazy_class(name)
    if framework == "tensorflow":
        from crossover import tensorflow

        return getattr(tensorflow, name)
    if name in _TORCH_NAMES:
        from horovod_ext import torch_compression

        return getattr(torch_compression, name)
    if name in _QUANT_NAMES:
        from horovod_ext import torch_quantization

        return getattr(torch_quantization, name)
    raise AttributeError(f"module 'crossover' has no attribute {name!r}")
