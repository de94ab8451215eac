"""What every rank derives alike, with no framework and no communication: the layout of the statistics that
ride in a compressed payload, the per-(step, tensor) seeds, the levels of a b-bit quantization code, k at a CF and
when the allgather sends a bitmap (its size), and what the ranks must agree on for one compressed tensor
(`Agreement`) with the check that turns a disagreement into an error.

Why the agreement: the collectives a codec issues itself (allgathers, the reduce-scatter's alltoall, the agreed set's
proposals, the low-rank factors) match across ranks only when every rank compresses the tensor alike; a rank that
sends it otherwise submits collectives the others never match, and Horovod waits forever (or sums what should not be
summed). The host's reduction of the statistics vector still completes (same length everywhere), so every rank
writes fingerprints of what it did into it (`Agreement.values`) and judges the reduced sums in decode
(`Agreement.check`) before it waits on any collective of the codec's own: a disagreement raises `RanksDisagree` on
every rank alike, naming the group of settings that differs, this rank and its own value. Each group's pieces are
small integers in [1, F] (`check_span`: F = 512 // world) whose sums survive float32; free-form values (shapes, CFs)
are a digest cut into two pieces (two differing values slip through once in F^2: 65 000 on 2 ranks, 4 000 on 8), a
group of few values (transport, format) an exact code (exact up to 85 ranks). From 512 ranks on nothing is checked.

Plain Python (no torch): the codecs (this package), the step driver (``crossover/driver/``) and the policies
(``crossover/adaptive/``) all read these definitions, so each lives once, here, at the bottom of the layers.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Agreement", "RanksDisagree", "CHECK_LEN", "CHECK_SPAN", "CHECK_SLOTS", "INDEX_BYTES", "MAX_BITS",
           "MIN_BITS", "QUANT_STATS_LEN", "SEED_CHECK_SPAN", "STAT_MAX", "SparseStatsLayout", "check_same_parameters",
           "check_span",
           "clamp_stat", "gather_bitmap", "gather_bitmap_bytes", "k_for", "levels_for_bits", "normalize_reduced",
           "pieces_disagree", "seed_fingerprint", "seeds_disagree", "shared_seed"]

#: Statistics travel in float32 and are summed over ranks: each rank's finite values are clamped to STAT_MAX
#: (2**100) so that a sum over up to 2**27 ranks cannot overflow float32 (max ~2**128). They are computed in
#: float64 (a gradient of 1e36 per element has a finite ||g||^2 there). A reduced statistic at or above
#: STAT_MAX means some rank saturated: that step is not shown to the policy.
STAT_MAX = 2.0 ** 100
#: The statistics of a quantized payload: [1, ||x||^2].
QUANT_STATS_LEN = 2
#: The agreement checks that end a torch codec's statistics vector (``SparseStatsLayout(checks=True)``), in the order
#: they are judged: per group of facts that every rank must share for the collectives to match (or for the replicas
#: to stay equal), that many fingerprint pieces f, each an integer in [1, F] sent with its square. Summed over ranks,
#: sum(f^2) - sum(f)^2 / world is the pieces' spread: 0 when every rank sent the same f (`pieces_disagree`), so the
#: reduction every host already runs tells every rank alike whether the group agrees, even when the codec's own
#: collectives (allgather, alltoall) would never match. Groups: the tensor (shape, dtype, element count), the
#: compression (compressor, CF sent, CFs probed), the transport decided for the tensor, the format of its allgathers
#: (grouped or not, bitmap or pairs) and the seed (where something every rank must share is drawn from it). A group
#: is judged after those it depends on, so that the first that disagrees is the cause.
CHECK_SLOTS: tuple[tuple[str, int], ...] = (("tensor", 2), ("compression", 2), ("transport", 1), ("format", 1),
                                            ("seed", 1))
#: Floats the checks add to the statistics vector: each piece and its square.
CHECK_LEN = 2 * sum(n for _, n in CHECK_SLOTS)
#: Fingerprint pieces are integers in [1, F], F = CHECK_SPAN // world (`check_span`), so that world x F <= 512: the
#: spread of the reduced sums comes back from a float32 reduction within 4 world^2 F^2 2^-24 <= 0.07 of the exact
#: value, even in the worst case, where each rank's vector is scaled by 1/world before W sequential float32 additions
#: (the DDP hook; Horovod sums first, exactly, then scales). `pieces_disagree` tests the spread against 0.25, and a
#: rank whose f differs by 1 or more makes it >= 0.5. From 512 ranks on F is 1 and the checks are off.
CHECK_SPAN = 512
#: Seed fingerprints f in [1, SEED_CHECK_SPAN // world] (`seed_fingerprint`): within the same bound. Above 250 ranks
#: the span is 1 and the seed check is off.
SEED_CHECK_SPAN = 500
#: Bits of a quantization code: one sign bit + at least one magnitude bit ...
MIN_BITS = 2
#: ... and codes that fit one uint8.
MAX_BITS = 8


def clamp_stat(x: float, hi: float = STAT_MAX) -> float:
    """`x` clamped to `hi` when finite; inf and NaN stay as they are (they mark a non-finite step)."""
    return min(x, hi) if math.isfinite(x) else x


def shared_seed(seed: int, step: int, key: str) -> int:
    """A 63-bit seed for (step, tensor) that every rank computes alike with no communication (FNV-1a)."""
    h = 1469598103934665603
    for ch in f"{seed}:{step}:{key}".encode():
        h = ((h ^ ch) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def seed_fingerprint(seed: int, world: int) -> float:
    """This rank's seed fingerprint in [1, F], F = SEED_CHECK_SPAN // world: seed mod F shifted by a hash of
    seed // F. Seeds of one block of F (0, 1, ... as when seeded with the rank) always differ while the world
    is at most F; seeds of different blocks (7 and 1007) differ but with chance 1/F."""
    span = max(1, SEED_CHECK_SPAN // max(1, world))
    block, rest = divmod(int(seed), span)
    return float(1 + (rest + shared_seed(block, 0, "seed-check")) % span)


def check_span(world: int) -> int:
    """F, the number of values a fingerprint piece takes at this world size: CHECK_SPAN // world (256 on 2 ranks, 64 on
    8, 8 on 64; 1 from 512 ranks on, where every piece is 1 and the checks are off)."""
    return max(1, CHECK_SPAN // max(1, world))


def pieces_disagree(sum_f: float, sum_f2: float, world: int) -> bool:
    """Whether the ranks' fingerprint pieces differ, from their sums over ranks (the same verdict on every rank):
    sum(f^2) - sum(f)^2 / world is the sum of squared deviations from the mean, 0 when all are equal."""
    return sum_f2 - sum_f * sum_f / world > 0.25


#: The seed's pieces are judged as every other piece.
seeds_disagree = pieces_disagree


def levels_for_bits(bits: int) -> int:
    """Magnitude levels s that b-bit codes hold: 2**(b-1) - 1 (one sign bit). 2 -> 1 (ternary), 8 -> 127."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
    return (1 << (bits - 1)) - 1


