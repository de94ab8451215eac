"""Fewer, fused allgathers: the codecs' per-tensor allgathers of one step travel in groups, as DDP buckets do.

A codec starts one allgather per compressed tensor inside `encode` (rank-specific top-k pairs, packed
quantization codes). Under Horovod each is a collective of its own, negotiated by the background loop.
`GroupedCollectives` wraps the host's `Collectives` and implements the same interface: a codec's
`allgather_async(tensor, name)` only files the tensor in its group, and the group travels as one allgather
of bytes once all its members are in; `wait` cuts the member's rows back out of the group's result.
Payloads of any kind travel together (int32 pairs next to uint8 codes): a group is a byte buffer.

Every rank must submit the same groups, whatever order its gradients come in:
* the groups of step t are planned from the members of step t-1 (the tensors that went by allgather, the
  same on every rank: the decision to compress depends on the plan and the tensor's size only), ordered
  by `order` (the host's expected arrival: reverse registration order, like DDP's first buckets) and cut
  at `first_bytes` then `group_bytes` of dense gradient (DDP's 1 MiB first bucket and 25 MiB buckets):
  the first group travels while backward still runs;
* a planned group goes as soon as its last member is in; `flush()` (the host calls it before the step's
  first decode) sends what is still open, planned groups first, then the members nobody planned (the
  first step, a tensor that changed transport) in one group of their own;
* each rank's part of a group starts with a directory (member names' fingerprints and byte counts); a rank
  whose directory differs from this rank's raises (different models or parameter names on the ranks).
Fixed-size members (the sparse codec's `fixed_gather`) give groups of a fixed size: Horovod's response cache
then skips the full negotiation of the allgather every step.

Between `flush()` and the next `begin_step()` (the decodes) an allgather goes to the host at once, ungrouped: it
is one that depends on another collective (the sparse reduce-scatter's second half). Alltoalls are not grouped.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .collectives import Collectives

__all__ = ["FIRST_GROUP_BYTES", "GROUP_BYTES", "GroupedCollectives", "MemberHandle", "cut_buckets"]

FIRST_GROUP_BYTES = 1 << 20  # DDP's first bucket (1 MiB): the first group leaves early in backward
GROUP_BYTES = 25 << 20  # DDP's bucket_cap_mb default (25 MiB of dense gradient per group)
_ALIGN = 8  # every member and directory starts on 8 bytes: any dtype up to 8 bytes views in place
_MAGIC = 0x43584F47  # "CXOG": the start of a rank's part


def cut_buckets(numels: Sequence[int], first_bytes: int = FIRST_GROUP_BYTES,
                group_bytes: int = GROUP_BYTES) -> list[list[int]]:
    """DDP's bucket assignment: positions of `numels` (float32 gradients, in expected arrival order) cut into
    consecutive buckets, a bucket closing once it holds `first_bytes` (the first) or `group_bytes` (the rest)."""
    buckets: list[list[int]] = []
    cap, size, current = first_bytes, 0, None
    for i, n in enumerate(numels):
        if current is None:
            current = []
            buckets.append(current)
        current.append(i)
        size += 4 * int(n)
        if size >= cap:
            current, size, cap = None, 0, group_bytes
    return buckets


def _fingerprint(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class _Member:
    name: str
    order: float
    numel: int  # dense elements of the gradient behind it (for the group's size)
    tensor: torch.Tensor | None = None


@dataclass
class _Group:
    name: str
    members: list[str]  # in planned order (the same on every rank)
    filed: dict[str, torch.Tensor] = field(default_factory=dict)
    handle: Any = None
    result: torch.Tensor | None = None
    index: dict[str, list[tuple[int, int]]] | None = None  # member -> (offset, bytes) in each rank's part

    @property
    def complete(self) -> bool:
        return len(self.filed) == len(self.members)


@dataclass
class MemberHandle:
    """What `allgather_async` returns: the member's group and name, and how to view its rows."""

    group: _Group
    name: str
    dtype: torch.dtype
    trailing: tuple[int, ...]


