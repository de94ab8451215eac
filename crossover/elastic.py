"""Elastic horovod.torch training with crossover compression: `crossover.elastic.TorchState`.

    state = crossover.elastic.TorchState(model, optimizer, compression=comp, batch=0)

Horovod's `hvd.elastic.TorchState` with the compression's state saved, restored and synchronized
together with the model's (horovod_ext/torch_elastic.py; guarantees in docs/compression.md). A public
re-export module: it imports horovod.torch and torch.
"""

from __future__ import annotations

from horovod_ext.torch_elastic import CompressionStateHandler, TorchState

__all__ = ["CompressionStateHandler", "TorchState"]
