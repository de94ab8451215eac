"""What every horovod.torch compression object of crossover shares: Horovod's side of the hook.

Horovod calls `compress(tensor)` once per gradient in the backward hook (no name, no step) and
`decompress(tensor, ctx)` in `synchronize()`. This base turns that into steps and keys:
* the parameter name and the calling optimizer come from horovod_ext/_internals.py (frames);
* a step begins at the first `compress` after a `decompress` (or when a name repeats);
* tensors that are not float32, sparse, or smaller than `min_compress_numel` pass through untouched;
* collectives a codec issues itself (allgather) go through `HorovodCollectives`, bound to the
  calling optimizer's process set.
Subclasses hold a step driver (crossover/adaptive/driver.py) and a codec (crossover/compression/).
"""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import torch

from crossover.adaptive.driver import GradientKeys, check_min_numel
from horovod_ext._internals import torch_hook_caller, torch_process_set

__all__ = ["HorovodCollectives", "TorchHookBase"]


class HorovodCollectives:
    """`crossover.compression.collectives.Collectives` over horovod.torch, on one process set."""

    def __init__(self, process_set: Any = None) -> None:
        self.process_set = process_set

    def size(self) -> int:
        return self.process_set.size() if self.process_set is not None else hvd.size()

    def rank(self) -> int:
        return self.process_set.rank() if self.process_set is not None else hvd.rank()

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        if self.process_set is None:
            return hvd.allgather_async(tensor, name=name)
        return hvd.allgather_async(tensor, name=name, process_set=self.process_set)

    def wait(self, handle: Any) -> torch.Tensor:
        return hvd.synchronize(handle)


class TorchHookBase:
    """Step boundaries, keys and pass-through for a horovod.torch compression object."""

    def __init__(self, *, min_compress_numel: int) -> None:
        self.min_compress_numel = check_min_numel(min_compress_numel)
        self.comm = HorovodCollectives()
        self._keys = GradientKeys()
        self._phase = "idle"  # "compress" during backward, "decompress" during synchronize

    # ------------------------------------------------------------------ for subclasses
    def _begin_step(self) -> None:
        raise NotImplementedError

    def _count(self, sent: int, dense: int) -> None:
        raise NotImplementedError

    def _skips_all(self) -> bool:
        """True when this step compresses nothing (the plan is dense and measures nothing)."""
        return False

    def _compress_float(self, tensor: torch.Tensor, key: str) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def _decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError

    def _optimizer_seen(self, opt: Any) -> None:
        """The calling optimizer (None when unknown), once per compress."""

    # ------------------------------------------------------------------ Horovod interface
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Called by Horovod per gradient; returns the tensor to allreduce and a context."""
        name, opt = torch_hook_caller(tensor)  # must be called from here: Horovod is two frames up
        if self._phase != "compress":
            self._begin_step()
            self._phase = "compress"
            self._keys.begin()
        if opt is not None:
            ps = torch_process_set(opt)
            if ps is not self.comm.process_set:
                self.comm = HorovodCollectives(ps)
        self._optimizer_seen(opt)
        nbytes = tensor.numel() * tensor.element_size()
        if (tensor.dtype != torch.float32 or tensor.is_sparse or tensor.numel() < self.min_compress_numel
                or self._skips_all()):
            self._count(nbytes, nbytes)
            return tensor, None  # pass through untouched
        key, repeated = self._keys.key(name)
        if repeated:  # same parameter twice in one step: treat as a new step
            self._begin_step()
            self._keys.begin()
            self._keys.key(name)
        self._count(0, nbytes)
        return self._compress_float(tensor, key)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Called by Horovod in synchronize() with the reduced tensor; returns the averaged gradient."""
        if ctx is None:
            return tensor
        self._phase = "decompress"
        return self._decompress(tensor, ctx)

    def reset(self) -> None:
        """Forget the step in flight (call from a Horovod elastic reset callback); policy state stays."""
        self._phase = "idle"
        self._keys.begin()
