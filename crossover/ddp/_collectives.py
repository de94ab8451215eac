"""The codecs' `Collectives` over torch.distributed, for the DDP communication hook.

A codec starts its own allgather inside `encode` (rank-specific top-k selections, packed quantization
codes) and waits for it inside `decode`. Here that allgather is `all_gather_into_tensor`, issued at once
from the hook's body, so that every rank issues its collectives in the same order (bucket by bucket):
collectives started from a future's callback would interleave differently on different ranks, which is
how PyTorch's PowerSGD hook fails on Gloo with several buckets.

Gloo's allgather needs the same size on every rank. Two ways to get it:

* `equal_sizes=True` (what the hook uses): the caller guarantees it; the sparse codec does so with
  `SparseCodec(fixed_gather=True)`, which sends exactly k (index, value) pairs per rank. One collective.
* `equal_sizes=False`: the counts are exchanged first (a blocking allgather of one integer per rank),
  every rank pads to the largest count and the padding is cut off again in `wait`. Two collectives, and
  the first one stalls the backward pass until every rank reaches the bucket (docs/ddp.md has the
  measurement that chose the first way).

Allreduces (the low-rank codec's P and Q factors) are queued, and `flush` starts one allreduce of everything queued,
after an optional head the caller has already averaged (a bucket's payload): PyTorch's PowerSGD hook likewise sends
each round as one flat tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TorchDistCollectives", "GatherHandle"]

# all_gather_single is the newer name of all_gather_into_tensor (deprecated in recent releases)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class GatherHandle:
    """An allgather in flight, or an allreduce queued or in flight: its future, the output buffer, and per-rank row
    counts when they differ."""

    fut: torch.futures.Future | None  # None: an allreduce queued, not yet started (`TorchDistCollectives.flush`)
    out: torch.Tensor
    rows: int  # rows per rank in `out`
    counts: list[int] | None = None  # valid rows of each rank (None: all `rows`)

    def future(self) -> torch.futures.Future:
        """A future that completes when the allgather has (for chaining with the host's reduction)."""
        return self.fut


class TorchDistCollectives:
    """`crossover.compression.collectives.Collectives` on one torch.distributed process group."""

    def __init__(self, group: Any = None, *, equal_sizes: bool = True) -> None:
        self.group = group
        self.equal_sizes = bool(equal_sizes)
        self._outs: dict[str, torch.Tensor] = {}
        self._queue: list[GatherHandle] = []  # allreduces not yet started

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def rank(self) -> int:
        return dist.get_rank(self.group)

    def allgather_async(self, tensor: torch.Tensor, name: str) -> GatherHandle:
        """Start gathering every rank's `tensor` along dimension 0 into a reused buffer."""
        world = self.size()
        rows = tensor.shape[0]
        counts = None
        if not self.equal_sizes:
            mine = torch.tensor([rows], dtype=torch.int64, device=tensor.device)
            every = torch.empty(world, dtype=torch.int64, device=tensor.device)
            _all_gather(every, mine, group=self.group)  # blocking: the size must be known now
            counts = [int(c) for c in every.tolist()]
            width = max(counts)
            if width != rows:
                padded = torch.zeros((width, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
                padded[:rows] = tensor
                tensor = padded
            rows = width
        out = self._buffer(name, (world * rows, *tensor.shape[1:]), tensor)
        work = _all_gather(out, tensor.contiguous(), group=self.group, async_op=True)
        return GatherHandle(fut=work.get_future(), out=out, rows=rows, counts=counts)

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> GatherHandle:
        """Queue averaging `tensor` over the group (out of place); `flush`, or the first `wait`, starts it."""
        out = tensor / self.size()
        handle = GatherHandle(fut=None, out=out, rows=out.shape[0] if out.dim() else 1)
        self._queue.append(handle)
        return handle

    def flush(self, head: torch.Tensor | None = None) -> torch.futures.Future | None:
        """Start one allreduce (a sum) of `head` (flat, already divided by the group's size) and of every queued
        tensor, in that order; its future's value begins with the reduced head. None when there is nothing."""
        queue, self._queue = self._queue, []
        parts = ([] if head is None else [head]) + [h.out.reshape(-1) for h in queue]
        if not parts:
            return None
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        fut = dist.all_reduce(flat, group=self.group, async_op=True).get_future()
        off = 0 if head is None else head.numel()
        for h in queue:
            h.fut, h.out = fut, flat[off:off + h.out.numel()].view_as(h.out)
            off += h.out.numel()
        return fut

    def discard(self) -> None:
        """Forget the allreduces queued and not started (a step abandoned)."""
        self._queue.clear()

    def wait(self, handle: GatherHandle) -> torch.Tensor:
        """The concatenation of every rank's tensor, in rank order (padding removed).

        Waits on the future, not on the work: inside a callback of that future (the hook's decode) Gloo
        has completed the future but not yet the work, and `work.wait()` there would never return.
        """
        if handle.fut is None:
            self.flush()
        handle.fut.wait()
        if handle.counts is None or all(c == handle.rows for c in handle.counts):
            return handle.out
        parts = [handle.out[r * handle.rows:r * handle.rows + c] for r, c in enumerate(handle.counts)]
        return torch.cat(parts)

    def _buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A reused output buffer per collective name (the gathered tensor is consumed within the step)."""
        numel = 1
        for d in shape:
            numel *= d
        buf = self._outs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._outs[name] = buf
        return buf[:numel].view(shape)
