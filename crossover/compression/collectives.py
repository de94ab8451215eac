"""The collectives a codec issues itself, as a small interface (the host's reduction is not one of them).

A codec returns a payload that its host reduces (Horovod's allreduce, a DDP hook's all_reduce); only
rank-specific selections need a second collective, an allgather, which the codec starts inside
`encode` and waits for inside `decode`. Hosts pass an object with these methods: the Horovod glue one
bound to the optimizer's process set, the DDP hook one over torch.distributed, and tests
`SimulatedGroup`, which runs N ranks in one process.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Collectives", "SimulatedGroup"]


class Collectives(Protocol):
    """What a codec needs from its host's communication library."""

    def size(self) -> int:
        """Number of ranks taking part."""

    def rank(self) -> int:
        """This rank's index among them."""

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        """Start concatenating every rank's `tensor` along dimension 0 (sizes may differ per rank)."""

    def wait(self, handle: Any) -> torch.Tensor:
        """The concatenation, in rank order."""


class SimulatedGroup:
    """N ranks in one process: `SimulatedGroup(n).rank_view(r)` is rank r's `Collectives`.

    The caller runs each rank's `encode` in turn, then reduces the payloads itself, then each rank's
    `decode`; an allgather completes once every rank has submitted under the same name.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self._pending: dict[str, tuple[dict[int, torch.Tensor], set[int]]] = {}

    def rank_view(self, rank: int) -> _RankView:
        return _RankView(self, rank)

    def _submit(self, rank: int, tensor: torch.Tensor, name: str) -> tuple[str, int]:
        tensors, _ = self._pending.setdefault(name, ({}, set()))
        if rank in tensors:
            raise RuntimeError(f"rank {rank} submitted {name!r} twice before it completed")
        tensors[rank] = tensor.clone()
        return name, rank

    def _wait(self, handle: tuple[str, int]) -> torch.Tensor:
        name, rank = handle
        tensors, done = self._pending.get(name, ({}, set()))
        if len(tensors) != self.world:
            raise RuntimeError(f"allgather {name!r}: {len(tensors)} of {self.world} ranks submitted (would hang)")
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
        return self._group._submit(self._rank, tensor, name)

    def wait(self, handle: Any) -> torch.Tensor:
        return self._group._wait(handle)
