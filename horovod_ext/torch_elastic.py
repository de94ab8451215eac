"""Elastic horovod.torch training with crossover compression: the compression's state rides `TorchState`.

Use (`crossover.elastic.TorchState` is this class):

    comp = AdaptiveCompression()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    state = crossover.elastic.TorchState(model, opt, compression=comp, batch=0)

    @hvd.elastic.run
    def train(state): ...   # state.commit() as usual; no reset callback for the compression

Why not a reset callback: `hvd.elastic.run` calls reset callbacks only on workers that were running
when the reset happened; a worker that joins never does. A collective in a callback (the compression's
`sync()`, a broadcast) then waits for a partner that never comes: the job hangs when a worker joins.
`State.sync()` is different: `hvd.elastic.run` calls it on every worker, joined or not, before the
training function starts or restarts (horovod/common/elastic.py, `run_fn`). So this subclass of
Horovod's `TorchState` gives every keyword argument that is a compression object (it has `compress`
and `decompress`) a state handler, next to the model's and the optimizer's:

* `save()` (in `commit()`): a copy of the compression's `state_dict()` (policy, step counter, the
  statistics not yet observed, this rank's error-feedback residuals);
* `restore()` (after a failed collective): back to that copy, with the model and optimizer;
* `reset()` (every reset, on the workers that were running): the step in flight is dropped;
* `sync()` (every worker, after every reset and at the start): the step in flight is dropped and
  every rank takes rank 0's policy state (one `broadcast_object`, in the same order on every rank as
  the model's and optimizer's broadcasts); each rank keeps its own residuals (a new worker starts
  with none). After it, every rank plans the same compression for the next step.

Objects without `state_dict` (fp16, Horovod's own `hvd.Compression.*`) are carried along untouched.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import horovod.torch as hvd
from horovod.torch.elastic.state import StateHandler
from horovod.torch.elastic.state import TorchState as _HorovodTorchState

__all__ = ["CompressionStateHandler", "TorchState", "is_compression"]

log = logging.getLogger(__name__)
SYNC_NAME = "crossover.elastic.compression_sync"


def is_compression(value: Any) -> bool:
    """Whether `value` looks like a Horovod compression object (crossover's or Horovod's)."""
    return (not isinstance(value, type) and callable(getattr(value, "compress", None))
            and callable(getattr(value, "decompress", None)))


class CompressionStateHandler(StateHandler):
    """Save / restore / sync one compression object's state with the model's (see the module doc)."""

    def __init__(self, compression: Any) -> None:
        super().__init__(compression)
        self._saved = self._snapshot()

    def _snapshot(self) -> dict[str, Any] | None:
        state_dict = getattr(self.value, "state_dict", None)
        return copy.deepcopy(state_dict()) if callable(state_dict) else None

    def _reset(self) -> None:
        reset = getattr(self.value, "reset", None)
        if callable(reset):
            reset()

    def save(self) -> None:
        self._saved = self._snapshot()

    def restore(self) -> None:
        if self._saved is not None:
            self.value.load_state_dict(copy.deepcopy(self._saved))
        self._reset()

    def reset(self) -> None:
        """Drop the step in flight (called on every reset by `TorchState.reset`)."""
        self._reset()

    def sync(self) -> None:
        """Every rank takes rank 0's policy state and keeps its own residuals."""
        self._reset()
        state_dict = getattr(self.value, "state_dict", None)
        if not callable(state_dict):
            return
        own = state_dict()
        shared = {k: v for k, v in own.items() if k != "residuals"}
        received = hvd.broadcast_object(shared, root_rank=0, name=SYNC_NAME)
        if "residuals" in own:
            received = {**received, "residuals": own["residuals"]}
        self.value.load_state_dict(received)
        log.debug("compression state synced from rank 0 (step %s)", received.get("step"))


class TorchState(_HorovodTorchState):
    """Horovod's `hvd.elastic.TorchState`, plus a state handler for every compression keyword argument.

    `TorchState(model, optimizer, compression=comp, batch=0, epoch=0)`: `comp` is saved by
    `commit()`, rolled back by `restore()`, reset on every reset and synchronized from rank 0 by
    `sync()` on every worker (joined or not). Any keyword name works; several compressions may be
    given; assigning `state.compression = other` switches the handler to `other`. Other keyword
    arguments behave as in Horovod. Only Horovod's public elastic API is used (the subclass calls
    `super()` for the model, optimizer and plain objects, then handles the compressions itself).
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        compressions = {k: kwargs.pop(k) for k in list(kwargs) if is_compression(kwargs[k])}
        super().__init__(model, optimizer, **kwargs)
        self._compressions = {name: CompressionStateHandler(comp) for name, comp in compressions.items()}
        for name, comp in compressions.items():
            setattr(self, name, comp)

    def __setattr__(self, name: str, value: Any) -> None:
        handler = self.__dict__.get("_compressions", {}).get(name)
        if handler is not None and handler.value is not value:
            handler.set_value(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        super().save()
        for handler in self._compressions.values():
            handler.save()

    def restore(self) -> None:
        super().restore()
        for handler in self._compressions.values():
            handler.restore()

    def sync(self) -> None:
        """Model, optimizer and plain objects (Horovod), then every compression: on every worker."""
        super().sync()
        for handler in self._compressions.values():
            handler.sync()

    def reset(self) -> None:
        """After a reset event, before `sync()`: every compression drops its step in flight."""
        for handler in self._compressions.values():
            handler.reset()
        super().reset()
