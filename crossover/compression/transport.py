"""How a compressed tensor travels: dense, values at shared indices by allreduce, or by allgather.

Each transport has `send` (build what the host reduces, start any collective of its own) and
`receive` (turn the reduced payload, and what was gathered, into the averaged gradient). The
statistics vector rides along: appended to summable payloads, or alone as the host's allreduce when
the values travel by allgather. `cost_model.choose_transport` picks one per tensor and step.

The host's reduction may average or sum, with pre/postscale factors: `receive` is told
`weight = reduced_one / world`, the factor the host applied to a sum (1/world for Average, 1 for
Sum), and applies it to allgathered values, which the host never scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import kernels
from .collectives import Collectives
from .selectors import Selection

__all__ = ["DENSE", "SHARED", "GATHER", "SparseCtx", "send_dense", "send_shared", "send_allgather", "receive",
           "split_stats"]

DENSE, SHARED, GATHER = "dense", "ar", "ag"


@dataclass
class SparseCtx:
    """What `receive` needs to decode one tensor's reduced payload."""

    kind: str  # DENSE, SHARED or GATHER
    key: str
    shape: torch.Size
    numel: int
    nstats: int
    handle: Any = None
    idx: torch.Tensor | None = None
    k: int = 0


def send_dense(values: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """The whole tensor and the statistics, summed by the host's allreduce."""
    return torch.cat([values, stats])


def send_shared(sel: Selection, stats: torch.Tensor) -> torch.Tensor:
    """Values at indices every rank shares (random-k from a shared seed): summable."""
    return torch.cat([sel.val, stats])


def send_allgather(sel: Selection, stats: torch.Tensor, comm: Collectives, name: str,
                   packed: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Rank-specific (index, value bits) pairs by allgather; the host reduces only the statistics.

    `packed` is a reusable int32 buffer of shape (rows, 2), rows >= the selection's count; rows beyond
    it are padding, (index 0, value +0.0) pairs that add nothing when decoded (hosts whose allgather
    needs the same size on every rank).
    """
    n = sel.idx.numel()
    packed[:n, 0] = sel.idx
    packed[:n, 1] = sel.val.view(torch.int32)
    if packed.shape[0] > n:
        packed[n:].zero_()
    return stats, comm.allgather_async(packed, name)


def split_stats(reduced: torch.Tensor, nstats: int) -> torch.Tensor:
    """The reduced statistics vector at the end of a reduced payload."""
    return reduced[reduced.numel() - nstats:]


def receive(reduced: torch.Tensor, ctx: SparseCtx, comm: Collectives, out: torch.Tensor | None) -> torch.Tensor:
    """The averaged gradient (flat) from one tensor's reduced payload; `out`: a reusable buffer."""
    if ctx.kind == DENSE:
        return reduced[:ctx.numel]
    assert out is not None
    if ctx.kind == SHARED:
        kernels.zero_scatter(out, ctx.idx, reduced[:ctx.k].contiguous())
        return out
    weight = float(split_stats(reduced, ctx.nstats)[0]) / comm.size()
    gathered = comm.wait(ctx.handle)
    idx = gathered[:, 0].contiguous()
    val = gathered[:, 1].contiguous().view(torch.float32)
    kernels.zero_scatter(out, idx, val, weight)  # indices of several ranks add up
    return out
