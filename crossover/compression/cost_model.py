"""What a compressed tensor costs on the wire, per worker, for each way it can travel (plain numbers, no torch).

An alpha-beta model of the ring collectives that Gloo runs (Horovod's Gloo ops and torch.distributed on Gloo):
a collective of ``steps`` rounds moving ``B`` bytes through each worker takes ``steps * alpha + B * 8 / rate``.

* ring allreduce of M bytes: ``2 (W-1)`` rounds, each worker receives (and sends) ``2 (W-1)/W * M`` bytes;
* ring allgather of m bytes per rank: ``W-1`` rounds, each worker receives ``(W-1) * m`` bytes.

Bytes are counted as received per worker (in a ring, what it sends too), payload only: no TCP/IP framing,
no Horovod coordination traffic (``benchmarks/bench_scaling.py`` measures both on emulated hosts).

The transports the codecs use (``transport.py``), per tensor of n float32 elements sending k of them:

* ``DENSE``: allreduce of the n values (and the statistics);
* ``ALLREDUCE``: allreduce of k values at indices every rank shares (random-k from a shared seed);
* ``ALLGATHER``: allgather of each rank's own k (int32 index, fp32 value) pairs, or of a bitmap of the whole
  tensor plus the k values where that costs less (``wire.gather_bitmap``: about CF < 32), the statistics by allreduce;
* ``AGREED``: allreduce of k values at an index set every rank agreed on in the previous step, plus an
  allgather of each rank's ``ceil(k / W^2)`` index proposals for the next step while W k <= n / 2
  (``agreed_share``, ``agreed.py``);
* ``SCATTER``: a sparse reduce-scatter (``scatter.py``): each rank's k entries go by one alltoall to the ranks
  that own their indices (about k (W-1)/W received per worker when the indices spread over the owners), then
  each owner's ``ceil(k / W)`` largest sums by one allgather: about 2 k (W-1)/W entries per worker, flat in W;
  an entry is an (index, value) pair, or a value plus a bit per position of its owner's stretch where that
  costs less (``scatter_bitmap``).

Horovod's PyTorch allreduce only takes int32/int64/fp16/fp32/fp64, so a sparse element travels as an int32
index + an fp32 value (8 bytes). ``FP16`` (Horovod's own cast) and three schemes from the literature that the
codecs do not implement are modelled too, for the table in docs/scaling.md: ``GTOPK`` (gTop-k, a tree of
log2 W rounds of k pairs, then the result back down the tree), ``OKTOPK`` (Ok-Topk's published bound of 6k(W-1)/W
pairs, with W-1 + log2 W rounds) and ``POWERSGD`` (two allreduces of k/2 values each, a rank-r factor pair
holding k elements in all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from crossover.compression.wire import INDEX_BYTES, gather_bitmap, gather_bitmap_bytes

__all__ = ["AGREED", "AGREED_PROPOSAL_COVER", "ALLGATHER", "ALLREDUCE", "CODEC_TRANSPORTS", "Cost", "DENSE",
           "FP16", "GTOPK", "Link", "MODELLED", "OKTOPK", "POWERSGD", "SCATTER", "agreed_proposals", "agreed_share",
           "allgather_bytes", "allreduce_bytes", "gather_part_bytes", "pairwise_alltoall", "ring_allgather",
           "ring_allreduce", "scatter_bitmap", "scatter_bitmap_bytes", "scatter_keep", "scatter_part_bytes",
           "transport_cost"]

DENSE = "dense"  # allreduce of the whole (error-compensated) tensor
ALLREDUCE = "allreduce"  # allreduce of values at indices every rank shares
ALLGATHER = "allgather"  # allgather of (index, value) pairs chosen by each rank
AGREED = "agreed"  # allreduce of values at an index set agreed the step before, allgather of proposals
SCATTER = "scatter"  # sparse reduce-scatter: pairs to their owners by alltoall, owners' largest sums by allgather
FP16 = "fp16"  # allreduce of the dense tensor cast to fp16 (Horovod's Compression.fp16)
GTOPK = "gtopk"  # modelled only: gTop-k tree reduction of k pairs
OKTOPK = "oktopk"  # modelled only: Ok-Topk's balanced sparse allreduce (its bound)
POWERSGD = "powersgd"  # modelled only: two allreduces of k/2 values (low-rank factors)

#: The transports the codecs implement, and every modelled one (for the table and plot).
CODEC_TRANSPORTS = (DENSE, ALLREDUCE, ALLGATHER, AGREED, SCATTER)
MODELLED = (DENSE, FP16, ALLGATHER, ALLREDUCE, AGREED, SCATTER, GTOPK, OKTOPK, POWERSGD)

VALUE_BYTES = 4
PAIR_BYTES = INDEX_BYTES + VALUE_BYTES
GATHER_HEADER_BYTES = 16  # sparse_codec.HEADER_ROWS rows of two int32 per rank, before its pairs
AGREED_CHECK = 8  # floats after the agreed values: four hashes of the index set and their squares
#: Proposals fill an agreed set only while W k (the elements the ranks' own top-k lists cover together) is at most
#: this share of the tensor (CF >= 2 W): on the digits MLP they gained 3.5 and 11 points at CF 10 on 2 and 4 ranks
#: (W k = 0.2 n, 0.4 n), about 1 at CF 100, and lost 2 to 11 at CF 10 on 8 ranks (0.8 n) with every share from
#: 1/40 to 1/4 (reports/transport-study.md).
AGREED_PROPOSAL_COVER = 0.5


def agreed_share(k: int, numel: int, world: int) -> float:
    """Share of an agreed set of k of ``numel`` elements filled by the ranks' proposals at ``world`` ranks (the
    shared seed draws the rest): min(1/2, 1/W) while W k <= AGREED_PROPOSAL_COVER numel, else 0 (a random-k set).
    1/W measured best of 1/2, 1/4 and 1/8 at 2, 4 and 8 ranks at CF 100 within a seed's spread
    (reports/transport-study.md): each rank's own top entries are noisier the more ranks share the set."""
    w = max(1, int(world))
    if w * int(k) > AGREED_PROPOSAL_COVER * int(numel) + w:  # + W: CF 2 W exactly keeps k = ceil(n / 2W)
        return 0.0
    return min(0.5, 1.0 / w)


