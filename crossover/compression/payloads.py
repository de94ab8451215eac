"""How a compressed tensor travels: dense, values at shared or agreed indices by allreduce, or by allgather.

Each transport has `send` (build what the host reduces, start any collective of its own) and
`receive` (turn the reduced payload, and what was gathered, into the averaged gradient). The
statistics vector rides along: appended to summable payloads, or alone as the host's allreduce when
the values travel by allgather. The step session picks one per tensor and step
(crossover/driver/transport.py).

The host's reduction may average or sum, with pre/postscale factors: `receive` is told
`weight = reduced_one / world`, the factor the host applied to a sum (1/world for Average, 1 for
Sum), and applies it to allgathered values, which the host never scaled.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import cost_model, kernels, scatter
from .collectives import AlltoallCollectives, Collectives
from .selectors import Selection

__all__ = ["SparseCtx", "send_dense", "send_shared",
           "send_agreed", "send_allgather", "send_scatter", "receive", "split_stats", "gather_rows"]

DENSE, ALLREDUCE, ALLGATHER, AGREED, SCATTER = (cost_model.DENSE, cost_model.ALLREDUCE, cost_model.ALLGATHER,
                                                 cost_model.AGREED, cost_model.SCATTER)  # what ctx.kind says


@dataclass
class SparseCtx:
    """What `receive` needs to decode one tensor's reduced payload."""

    kind: str  # DENSE, ALLREDUCE, ALLGATHER, AGREED or SCATTER
    key: str
    shape: torch.Size
    numel: int
    nstats: int
    handle: Any = None
    idx: torch.Tensor | None = None  # the indices this rank sent (ALLREDUCE: every rank's)
    k: int = 0
    # to undo a non-finite step (SparseCodec.decode): references, no copies; dropped after decode
    val: torch.Tensor | None = None  # the values this rank sent
    grad: torch.Tensor | None = None  # this rank's flat gradient (its storage, as compress saw it)
    residual: torch.Tensor | None = None
    local_finite: bool = True  # this rank's gradient (+ residual) statistics were finite
    stats_apart: torch.Tensor | None = None  # a dense payload's statistics, for the host to reduce on its own
    stats_handle: Any = None  # the host's reduction of stats_apart in flight
    gather: Any = None  # SCATTER: the allgather of the owners' kept sums, once started
    step: int = 0  # AGREED, SCATTER: the step; AGREED: the fingerprint of the set this rank used
    bitmap: bool = False  # ALLGATHER: every rank sent a bitmap of the tensor and k values (else k pairs)
    hashes: tuple[int, ...] = ()
    agreement: Any = None  # what the ranks must do alike with the tensor (wire.Agreement), checked in decode
    error: BaseException | None = None  # SCATTER: met while another tensor's decode waited for this one's alltoall


