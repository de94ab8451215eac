"""Sparse reduce-scatter of rank-specific top-k selections: bytes per worker that do not grow with the workers.

Rank-specific top-k pairs travel by allgather, so every worker receives W k pairs. Here they are reduced
before anyone receives them all (the idea of Ok-Topk, Li and Hoefler, PPoPP 2022, in a simpler form):

1. each rank selects its own k largest entries of gradient + residual (the selector, as for the allgather);
2. index i is owned by rank ``i mod W`` at position ``i div W`` of its stretch (strided: a hot part of a tensor
   spreads over every owner, so each rank sends about k / W entries to each owner); one alltoall takes every
   entry to its owner (``route``): a worker receives about k (W-1)/W entries;
3. each owner sums what it received and keeps its ``keep = ceil(k / W)`` largest sums (``reduce_owned``), and
   the owners' kept sums travel by one allgather of the same size on every rank (``pack_kept``): a worker
   receives ``(W-1) keep`` entries;
4. every rank scatters the same gathered entries (``unpack_kept``): the same averaged gradient on every rank,
   about k values;
5. error feedback: each rank returns to its residual the entries it sent whose index no owner kept (``lost``):
   its own share of a dropped sum, so nothing a rank selected is lost.

About 2 k (W-1)/W entries per worker in all, against (W-1) k for the allgather: from 2 to 8 workers the bytes
grow 1.75x, as a dense ring allreduce's do. What is applied differs from the allgather's union of every rank's
top-k (up to W k entries): about k entries, the largest sums of what the ranks selected.

Two wire formats, chosen by the same rule on every rank (``cost_model.scatter_bitmap``):

* **pairs**: int32 rows (index, value bits), 8 bytes an entry;
* **bitmap**, when a stretch is dense enough that one bit per position costs less than an index per entry
  (about k > n / 32, CF below 32): per stretch a bitmap of its positions (``bitmap_bytes``) then the values of
  the set bits in position order, 4 bytes an entry: at CF 10 about a third fewer bytes than pairs.

Plain torch, no host: the sparse codec (``sparse_codec.py``) starts the collectives through its host's
``Collectives``.
"""

from __future__ import annotations

import torch

from .bitmap import pack_bits, unpack_bits
from .cost_model import scatter_bitmap_bytes

__all__ = ["bitmap_bytes", "lost", "pack_kept", "reduce_owned", "route", "stretch", "unpack_kept",
           "unpack_received"]