@dataclass(frozen=True)
class Link:
    """A worker's link: ``alpha_s`` seconds per collective round, ``rate_bps`` bits per second each way."""

    alpha_s: float
    rate_bps: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha_s) and self.alpha_s >= 0):
            raise ValueError(f"alpha_s must be a finite number >= 0, got {self.alpha_s!r}")
        if not (math.isfinite(self.rate_bps) and self.rate_bps > 0):
            raise ValueError(f"rate_bps must be a finite number > 0, got {self.rate_bps!r}")


@dataclass(frozen=True)
class Cost:
    """Bytes one worker receives and the collective rounds on its critical path."""

    bytes: float
    rounds: float
    collectives: int = 1

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.bytes + other.bytes, self.rounds + other.rounds, self.collectives + other.collectives)

    def time_s(self, link: Link) -> float:
        """Seconds on ``link``: ``rounds * alpha + bytes * 8 / rate``."""
        return self.rounds * link.alpha_s + self.bytes * 8.0 / link.rate_bps


def _check(world: int, *counts: float) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world!r}")
    for c in counts:
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"byte and element counts must be finite and >= 0, got {c!r}")


def ring_allreduce(nbytes: float, world: int) -> Cost:
    """A ring allreduce of ``nbytes``: reduce-scatter then allgather, ``2 (W-1)`` rounds of ``nbytes / W``."""
    _check(world, nbytes)
    return Cost(2.0 * (world - 1) / world * nbytes, 2.0 * (world - 1))


def ring_allgather(nbytes_per_rank: float, world: int) -> Cost:
    """A ring allgather where every rank contributes ``nbytes_per_rank``: ``W-1`` rounds."""
    _check(world, nbytes_per_rank)
    return Cost(float(world - 1) * nbytes_per_rank, float(world - 1))


def pairwise_alltoall(nbytes_per_rank: float, world: int) -> Cost:
    """An alltoall where every rank sends ``nbytes_per_rank`` spread evenly over the ranks (itself included):
    ``W-1`` rounds (Gloo's pairwise exchange), each worker receives ``(W-1)/W`` of it."""
    _check(world, nbytes_per_rank)
    return Cost(float(world - 1) / world * nbytes_per_rank, float(world - 1))


