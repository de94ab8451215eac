"""Sparse reduce-scatter of rank-specific top-k selections: bytes per worker that do not grow with the workers.

Rank-specific top-k pairs travel by allgather, so every worker receives W k pairs. Here they are reduced
before anyone receives them all (the idea of Ok-Topk, Li and Hoefler, PPoPP 2022, in a simpler form):

1. each rank selects its own k largest entries of gradient + residual (the selector, as for the allgather);
2. index i is owned by rank ``i mod W`` (strided: a hot stretch of a tensor spreads over every owner, so each
   rank sends about k / W pairs to each owner); one alltoall takes every pair to its owner
   (``route``): a worker receives about k (W-1)/W pairs;
3. each owner sums what it received and keeps its ``keep = ceil(k / W)`` largest sums (``reduce_owned``;
   exactly ``keep`` pairs, zero-valued padding where fewer indices arrived), so that the allgather that
   follows has the same size on every rank: a worker receives ``(W-1) keep`` pairs;
4. every rank scatters the same gathered pairs: the same averaged gradient on every rank, about k values;
5. error feedback: each rank returns to its residual the pairs it sent whose index no owner kept
   (``lost``): its own share of a dropped sum, so nothing a rank selected is lost.

About 2 k (W-1)/W pairs per worker in all, against (W-1) k for the allgather: from 2 to 8 workers the bytes grow
1.75x, as a dense ring allreduce's do. What is applied differs from the allgather's union of every rank's
top-k (up to W k entries): about k entries, the largest sums of what the ranks selected.

Plain torch, no host: the sparse codec (``sparse_codec.py``) starts the collectives through its host's
``Collectives``.
"""

from __future__ import annotations

import torch

__all__ = ["lost", "reduce_owned", "route"]


def route(idx: torch.Tensor, val: torch.Tensor, world: int) -> tuple[torch.Tensor, list[int]]:
    """This rank's (index, value bits) pairs as int32 rows ordered by owner (``index mod world``), and the
    number of rows for each owner: the alltoall's input and splits."""
    owner = torch.remainder(idx, world)
    order = torch.argsort(owner, stable=True)
    rows = torch.stack([idx[order], val[order].view(torch.int32)], dim=1)
    splits = torch.bincount(owner.to(torch.int64), minlength=world).tolist()
    return rows, splits


def reduce_owned(received: torch.Tensor, rank: int, world: int, numel: int, keep: int,
                 region: torch.Tensor, key: str = "") -> torch.Tensor:
    """The ``keep`` largest sums of the pairs this rank owns, as (keep, 2) int32 rows (index, value bits).

    ``received``: every rank's rows for this owner (the alltoall's output). ``region``: a float32 buffer of at
    least ``ceil(numel / world)`` zeros, left all zero again. Fewer distinct indices than ``keep``: all of
    them, then (index ``rank``, +0.0) rows that add nothing. Raises when a row is not this rank's to own (the
    ranks disagree on the tensor or the transport)."""
    ridx = received[:, 0]
    rval = received[:, 1].view(torch.float32)
    if ridx.numel():
        lo, hi = int(ridx.min()), int(ridx.max())
        if lo < 0 or hi >= numel or bool((torch.remainder(ridx, world) != rank).any()):
            raise RuntimeError(f"sparse reduce-scatter of {key!r} ({numel} elements): rank {rank} of {world} "
                               f"received indices it does not own (ranks disagree on the tensor's shape or on "
                               f"how it travels)")
    pos = torch.div(ridx, world, rounding_mode="floor").to(torch.int64)
    region.index_add_(0, pos, rval)
    cand = torch.unique(pos)  # the positions any rank sent: the only ones that can hold a non-zero sum
    sums = region[cand]
    region.index_fill_(0, cand, 0.0)
    out = torch.empty((keep, 2), dtype=torch.int32, device=received.device)
    if cand.numel() > keep:
        top = torch.topk(sums.abs(), keep, sorted=False).indices
        cand, sums = cand[top], sums[top]
    n = cand.numel()
    out[:n, 0] = (cand * world + rank).to(torch.int32)
    out[:n, 1] = sums.view(torch.int32)
    out[n:, 0] = rank
    out[n:, 1] = 0  # +0.0
    return out


def lost(sent_idx: torch.Tensor, kept_idx: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the sent indices that are not among the kept ones. ``marks``: a bool buffer of the
    tensor's size, all False, left all False again."""
    marks[kept_idx.to(torch.int64)] = True
    won = marks[sent_idx.to(torch.int64)]
    marks[kept_idx.to(torch.int64)] = False
    return ~won
