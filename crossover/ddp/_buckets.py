"""Which parameters a DDP bucket holds, and error feedback that survives DDP regrouping them.

DDP hands the hook one flat buffer per bucket. The codecs keep their error-feedback residual per key,
and the hook's key is the bucket index: the residual is then one flat tensor aligned with the bucket's
buffer, used in place every step (no copy). But DDP rebuilds its buckets after the first iteration (in
the order gradients became ready, with a small first bucket), and a resumed run starts again from the
initial buckets, so a bucket index does not always hold the same parameters.

`BucketLayouts.key(bucket)` notices a bucket whose parameters differ from what that index held before,
and moves the residuals across: every bucket that shared a parameter with the new one is cut into
per-parameter pieces, and the new bucket's residual is assembled from the pieces of its parameters
(zeros for parameters never seen). That costs one copy of the residuals, once per rebuild.

Parameters are named by their ordinal: the order in which DDP first presented them to the hook (bucket
by bucket, in each bucket's order). A fresh DDP presents the same model's parameters in the same order,
so checkpoints store residuals per ordinal (`pieces()`), and a resumed run reassembles them into
whatever buckets it has (`load()`).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from crossover.compression.memory import ErrorFeedback

__all__ = ["BucketLayouts", "Layout"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """The parameters of one bucket: their identities, ordinals, offsets and sizes in its buffer."""

    ids: tuple[int, ...]
    ordinals: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.numels)


def bucket_key(index: int) -> str:
    """The codecs' key of bucket `index` (residuals, buffers, shared seeds)."""
    return f"bucket{index}"