class GroupedCollectives:
    """`Collectives` whose allgathers travel in groups; wraps the host's `inner` collectives.

    Per step the host calls `begin_step()` (before the first encode), `note(order, numel)` before each
    encode (the tensor's expected arrival order and dense size), and `flush()` before the first decode.
    `enabled=False` passes every call straight to `inner` (one collective per tensor, as before)."""

    def __init__(self, inner: Collectives, *, first_bytes: int = FIRST_GROUP_BYTES, group_bytes: int = GROUP_BYTES,
                 enabled: bool = True) -> None:
        for what, v in (("first_bytes", first_bytes), ("group_bytes", group_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be an int >= 1 (bytes of dense gradient per group), got {v!r}")
        self.inner = inner
        self.first_bytes = first_bytes
        self.group_bytes = group_bytes
        self.enabled = bool(enabled)
        self._plan: dict[str, _Group] = {}  # member name -> its planned group (this step)
        self._groups: list[_Group] = []  # planned groups of this step, in order
        self._extra: _Group | None = None  # the open group of members nobody planned
        self._extras: list[_Group] = []
        self._seen: list[_Member] = []  # members of this step (next step's plan)
        self._note: tuple[float, int] | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # group name -> reusable send buffer
        self._flushed = False  # flush() came: the step's decodes run, allgathers go at once

    @property
    def grouped(self) -> bool:
        """Whether allgathers travel in groups (a setting every rank must share: the codecs check it)."""
        return self.enabled

    # ------------------------------------------------------------------ Collectives
    def size(self) -> int:
        return self.inner.size()

    def rank(self) -> int:
        return self.inner.rank()

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        if not self.enabled or self._flushed:
            return self.inner.allgather_async(tensor, name)
        order, numel = self._note if self._note is not None else (float(len(self._seen)), tensor.numel())
        self._note = None
        self._seen.append(_Member(name, order, numel))
        group = self._plan.get(name)
        if group is None or name in group.filed or group.handle is not None:  # unplanned, or planned differently
            if self._extra is None or self._extra.handle is not None:
                self._extra = _Group("", [])  # named and ordered when sent: arrival order may differ by rank
                self._extras.append(self._extra)
            group = self._extra
            group.members.append(name)
        group.filed[name] = tensor
        if group is not self._extra and group.complete:
            self._send(group)
        return MemberHandle(group, name, tensor.dtype, tuple(tensor.shape[1:]))

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Any:
        """The host's allreduce (an average), at once (the host fuses small ones itself)."""
        return self.inner.allreduce_async(tensor, name)  # type: ignore[attr-defined]

    def alltoall_async(self, tensor: torch.Tensor, splits: Sequence[int], name: str) -> Any:
        """The host's alltoall, at once (not grouped)."""
        return self.inner.alltoall_async(tensor, splits, name)  # type: ignore[attr-defined]

    def wait(self, handle: Any) -> torch.Tensor:
        if not isinstance(handle, MemberHandle):
            return self.inner.wait(handle)
        group = handle.group
        if group.handle is None:
            self._send(group)
        if group.result is None:
            group.result = self.inner.wait(group.handle)
            group.index = self._directory(group)
        parts = [group.result[off:off + n] for off, n in group.index[handle.name]]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return flat.view(handle.dtype).reshape(-1, *handle.trailing)

    # ------------------------------------------------------------------ steps
    def note(self, order: float, numel: int) -> None:
        """The next allgather (if the codec starts one) is for a gradient of `numel` elements expected at
        position `order` of the step (lower: earlier in backward)."""
        self._note = (float(order), int(numel))

    def begin_step(self) -> None:
        """Plan this step's groups from the members of the last one; forget the last step's groups."""
        seen = sorted(self._seen, key=lambda m: (m.order, m.name))
        self._seen, self._flushed = [], False
        self._plan, self._groups, self._extra, self._extras, self._note = {}, [], None, [], None
        for bucket in cut_buckets([m.numel for m in seen], self.first_bytes, self.group_bytes):
            group = _Group(f"crossover.group.{seen[bucket[0]].name}", [seen[i].name for i in bucket])
            self._groups.append(group)
            self._plan.update((name, group) for name in group.members)

    def flush(self) -> None:
        """Send every group still open: planned ones in order, then the unplanned members. Allgathers started
        after this, until `begin_step()`, go to the host at once."""
        self._flushed = True
        for group in self._groups:
            if group.handle is None and group.filed:
                self._send(group)
        for group in self._extras:
            if group.handle is None:
                self._send(group)

    def reset(self) -> None:
        """Forget the step in flight and the plan (an elastic reset)."""
        self._seen, self._flushed = [], False
        self._plan, self._groups, self._extra, self._extras, self._note = {}, [], None, [], None

    # ------------------------------------------------------------------ internals
    def _send(self, group: _Group) -> None:
        """One allgather of this rank's part: directory, then every filed member, in planned order."""
        names = [n for n in group.members if n in group.filed]
        if not group.name:  # unplanned members: in the order every rank knows, named after the first of them
            rank_of = {m.name: (m.order, m.name) for m in self._seen}
            names.sort(key=lambda n: rank_of.get(n, (0.0, n)))
            group.name = f"crossover.group.extra.{names[0]}"
        group.members = names
        head_words = 3 + 2 * len(names)
        head = _padded(4 * head_words)
        sizes = [group.filed[n].numel() * group.filed[n].element_size() for n in names]
        total = head + sum(_padded(s) for s in sizes)
        device = group.filed[names[0]].device
        buf = self._buffers.get(group.name)
        if buf is None or buf.numel() != total or buf.device != device:
            buf = torch.zeros(total, dtype=torch.uint8, device=device)
            self._buffers[group.name] = buf
        words = [_MAGIC, total, len(names)]
        for n, s in zip(names, sizes):
            words += [_fingerprint(n), s]
        buf[:4 * head_words].view(torch.int32).copy_(torch.tensor(words, dtype=torch.int32, device=device))
        off = head
        for n, s in zip(names, sizes):
            buf[off:off + s].copy_(group.filed[n].contiguous().reshape(-1).view(torch.uint8))
            off += _padded(s)
        group.filed.clear()  # the codecs' buffers are not needed after the copy
        group.handle = self.inner.allgather_async(buf, group.name)

    def _directory(self, group: _Group) -> dict[str, list[tuple[int, int]]]:
        """Where each member's bytes are in each rank's part; raises when a rank grouped other tensors."""
        res = group.result
        assert res is not None
        index: dict[str, list[tuple[int, int]]] = {n: [] for n in group.members}
        mine = [_fingerprint(n) for n in group.members]
        off = 0
        for r in range(self.size()):
            if off + 12 > res.numel():
                raise RuntimeError(f"{group.name}: the allgather ended before rank {r}'s part (ranks disagree)")
            magic, total, count = res[off:off + 12].view(torch.int32).tolist()
            if magic != _MAGIC or total < 12 or off + total > res.numel():
                raise RuntimeError(f"{group.name}: rank {r}'s part is not a crossover group (ranks disagree on "
                                   "how this step's tensors travel)")
            words = res[off + 12:off + 12 + 8 * count].view(torch.int32).tolist()
            prints, sizes = words[0::2], words[1::2]
            if prints != mine:
                raise RuntimeError(
                    f"{group.name}: rank {r} of the process set grouped {count} tensors that differ from this rank's "
                    f"{len(mine)} ({', '.join(group.members)}): every rank must compress the same parameters under "
                    "the same names (same model, same named_parameters)")
            pos = off + _padded(4 * (3 + 2 * count))
            for n, s in zip(group.members, sizes):
                index[n].append((pos, s))
                pos += _padded(s)
            off += total
        if off != res.numel():
            raise RuntimeError(f"{group.name}: {res.numel() - off} unexpected trailing bytes after every rank's part")
        return index