@dataclass(frozen=True)
class SparseStatsLayout:
    """Layout of the statistics that ride in every compressed payload, for `nprobes` probed CFs.

    ``[1, step time, ||g||^2, ||g||, ||g+e||^2, ||g+e||, momentum, ||C_cf_i(g+e)||^2 ..., ||C_cf_i(g+e)|| ...]``
    with g the local gradient, e its error-feedback residual and C_cf the compressor at factor cf.
    The norms are summed over tensors (by the driver) and over ranks (by the reduction), which is what the
    policy's gain definitions are written in. The first is 1.0 on every rank, so after the reduction it tells
    the scale the framework applied (``normalize_reduced``). The step time and the optimizer's momentum (the
    factor by which the optimizer carries an update into later steps; 0 when none or unknown) are averaged over
    ranks, so that every rank reads the same values.
    With ``checks`` (the torch codecs; TensorFlow's accumulated statistics have none), CHECK_LEN more entries end it:
    the agreement checks (``CHECK_SLOTS``, `Agreement`), which every rank judges in
    decode before it waits on any collective of the codec's own.
    """

    nprobes: int
    checks: bool = True
    ONE = 0
    STEP_TIME = 1
    GRAD_SQ = 2
    GRAD_NORM = 3
    ACC_SQ = 4
    ACC_NORM = 5
    MOMENTUM = 6
    HEAD = 7

    @property
    def length(self) -> int:
        return self.HEAD + 2 * self.nprobes + (CHECK_LEN if self.checks else 0)

    @property
    def check_start(self) -> int:
        """Index of the first agreement check (CHECK_LEN of them end the vector); only with ``checks``."""
        return self.HEAD + 2 * self.nprobes

    def probe_sq(self, i: int) -> int:
        return self.HEAD + i

    def probe_norm(self, i: int) -> int:
        return self.HEAD + self.nprobes + i

    def local(self, *, step_time: float, grad_sq: float, acc_sq: float, probe_sq: Sequence[float],
              checks: Sequence[float] | None = None, momentum: float = 0.0) -> list[float]:
        """One tensor's vector on one rank, from squared norms (the norms are their square roots) and, with
        ``checks``, this rank's CHECK_LEN agreement checks (None: pieces of 1, which agree with each other).

        Every value is clamped to STAT_MAX (`clamp_stat`) so that it converts to float32 and its sum
        over ranks stays finite; a non-finite input stays non-finite, so the reduced vector is
        non-finite on every rank.
        """
        if len(probe_sq) != self.nprobes:
            raise ValueError(f"expected {self.nprobes} probe norms, got {len(probe_sq)}")
        out = [clamp_stat(v) for v in (1.0, step_time, grad_sq, _sqrt(grad_sq), acc_sq, _sqrt(acc_sq), momentum,
                                       *probe_sq, *(_sqrt(v) for v in probe_sq))]
        if self.checks:
            if checks is None:
                checks = [1.0] * CHECK_LEN
            if len(checks) != CHECK_LEN:
                raise ValueError(f"expected {CHECK_LEN} agreement checks, got {len(checks)}")
            out.extend(checks)
        return out