class BucketLayouts:
    """Bucket layouts seen so far, and the move of residuals (in `memory`) when a layout changes."""

    def __init__(self, memory: ErrorFeedback) -> None:
        self.memory = memory
        self._ordinal: dict[int, int] = {}  # id(parameter) -> ordinal
        self._params: list[torch.Tensor] = []  # the parameters themselves: keeps their ids valid
        self._layouts: dict[int, Layout] = {}  # bucket index -> layout
        self._owner: dict[int, int] = {}  # ordinal -> bucket index whose residual holds it
        self._loose: dict[int, torch.Tensor] = {}  # ordinal -> residual piece not in any bucket
        self.rebuilds = 0  # layouts that replaced an earlier one (telemetry, tests)

    # ------------------------------------------------------------------ per bucket
    def key(self, index: int, params: Sequence[torch.Tensor], buffer: torch.Tensor) -> str:
        """The key of this bucket; if its parameters changed, its residual is rebuilt first."""
        key = bucket_key(index)
        ids = tuple(id(p) for p in params)
        old = self._layouts.get(index)
        if old is not None and old.ids == ids:
            return key
        layout = self._layout(ids, params)
        if layout.numel != buffer.numel():
            # a layout we cannot map (e.g. sparse gradients): keep the residual by key only
            log.warning("DDP bucket %d: %d elements in its parameters, %d in its buffer; its error-feedback "
                        "residual cannot follow a change of buckets", index, layout.numel, buffer.numel())
            self._layouts[index] = layout
            return key
        if old is not None:
            self.rebuilds += 1
        # cut every bucket that holds one of these parameters (and this index's old bucket) into pieces
        holders = {self._owner[o] for o in layout.ordinals if o in self._owner}
        if old is not None:
            holders.add(index)
        for h in sorted(holders):
            self._explode(h)
        if self.memory.enabled:
            res = torch.zeros_like(buffer.reshape(-1))
            for o, off, n in zip(layout.ordinals, layout.offsets, layout.numels):
                piece = self._loose.pop(o, None)
                if piece is None:
                    continue
                if piece.numel() == n:
                    res[off:off + n].copy_(piece.reshape(-1))
                else:
                    log.warning("error-feedback residual of parameter #%d has %d elements, the parameter %d: "
                                "dropped", o, piece.numel(), n)
            self.memory.put(key, res)
        self._layouts[index] = layout
        for o in layout.ordinals:
            self._owner[o] = index
        return key

    def ordinals(self, params: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """Each parameter's ordinal (assigned in the order parameters are first seen)."""
        return self._layout(tuple(id(p) for p in params), params).ordinals

    def _layout(self, ids: tuple[int, ...], params: Sequence[torch.Tensor]) -> Layout:
        ordinals, offsets, numels = [], [], []
        off = 0
        for i, p in zip(ids, params):
            o = self._ordinal.get(i)
            if o is None:
                o = self._ordinal[i] = len(self._params)
                self._params.append(p)
            ordinals.append(o)
            offsets.append(off)
            numels.append(p.numel())
            off += p.numel()
        return Layout(ids, tuple(ordinals), tuple(offsets), tuple(numels))

    def _explode(self, index: int) -> None:
        """Turn bucket `index`'s residual into per-parameter pieces and forget its layout."""
        layout = self._layouts.pop(index, None)
        res = self.memory.pop(bucket_key(index))
        if layout is None:
            return
        for o, off, n in zip(layout.ordinals, layout.offsets, layout.numels):
            if self._owner.get(o) == index:
                del self._owner[o]
                if res is not None and res.numel() >= off + n:
                    self._loose[o] = res[off:off + n].clone()

    # ------------------------------------------------------------------ checkpoints
    def pieces(self) -> dict[int, torch.Tensor]:
        """Every residual as a copy per parameter ordinal (flat tensors)."""
        out = {o: t.clone() for o, t in self._loose.items()}
        for index, layout in self._layouts.items():
            res = self.memory.get(bucket_key(index))
            if res is None or res.numel() != layout.numel:
                continue
            for o, off, n in zip(layout.ordinals, layout.offsets, layout.numels):
                out[o] = res[off:off + n].clone()
        return out

    def by_parameter(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, copy of its flat residual) for every parameter with a residual."""
        pieces = self.pieces()
        return [(self._params[o], pieces[o]) for o in sorted(pieces) if o < len(self._params)]

    def validate(self, pieces: object) -> None:
        """Raise ValueError unless `pieces` can be loaded: a mapping of parameter ordinal (int >= 0) to a
        finite floating tensor with that parameter's number of elements, when this run has seen it (a
        fresh hook has seen none: a piece of another size is then dropped with a warning at its bucket)."""
        if not isinstance(pieces, Mapping):
            raise ValueError(f"residuals must be a mapping of parameter ordinal -> tensor, got {type(pieces).__name__}")
        for o, t in pieces.items():
            if isinstance(o, bool) or not isinstance(o, numbers.Integral) or o < 0:
                raise ValueError(f"residual key {o!r} must be a parameter ordinal (an int >= 0)")
            if not isinstance(t, torch.Tensor) or t.is_sparse or not t.is_floating_point():
                raise ValueError(f"residual of parameter #{o} must be a dense floating tensor, got "
                                 f"{type(t).__name__}{'' if not isinstance(t, torch.Tensor) else ' ' + str(t.dtype)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"residual of parameter #{o} holds inf/NaN values")
            if o < len(self._params) and t.numel() != self._params[o].numel():
                raise ValueError(f"residual of parameter #{o} has {t.numel()} elements; this model's parameter "
                                 f"#{o} has {self._params[o].numel()}")

    def load(self, pieces: Mapping[int, torch.Tensor]) -> None:
        """Replace every residual by `pieces` (from `pieces()`, checked by `validate`); buckets reassemble
        them as they come."""
        for index in list(self._layouts):
            self.memory.pop(bucket_key(index))
        self._layouts.clear()
        self._owner.clear()
        self._loose = {int(o): t.detach().reshape(-1).clone() for o, t in pieces.items()}

    def reset(self) -> None:
        """Forget the layouts (not the ordinals): the next bucket of each index is mapped afresh."""
        self.load(self.pieces())