def send_dense(values: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """The whole tensor and the statistics, summed by the host's allreduce."""
    return torch.cat([values, stats])


def send_shared(sel: Selection, stats: torch.Tensor) -> torch.Tensor:
    """Values at indices every rank shares (random-k from a shared seed): summable."""
    return torch.cat([sel.val, stats])


def send_agreed(val: torch.Tensor, check: torch.Tensor, stats: torch.Tensor, comm: Collectives, name: str,
                proposals: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Values at the agreed indices, the set's check floats and the statistics, summed by the host; this
    rank's index proposals for the next step by allgather (equal sizes on every rank; none: no allgather)."""
    handle = comm.allgather_async(proposals, name) if proposals.numel() else None
    return torch.cat([val, check, stats]), handle


def send_scatter(sel: Selection, stats: torch.Tensor, comm: AlltoallCollectives, name: str, numel: int,
                 bitmap: bool) -> tuple[torch.Tensor, Any, int]:
    """This rank's selected entries to the ranks that own their indices, by alltoall; the host reduces only the
    statistics. Returns (payload, handle, bytes sent)."""
    data, splits = scatter.route(sel.idx, sel.val, comm.size(), numel, bitmap)
    return stats, comm.alltoall_async(data, splits, name), data.numel() * data.element_size()


HEADER_ROWS = 2  # per rank, before its rows: (count, numel), (shape hash, ndim | format << 8)
_FORMAT_SHIFT = 8  # the header's ndim field carries the wire format above the ndim (at most 64 in torch)
_NDIM_MASK = (1 << _FORMAT_SHIFT) - 1


def shape_hash(shape: Sequence[int]) -> int:
    """A 31-bit fingerprint of a tensor shape that every rank computes alike."""
    return zlib.crc32(repr(tuple(int(d) for d in shape)).encode()) & 0x7FFFFFFF


def _bitmap_rows(numel: int) -> int:
    """Rows of two int32 that a tensor's bitmap fills at the start of a rank's part (the values follow)."""
    return cost_model.gather_bitmap_bytes(numel) // 8


def gather_rows(k: int, numel: int, bitmap: bool) -> int:
    """Rows of two int32 after the header of a rank's part of the allgather: k pairs, or the bitmap of the tensor
    then the k values, two a row."""
    return _bitmap_rows(numel) + (k + 1) // 2 if bitmap else k


def send_allgather(sel: Selection, stats: torch.Tensor, comm: Collectives, name: str,
                   packed: torch.Tensor, shape: Sequence[int], bitmap: bool = False,
                   scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """Rank-specific (index, value bits) pairs, or a bitmap and values, by allgather; the host reduces only the
    statistics.

    `packed` is a reusable int32 buffer of shape (HEADER_ROWS + rows, 2). The header rows carry the row count,
    the tensor's numel and shape and the wire format, so that `receive` can split the ranks' parts and refuse
    ranks that submitted the same name with a different shape or format (Horovod's own check only sees the
    statistics vector, which has the same shape everywhere).
    * pairs: rows >= the selection's count; rows beyond it are padding, (index 0, value +0.0) pairs that add
      nothing when decoded (for hosts whose allgather needs the same size on every rank);
    * `bitmap`: a bit per element of the tensor (`cost_model.gather_bitmap_bytes`), then the values of the set
      bits in index order, padded with +0.0 to the rows' end (the selection holds at most the rows' values);
      `scratch`: a float32 buffer of the tensor's size for the packing (any content).
    """
    n = sel.idx.numel()
    rows = packed.shape[0] - HEADER_ROWS
    numel = math.prod(shape)
    packed[0, 0], packed[0, 1] = rows, numel
    packed[1, 0], packed[1, 1] = shape_hash(shape), len(shape) | (int(bitmap) << _FORMAT_SHIFT)
    body = packed[HEADER_ROWS:]
    if bitmap:
        head = _bitmap_rows(numel)
        kernels.bitmap_pack(sel.idx, sel.val, numel, body[:head].view(torch.uint8).view(-1),
                            body[head:].view(torch.float32).view(-1), scratch)
        return stats, comm.allgather_async(packed, name)
    body[:n, 0] = sel.idx
    body[:n, 1] = sel.val.view(torch.int32)
    if rows > n:
        body[n:].zero_()
    return stats, comm.allgather_async(packed, name)


def _gathered_parts(gathered: torch.Tensor, ctx: SparseCtx, world: int) -> list[torch.Tensor]:
    """Every rank's rows, headers removed, after checking the ranks' shapes and wire format."""
    heads = []
    off = 0
    for _ in range(world):  # one small header read per rank
        if off + HEADER_ROWS > gathered.shape[0]:
            raise RuntimeError(f"allgather of {ctx.key!r}: truncated payload (ranks disagree on the transport)")
        (count, numel), (h, ndim) = gathered[off:off + HEADER_ROWS].tolist()
        heads.append((off + HEADER_ROWS, count, numel, h, ndim))
        off += HEADER_ROWS + max(0, count)
    own = (ctx.numel, shape_hash(ctx.shape), len(ctx.shape))
    for r, (_, count, numel, h, ndim) in enumerate(heads):
        if (numel, h, ndim & _NDIM_MASK) != own:
            raise RuntimeError(f"Mismatched ALLREDUCE tensor shapes: {ctx.key!r} has shape {tuple(ctx.shape)} "
                               f"({ctx.numel} elements) here, but rank {r} of the process set sent {numel} "
                               f"elements in {ndim & _NDIM_MASK} dimensions (crossover compression, allgather "
                               "transport)")
        if count < 0:
            raise RuntimeError(f"allgather of {ctx.key!r}: rank {r}'s header gives {count} rows (a garbled payload)")
        if ndim >> _FORMAT_SHIFT != int(ctx.bitmap):
            raise RuntimeError(f"allgather of {ctx.key!r}: rank {r} sent another wire format (bitmap or pairs) "
                               "than this rank (ranks disagree on how the tensor travels)")
    if off != gathered.shape[0]:
        raise RuntimeError(f"allgather of {ctx.key!r}: {gathered.shape[0] - off} unexpected trailing rows")
    return [gathered[start:start + count] for start, count, *_ in heads]


def _gathered_pairs(gathered: torch.Tensor, ctx: SparseCtx, world: int) -> torch.Tensor:
    """Every rank's (index, value bits) pairs, headers removed, after checking the ranks' shapes."""
    return torch.cat(_gathered_parts(gathered, ctx, world))


def _receive_bitmaps(gathered: torch.Tensor, ctx: SparseCtx, world: int, out: torch.Tensor, weight: float) -> None:
    """out = weight x the sum of every rank's bitmap part; raises where a part does not fit the tensor."""
    parts = _gathered_parts(gathered, ctx, world)
    rows = gather_rows(ctx.k, ctx.numel, True)
    if any(p.shape[0] != rows for p in parts):
        raise RuntimeError(f"allgather of {ctx.key!r}: parts of {[p.shape[0] for p in parts]} rows, expected {rows} "
                           "(ranks disagree on the compression factor)")
    head = _bitmap_rows(ctx.numel)
    out.zero_()
    for r, part in enumerate(parts):  # rank by rank, in index order: each index adds up as the pairs' do
        try:
            kernels.bitmap_add(out, part[:head].contiguous().view(torch.uint8).view(-1),
                               part[head:].contiguous().view(torch.float32).view(-1), weight)
        except ValueError as e:
            raise RuntimeError(f"allgather of {ctx.key!r}, rank {r}'s part: {e} (ranks disagree on the tensor or "
                               "on how it travels)") from None


def split_stats(reduced: torch.Tensor, nstats: int) -> torch.Tensor:
    """The reduced statistics vector at the end of a reduced payload."""
    return reduced[reduced.numel() - nstats:]


def receive(reduced: torch.Tensor, ctx: SparseCtx, comm: Collectives, out: torch.Tensor | None,
            weight: float | None = None) -> torch.Tensor:
    """The averaged gradient (flat) from one tensor's reduced payload; `out`: a reusable buffer; `weight`: the factor
    the host applied to sums (the reduced statistics' first entry / world; read from them when None)."""
    if ctx.kind == DENSE:
        return reduced[:ctx.numel]
    assert out is not None
    if ctx.kind in (ALLREDUCE, AGREED):  # AGREED: the codec checks the set and waits for the proposals
        kernels.zero_scatter(out, ctx.idx, reduced[:ctx.k].contiguous())
        return out
    world = comm.size()
    if weight is None:
        weight = float(split_stats(reduced, ctx.nstats)[0]) / world
    if ctx.bitmap:
        _receive_bitmaps(comm.wait(ctx.handle), ctx, world, out, weight)
        return out
    gathered = _gathered_pairs(comm.wait(ctx.handle), ctx, world)
    idx = gathered[:, 0].contiguous()
    val = gathered[:, 1].contiguous().view(torch.float32)
    kernels.zero_scatter(out, idx, val, weight)  # indices of several ranks add up
    return out