def _sqrt(x: float) -> float:
    return math.sqrt(x) if x > 0 else (0.0 if x == 0 else float("nan"))


def normalize_reduced(reduced: Sequence[float], world: int) -> list[float] | None:
    """A reduced statistics vector as sums over ranks (step time and momentum: the means); None if unusable.

    ``reduced[0]`` is 1 summed or averaged over ranks and scaled like the payload: it is the factor
    that turns the reduction back into a sum (``world / reduced[0]``) or a mean (``1 / reduced[0]``).
    """
    scale = float(reduced[0])
    if not (math.isfinite(scale) and scale > 0):
        return None
    to_sum = world / scale
    out = [1.0, float(reduced[1]) / scale]
    out.extend(float(v) * to_sum for v in reduced[2:])
    if len(out) > SparseStatsLayout.MOMENTUM:
        out[SparseStatsLayout.MOMENTUM] = float(reduced[SparseStatsLayout.MOMENTUM]) / scale
    return out


def k_for(numel: int, cf: float) -> int:
    """Number of elements kept at compression factor cf (at least one)."""
    return max(1, min(numel, int(math.ceil(numel / cf))))


INDEX_BYTES = 4  # a sparse element's index travels as an int32


def gather_bitmap_bytes(numel: int) -> int:
    """Bytes of the bitmap of a whole tensor in the allgather's bitmap format: a bit per element, in whole rows of
    the allgather's payload (two int32: 64 bits)."""
    return math.ceil(int(numel) / 64) * 8


def gather_bitmap(k: int, numel: int) -> bool:
    """Whether a rank's k selected entries of ``numel`` go by allgather as a bitmap + values (else (index, value)
    pairs): when the bitmap costs less than the indices, ``bitmap < 4 k`` (about k > n / 32). The same on every
    rank."""
    return gather_bitmap_bytes(numel) < INDEX_BYTES * int(k)


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
            return _shape_message(key, here, self.dtype, self.shape)
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


def _shape_message(key: str, here: str, dtype: str, shape: Sequence[int]) -> str:
    return (f"crossover: the ranks disagree on the shape of {key!r}: {here} has it as {dtype} of shape "
            f"{tuple(shape)} ({math.prod(shape)} elements). Every rank must compress the same parameters under "
            "the same names with the same shapes (same model, same named_parameters): values at the same "
            "positions of different shapes would be summed as one tensor")


def check_same_parameters(every: Sequence[Sequence[tuple[str, str, tuple[int, ...]]]], rank: int) -> None:
    """Raise `RanksDisagree` (the same on every rank) unless every rank's parameters, `every[r]` as (name, dtype,
    shape) in registration order, are alike: a host that sends several gradients as one flat bucket checks them
    once, since the bucket's own shape cannot tell (100, 200) from (200, 100)."""
    mine, here = list(every[rank]), f"this rank ({rank})"
    for other in every:
        other = list(other)
        if other == mine:
            continue
        for i in range(max(len(mine), len(other))):
            a = mine[i] if i < len(mine) else None
            b = other[i] if i < len(other) else None
            if a is not None and b is not None and a[0] == b[0]:
                if a != b:
                    raise RanksDisagree(_shape_message(a[0], here, a[1], a[2]))
                continue
            has = f"{a[0]!r} ({a[1]} of shape {tuple(a[2])})" if a is not None else "nothing"
            raise RanksDisagree(f"crossover: the ranks disagree on the parameters to compress: at position {i} of "
                                f"the optimizer's parameters {here} has {has}. Every rank must compress the same "
                                "parameters under the same names in the same order (same model, same "
                                "named_parameters)")


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