def scatter_keep(k: int, numel: int, world: int) -> int:
    """Sums each owner keeps in a sparse reduce-scatter of k of ``numel`` elements over ``world`` ranks:
    ``ceil(k / W)``, at most the ``numel // W`` indices the smallest owner holds (the same on every rank)."""
    w = max(1, int(world))
    return max(0, min(-(-int(k) // w), int(numel) // w))


def scatter_bitmap_bytes(numel: int, world: int) -> int:
    """Bytes of the bitmap of one owner's stretch in the sparse reduce-scatter: a bit per position of the longest
    stretch, ``ceil(n / W)``, rounded up to 4 bytes so that the float32 values after it stay aligned."""
    positions = math.ceil(int(numel) / max(1, int(world)))
    return math.ceil(positions / 32) * 4


def scatter_bitmap(k: int, numel: int, world: int) -> bool:
    """Whether the sparse reduce-scatter sends bitmaps + values (else (index, value) pairs): when an owner's kept
    sums cost fewer bytes that way, ``bitmap + 4 keep < 8 keep`` (about k > n / 32). The same on every rank."""
    return scatter_bitmap_bytes(numel, world) < INDEX_BYTES * scatter_keep(k, numel, world)


def scatter_part_bytes(entries: float, numel: int, world: int, bitmap: bool) -> float:
    """Bytes of one message of the sparse reduce-scatter carrying ``entries`` entries to or from one owner."""
    return scatter_bitmap_bytes(numel, world) + VALUE_BYTES * entries if bitmap else PAIR_BYTES * entries


def gather_part_bytes(k: int, numel: int, bitmap: bool) -> float:
    """Bytes of one rank's part of the allgather (header aside): k pairs, or the bitmap and the k values in whole
    rows of two."""
    return gather_bitmap_bytes(numel) + 2 * VALUE_BYTES * math.ceil(int(k) / 2) if bitmap else PAIR_BYTES * int(k)


def allreduce_bytes(elements: int, world_size: int, width: int = VALUE_BYTES) -> float:
    """Bytes one rank sends (and receives) in a ring allreduce of ``elements`` values of ``width`` bytes."""
    return ring_allreduce(float(elements) * width, world_size).bytes


def allgather_bytes(elements: int, world_size: int, width: int = PAIR_BYTES) -> float:
    """Bytes one rank receives in a ring allgather contributing ``elements`` items of ``width`` bytes."""
    return ring_allgather(float(elements) * width, world_size).bytes


def agreed_proposals(k: int, numel: int, world: int, share: float | None = None) -> int:
    """Index proposals each rank sends for the next step's agreed set of k of ``numel`` elements:
    ``ceil(share k / W)``, ``share`` = ``agreed_share(k, numel, W)`` unless given; 0 when the share is 0."""
    share = agreed_share(k, numel, world) if share is None else share
    return math.ceil(share * int(k) / int(world) - 1e-9) if share > 0 else 0


def transport_cost(kind: str, numel: int, k: int, world: int, nstats: int = 0) -> Cost:
    """Bytes per worker and rounds of one tensor of ``numel`` float32 elements sending ``k`` of them by ``kind``.

    ``nstats``: floats of statistics riding with the payload (``wire.SparseStatsLayout.length``).
    """
    _check(world, numel, k, nstats)
    if kind == DENSE:
        return ring_allreduce(4.0 * (numel + nstats), world)
    if kind == FP16:
        return ring_allreduce(2.0 * numel, world)
    if kind == ALLREDUCE:
        return ring_allreduce(4.0 * (k + nstats), world)
    if kind == ALLGATHER:
        part = gather_part_bytes(k, numel, gather_bitmap(k, numel))
        return ring_allgather(part + GATHER_HEADER_BYTES, world) + ring_allreduce(4.0 * nstats, world)
    if kind == AGREED:
        values = ring_allreduce(4.0 * (k + AGREED_CHECK + nstats), world)
        m = agreed_proposals(k, numel, world)
        return values + ring_allgather(INDEX_BYTES * m, world) if m else values
    if kind == SCATTER:  # entries to their owners, the owners' kept sums to everyone, the statistics by allreduce
        keep = scatter_keep(k, numel, world)
        bitmap = scatter_bitmap(k, numel, world)
        sent = world * scatter_part_bytes(k / world, numel, world, bitmap)  # a part for every owner
        return (pairwise_alltoall(sent, world) + ring_allgather(scatter_part_bytes(keep, numel, world, bitmap), world)
                + ring_allreduce(4.0 * nstats, world))
    levels = math.log2(world) if world > 1 else 0.0
    if kind == GTOPK:  # up a binary tree merging k pairs per round, then the global top-k back down
        return Cost(2.0 * levels * PAIR_BYTES * k, 2.0 * levels)
    if kind == OKTOPK:  # the paper's bound on the volume; split-and-reduce rounds + recursive doubling
        return Cost(6.0 * (world - 1) / world * PAIR_BYTES * k, (world - 1) + levels)
    if kind == POWERSGD:  # P = M Q and Q = M^T P allreduced in turn
        half = ring_allreduce(4.0 * k / 2.0, world)
        return half + half
    raise ValueError(f"unknown transport {kind!r}; the modelled ones are {', '.join(MODELLED)}")