def stretch(numel: int, world: int) -> int:
    """Positions in the longest owner's stretch: ``ceil(numel / world)`` (rank 0's)."""
    return -(-int(numel) // int(world))


def bitmap_bytes(numel: int, world: int) -> int:
    """Bytes of one stretch's bitmap (``cost_model.scatter_bitmap_bytes``, whose rule the wire follows)."""
    return scatter_bitmap_bytes(numel, world)


def _unpack_bits(data: torch.Tensor, count: int) -> torch.Tensor:
    """(m,) uint8 -> the positions of the set bits among the first ``count`` (int64, ascending); raises when a
    bit beyond ``count`` is set."""
    bits = unpack_bits(data)
    if bool(bits[count:].any()):
        raise RuntimeError("sparse reduce-scatter: a bitmap marks positions beyond its stretch (ranks disagree on "
                           "the tensor's shape or on how it travels)")
    return bits[:count].nonzero().reshape(-1)


def _f32_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def route(idx: torch.Tensor, val: torch.Tensor, world: int, numel: int,
          bitmap: bool) -> tuple[torch.Tensor, list[int]]:
    """This rank's entries ordered by owner (``index mod world``) and the size of each owner's part: the alltoall's
    input (int32 rows (index, value bits) or, ``bitmap``, uint8 bitmap + values per owner) and its splits."""
    owner = torch.remainder(idx, world).to(torch.int64)
    counts = torch.bincount(owner, minlength=world)
    if not bitmap:
        order = torch.argsort(owner, stable=True)
        rows = torch.stack([idx[order], val[order].view(torch.int32)], dim=1)
        return rows, counts.tolist()
    width = bitmap_bytes(numel, world) * 8
    key = owner * width + torch.div(idx, world, rounding_mode="floor").to(torch.int64)
    order = torch.argsort(key)
    mask = torch.zeros(world * width, dtype=torch.bool, device=idx.device)
    mask[key] = True
    maps = pack_bits(mask.view(world, width))
    vals = _f32_bytes(val[order])
    parts, splits, off = [], [], 0
    for j, c in enumerate(counts.tolist()):  # one bitmap and one run of values per owner
        parts += [maps[j], vals[4 * off:4 * (off + c)]]
        splits.append(maps.shape[1] + 4 * c)
        off += c
    return torch.cat(parts), splits


def unpack_received(received: torch.Tensor, rank: int, world: int, numel: int, bitmap: bool,
                    key: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in this rank's stretch (int64), values) of everything the ranks sent this owner; raises when an
    entry is not this rank's to own (the ranks disagree on the tensor or the transport)."""
    length = (int(numel) - rank + world - 1) // world  # positions of this rank's stretch
    where = f"sparse reduce-scatter of {key!r} ({numel} elements), rank {rank} of {world}"
    if not bitmap:
        ridx = received[:, 0]
        if ridx.numel():
            lo, hi = int(ridx.min()), int(ridx.max())
            if lo < 0 or hi >= numel or bool((torch.remainder(ridx, world) != rank).any()):
                raise RuntimeError(f"{where}: received indices it does not own (ranks disagree on the tensor's "
                                   "shape or on how it travels)")
        pos = torch.div(ridx, world, rounding_mode="floor").to(torch.int64)
        return pos, received[:, 1].view(torch.float32)
    head = bitmap_bytes(numel, world)
    positions, values, off = [], [], 0
    for _ in range(world):  # each sender's bitmap, then as many values as it has bits
        if off + head > received.numel():
            raise RuntimeError(f"{where}: the received bytes end inside a bitmap (ranks disagree)")
        pos = _unpack_bits(received[off:off + head], length)
        off += head
        end = off + 4 * pos.numel()
        if end > received.numel():
            raise RuntimeError(f"{where}: the received bytes end inside the values (ranks disagree)")
        positions.append(pos)
        values.append(received[off:end].view(torch.float32))
        off = end
    if off != received.numel():
        raise RuntimeError(f"{where}: {received.numel() - off} unexpected trailing bytes (ranks disagree)")
    return torch.cat(positions), torch.cat(values)


def reduce_owned(pos: torch.Tensor, val: torch.Tensor, keep: int,
                 region: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` largest sums of the received entries (positions, sums; fewer when fewer positions arrived).
    ``region``: a float32 buffer of at least the stretch's length, all zero, left all zero again."""
    region.index_add_(0, pos, val)
    cand = torch.unique(pos)  # the positions any rank sent: the only ones that can hold a non-zero sum
    sums = region[cand]
    region.index_fill_(0, cand, 0.0)
    if cand.numel() > keep:
        top = torch.topk(sums.abs(), keep, sorted=False).indices
        cand, sums = cand[top], sums[top]
    return cand, sums


def pack_kept(pos: torch.Tensor, sums: torch.Tensor, rank: int, world: int, numel: int, keep: int,
              bitmap: bool) -> torch.Tensor:
    """This owner's kept sums in a payload of the same size on every rank: ``keep`` int32 rows (index, value bits)
    padded with (index ``rank``, +0.0), or a bitmap then ``keep`` values padded with +0.0 (uint8)."""
    n = pos.numel()
    if not bitmap:
        out = torch.empty((keep, 2), dtype=torch.int32, device=sums.device)
        out[:n, 0] = (pos * world + rank).to(torch.int32)
        out[:n, 1] = sums.view(torch.int32)
        out[n:, 0] = rank
        out[n:, 1] = 0  # +0.0: adds nothing
        return out
    head = bitmap_bytes(numel, world)
    mask = torch.zeros(head * 8, dtype=torch.bool, device=sums.device)
    mask[pos] = True
    vals = torch.zeros(keep, dtype=torch.float32, device=sums.device)
    vals[:n] = sums[torch.argsort(pos)]  # in position order, as the bitmap lists them
    return torch.cat([pack_bits(mask), _f32_bytes(vals)])


def unpack_kept(gathered: torch.Tensor, world: int, numel: int, keep: int,
                bitmap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every owner's kept sums from the allgather: (indices int32, values float32)."""
    if not bitmap:
        return gathered[:, 0].contiguous(), gathered[:, 1].contiguous().view(torch.float32)
    head = bitmap_bytes(numel, world)
    part = head + 4 * keep
    if gathered.numel() != world * part:
        raise RuntimeError(f"sparse reduce-scatter ({numel} elements): gathered {gathered.numel()} bytes, expected "
                           f"{world} x {part} (ranks disagree on the tensor's shape or on how it travels)")
    rows = gathered.view(world, part)
    idx, vals = [], []
    for r in range(world):  # one bitmap per owner
        length = (int(numel) - r + world - 1) // world
        pos = _unpack_bits(rows[r, :head], length)
        if pos.numel() > keep:
            raise RuntimeError(f"sparse reduce-scatter ({numel} elements): owner {r} marked {pos.numel()} kept "
                               f"sums, at most {keep} travel (ranks disagree)")
        idx.append((pos * world + r).to(torch.int32))
        vals.append(rows[r, head:head + 4 * pos.numel()].view(torch.float32))
    return torch.cat(idx), torch.cat(vals)


def lost(sent_idx: torch.Tensor, kept_idx: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the sent indices that are not among the kept ones. ``marks``: a bool buffer of the
    tensor's size, all False, left all False again."""
    marks[kept_idx.to(torch.int64)] = True
    won = marks[sent_idx.to(torch.int64)]
    marks[kept_idx.to(torch.int64)] = False
    return ~won
