"""Elastic horovod.torch training with crossover compression: `crossover.elastic.TorchState`.

    state = crossover.elastic.TorchState(model, optimizer, compression=comp, batch=0)

Horovod's `hvd.elastic.TorchState` with the compression's state saved, restored and synchronized
together with the model's (horovod_ext/torch_elastic.py; guarantees in docs/compression.md). A public
re-export module, lazy like `crossover/__init__.py`: importing it is cheap and silent; horovod.torch
and torch are imported when `TorchState` or `CompressionStateHandler` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and editors only; at run time __getattr__ imports them
    from horovod_ext.torch_elastic import CompressionStateHandler, TorchState

__all__ = ["CompressionStateHandler", "TorchState"]


def __getattr__(name: str) -> Any:
    """Lazy exports: the elastic glue (and horovod.torch) is imported on first use only."""
    if name not in __all__:
        raise AttributeError(f"module 'crossover.elastic' has no attribute {name!r}")
    from horovod_ext import torch_elastic

    value = getattr(torch_elastic, name)
    globals()[name] = value  # resolved once: later lookups are plain attribute reads
    return value
