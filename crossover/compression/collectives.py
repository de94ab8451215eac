"""The collectives a codec issues itself, as a small interface (the host's reduction is not one of them).

A codec returns a payload that its host reduces (Horovod's allreduce, a DDP hook's all_reduce); only
rank-specific selections need a second collective, an allgather, which the codec starts inside
`encode` and waits for inside `decode`. The sparse reduce-scatter (`scatter.py`) starts an alltoall in
`encode`, and in `decode` an allgather that depends on it: hosts that offer `alltoall_async` (the Horovod
glue) can carry it. Hosts pass an object with these methods: the Horovod glue one bound to the optimizer's
process set, the DDP hook one over torch.distributed, and tests `SimulatedGroup`, which runs N ranks in one
process (in turn, or each in a thread of its own with ``timeout_s`` set, for collectives started in `decode`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

__all__ = ["AllreduceCollectives", "AlltoallCollectives", "Collectives", "SimulatedGroup"]


class Collectives(Protocol):
    """What a codec needs from its host's communication library."""

    def size(self) -> int:
        """Number of ranks taking part."""

    def rank(self) -> int:
        """This rank's index among them."""

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        """Start concatenating every rank's `tensor` along dimension 0 (sizes may differ per rank)."""

    def wait(self, handle: Any) -> torch.Tensor:
        """The concatenation, in rank order (an allreduce's: the average)."""


class AllreduceCollectives(Collectives, Protocol):
    """Collectives that can also average a tensor over the ranks (the low-rank codec's factors)."""

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Any:
        """Start averaging `tensor` (the same shape on every rank) over the ranks; `wait` gives the average."""


class AlltoallCollectives(Collectives, Protocol):
    """Collectives that can also exchange rows between every pair of ranks (the sparse reduce-scatter's)."""

    def alltoall_async(self, tensor: torch.Tensor, splits: Sequence[int], name: str) -> Any:
        """Start sending rows ``[sum(splits[:r]), sum(splits[:r+1]))`` of `tensor` to rank r; `wait` gives the
        rows every rank sent this one, in rank order."""


class SimulatedGroup:
    """N ranks in one process: `SimulatedGroup(n).rank_view(r)` is rank r's `Collectives`.

    The caller runs each rank's `encode` in turn, then reduces the payloads itself, then each rank's
    `decode`; a collective completes once every rank has submitted under the same name. With ``timeout_s``
    the ranks may run in threads of their own: `wait` blocks until every rank has submitted (RuntimeError
    after ``timeout_s``); without it, a `wait` before that raises at once (it would hang).
    """

    def __init__(self, world: int, timeout_s: float | None = None) -> None:
        self.world = world
        self.timeout_s = timeout_s
        self._pending: dict[str, tuple[dict[int, Any], set[int]]] = {}
        self._cond = threading.Condition()

    def rank_view(self, rank: int) -> _RankView:
        return _RankView(self, rank)

    def _submit(self, rank: int, item: Any, name: str) -> tuple[str, int]:
        with self._cond:
            tensors, _ = self._pending.setdefault(name, ({}, set()))
            if rank in tensors:
                raise RuntimeError(f"rank {rank} submitted {name!r} twice before it completed")
            tensors[rank] = item
            self._cond.notify_all()
        return name, rank

    def _wait(self, handle: tuple[str, int]) -> torch.Tensor:
        name, rank = handle
        with self._cond:
            def ready() -> bool:
                return len(self._pending.get(name, ({}, set()))[0]) == self.world

            if not ready() and (self.timeout_s is None or not self._cond.wait_for(ready, self.timeout_s)):
                have = len(self._pending.get(name, ({}, set()))[0])
                raise RuntimeError(f"collective {name!r}: {have} of {self.world} ranks submitted (would hang)")
            tensors, done = self._pending[name]
            first = tensors[0]
            if isinstance(first, tuple):  # alltoall: (rows, splits) per rank; this rank's rows from each
                parts = []
                for r in range(self.world):
                    rows, splits = tensors[r]
                    start = sum(splits[:rank])
                    parts.append(rows[start:start + splits[rank]])
                out = torch.cat(parts)
            else:
                out = torch.cat([tensors[r] for r in range(self.world)])
            done.add(rank)
            if len(done) == self.world:
                del self._pending[name]
            return out


class _RankView:
    def __init__(self, group: SimulatedGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    def size(self) -> int:
        return self._group.world

    def rank(self) -> int:
        return self._rank

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        return self._group._submit(self._rank, tensor.clone(), name)

    def alltoall_async(self, tensor: torch.Tensor, splits: Sequence[int], name: str) -> Any:
        splits = [int(s) for s in splits]
        if len(splits) != self._group.world or sum(splits) != tensor.shape[0] or min(splits) < 0:
            raise ValueError(f"alltoall {name!r}: splits {splits} do not cut {tensor.shape[0]} rows into "
                             f"{self._group.world} parts")
        return self._group._submit(self._rank, (tensor.clone(), splits), name)

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Any:
        return _Mean(self._group._submit(self._rank, tensor.clone(), name), tuple(tensor.shape))

    def wait(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, _Mean):
            every = self._group._wait(handle.handle)
            return every.view(self._group.world, *handle.shape).mean(0)
        return self._group._wait(handle)


class _Mean(NamedTuple):
    """A simulated allreduce in flight: the gather it waits on, and the shape of one rank's tensor."""

    handle: tuple[str, int]
    shape: tuple[int, ...]
