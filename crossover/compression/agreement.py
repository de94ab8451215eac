"""What the ranks must agree on for one compressed tensor, and the check that turns a disagreement into an error.

The collectives a codec issues itself (the allgather of pairs or bitmaps, the sparse reduce-scatter's alltoall and
allgather, the agreed set's proposals) match across ranks only when every rank compresses the tensor alike: a rank
that sends it by another transport, ungrouped, at another CF, or at another shape submits collectives the others
never match, and Horovod waits for them forever (or sums what should not be summed). The host's own reduction of
the statistics vector still completes: it has the same length on every rank. So every rank writes into that vector
(`wire.SparseStatsLayout(checks=True)`) fingerprints of what it did (`Agreement.values`), and every rank judges
their reduced sums in decode (`Agreement.check`) before it waits on any collective of the codec's own: a
disagreement raises `RanksDisagree` on every rank alike (the sums are the same everywhere), naming the group of
settings that differs, this rank and its own value (the messages of all ranks together show who differs).

Plain Python, no framework: each group's fingerprint pieces are small integers in [1, F] (`wire.check_span`: F =
512 // world) whose sums over ranks survive float32; a group of free-form values (shapes, CFs) is a digest of them
cut into two pieces (two differing values slip through once in F^2: 65 000 on 2 ranks, 4 000 on 8, 64 on 64), a
group of few values (the transport, the format) an exact code (exact up to 85 ranks, then taken modulo F). From 512
ranks on every piece is 1: nothing is checked.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .wire import CHECK_LEN, CHECK_SLOTS, check_span, pieces_disagree, seed_fingerprint

__all__ = ["Agreement", "RanksDisagree"]

#: Transports with an exact code (others are hashed): cost_model's names.
_TRANSPORTS = ("dense", "allreduce", "allgather", "agreed", "scatter", "powersgd")


class RanksDisagree(ValueError, RuntimeError):
    """The ranks compress one tensor differently (raised on every rank alike, before any collective could hang).

    A ValueError (a setting differs between ranks, as the seed check raised before) and a RuntimeError (as Horovod's
    own "Mismatched ... tensor shapes", which the shape check answers first now)."""


@dataclass(frozen=True)
class Agreement:
    """What this rank did with one tensor in one step, as far as the other ranks must do the same."""

    shape: tuple[int, ...]
    dtype: str
    compressor: str
    sent_cf: float  # the plan's CF (1: dense)
    probes: tuple[float, ...]  # the CFs the plan measures
    transport: str  # the transport decided for this tensor (cost_model's names)
    seed: int | None = None  # the seed, where the codec draws from it what every rank must share (else None)
    grouped: bool = False  # the codec's allgathers travel in groups (GroupedCollectives)
    bitmap: bool = False  # its allgather sends a bitmap and values (else pairs)

    @classmethod
    def of(cls, tensor: Any, *, sent_cf: float, probes: Sequence[float] = (), **rest: Any) -> Agreement:
        """The agreement for a framework tensor (anything with ``shape`` and ``dtype``), its CFs as plain floats."""
        return cls(shape=tuple(int(d) for d in tensor.shape), dtype=str(tensor.dtype).replace("torch.", ""),
                   sent_cf=float(sent_cf), probes=tuple(float(p) for p in probes), **rest)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def values(self, world: int) -> list[float]:
        """The CHECK_LEN floats this rank puts in its statistics vector: per piece f and f^2 (CHECK_SLOTS' order)."""
        return list(_values(self, world))

    def check(self, checks: Sequence[float], one: float, world: int, key: str, rank: int) -> None:
        """Raise `RanksDisagree` when the reduced checks say that some rank did otherwise (the same on every rank).

        `checks`: the CHECK_LEN reduced check floats as the host left them; `one`: the reduced first entry of the
        vector (1 summed over ranks and scaled like the rest), which turns them back into sums."""
        if len(checks) != CHECK_LEN or not (math.isfinite(one) and one > 0):
            return
        to_sum = world / one
        i = 0
        for slot, pieces in CHECK_SLOTS:
            for _ in range(pieces):
                f, f2 = checks[i] * to_sum, checks[i + 1] * to_sum
                i += 2
                if math.isfinite(f) and math.isfinite(f2) and pieces_disagree(f, f2, world):
                    raise RanksDisagree(self.message(slot, key, rank))

    def message(self, slot: str, key: str, rank: int) -> str:
        """What this rank says when the ranks disagree on `slot` (one of CHECK_SLOTS)."""
        here = f"this rank ({rank})"
        if slot == "tensor":
            return (f"crossover: the ranks disagree on the shape of {key!r}: {here} has it as {self.dtype} of shape "
                    f"{tuple(self.shape)} ({self.numel} elements). Every rank must compress the same parameters under "
                    "the same names with the same shapes (same model, same named_parameters): values at the same "
                    "positions of different shapes would be summed as one tensor")
        if slot == "compression":
            probing = f", probing CF {', '.join(f'{p:g}' for p in self.probes)}" if self.probes else ""
            return (f"crossover: the ranks disagree on the compressor or compression factor of {key!r}: {here} "
                    f"sends it with {self.compressor} at CF {self.sent_cf:g}{probing}. Create the compression "
                    "object alike on every rank (compressor, cf or cf_min/cf_max, the policy's settings) and give "
                    "every rank the same state (load_state_dict on every rank, or sync())")
        if slot == "transport":
            return (f"crossover: the ranks disagree on the transport of {key!r}: {here} sends it by "
                    f"{self.transport!r}. The transport= setting decides it with the cost model (alike on every "
                    "rank for the same plan and tensor): set transport= alike on every rank")
        if slot == "format":
            how = "in groups (grouped=True)" if self.grouped else "one collective per tensor (grouped=False)"
            form = "a bitmap and values" if self.bitmap else "(index, value) pairs"
            return (f"crossover: the ranks disagree on how the allgathers of {key!r} travel: {here} sends them "
                    f"{how}, as {form}. Set the compression object's grouped (and its codec's gather_bitmap) alike "
                    "on every rank")
        if slot == "seed":
            drawn = {"agreed": "the agreed index set's first draw", "powersgd": "the first Q of its factors"}.get(
                self.transport, "the indices every rank sends")
            return (f"crossover: the ranks disagree on the seed of {key!r}: {here} has seed={self.seed}. The ranks "
                    f"were given different seeds, and {self.compressor} draws {drawn} from the seed, so the replicas "
                    "would silently diverge. Pass the same seed on every rank (not hvd.rank())")
        raise ValueError(f"unknown check {slot!r}")


def _digest(parts: tuple, pieces: int, span: int) -> list[int]:
    """`pieces` values in [1, span] from a digest of `parts` (their repr: ints, floats and strings print exactly)."""
    d = hashlib.blake2b(repr(parts).encode(), digest_size=8 * pieces).digest()
    return [1 + int.from_bytes(d[8 * i:8 * i + 8], "little") % span for i in range(pieces)]


def _code(value: int, span: int) -> int:
    """An exact code in [1, span] (distinct codes stay distinct while below span)."""
    return 1 + value % span


@functools.lru_cache(maxsize=4096)
def _values(a: Agreement, world: int) -> tuple[float, ...]:
    span = check_span(world)
    kind = _TRANSPORTS.index(a.transport) if a.transport in _TRANSPORTS else _digest((a.transport,), 1, 1 << 30)[0]
    pieces = {
        "tensor": _digest(("tensor", tuple(int(d) for d in a.shape), a.dtype, a.numel), 2, span),
        "compression": _digest(("compression", a.compressor, float(a.sent_cf), tuple(float(p) for p in a.probes)),
                               2, span),
        "transport": [_code(kind, span)],
        "format": [_code(int(a.grouped) + 2 * int(a.bitmap), span)],
        "seed": [1 if a.seed is None else int(seed_fingerprint(a.seed, world))],
    }
    out: list[float] = []
    for slot, n in CHECK_SLOTS:
        got = pieces[slot]
        assert len(got) == n
        out.extend(v for f in got for v in (float(f), float(f * f)))
    return tuple(out)
