"""What every rank derives alike, with no framework and no communication: the layout of the statistics that
ride in a compressed payload, the per-(step, tensor) seeds, and the levels of a b-bit quantization code.

Plain Python (no torch): the codecs (this package), the step driver (``crossover/driver/``) and the policies
(``crossover/adaptive/``) all read these definitions, so each lives once, here, at the bottom of the layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_BITS", "MIN_BITS", "QUANT_STATS_LEN", "SEED_CHECK_SPAN", "STAT_MAX", "SparseStatsLayout", "clamp_stat",
           "k_for", "levels_for_bits", "normalize_reduced", "seed_fingerprint", "seeds_disagree", "shared_seed"]

#: Statistics travel in float32 and are summed over ranks: each rank's finite values are clamped to STAT_MAX
#: (2**100) so that a sum over up to 2**27 ranks cannot overflow float32 (max ~2**128). They are computed in
#: float64 (a gradient of 1e36 per element has a finite ||g||^2 there). A reduced statistic at or above
#: STAT_MAX means some rank saturated: that step is not shown to the policy.
STAT_MAX = 2.0 ** 100
#: The statistics of a quantized payload: [1, ||x||^2].
QUANT_STATS_LEN = 2
#: Seed fingerprints f in [1, SEED_CHECK_SPAN // world] (`seed_fingerprint`): small integers, so that the reduced
#: sums of f and f^2 (at most 500^2 / world) come back from a float32 reduction (pre-scaled by 1/world, summed,
#: rescaled) within 0.1 of the exact value; `seeds_disagree` tests against 0.25, and a rank whose f differs by
#: 1 or more makes the tested quantity >= 0.5. Above 250 ranks the span is 1 and the check is off.
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


def seeds_disagree(sum_f: float, sum_f2: float, world: int) -> bool:
    """Whether the ranks' fingerprints differ, from their sums over ranks (the same verdict on every rank):
    sum(f^2) - sum(f)^2 / world is the sum of squared deviations from the mean, 0 when all are equal."""
    return sum_f2 - sum_f * sum_f / world > 0.25


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
    With ``seed_check`` (shared-index compressors: random-k), two more entries end it: the seed's
    fingerprint f and f^2 (``seed_fingerprint``), checked per tensor after the reduction (``seeds_disagree``).
    """

    nprobes: int
    seed_check: bool = False
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
        return self.HEAD + 2 * self.nprobes + (2 if self.seed_check else 0)

    @property
    def seed_fp(self) -> int:
        """Index of the seed fingerprint (f^2 follows); only with ``seed_check``."""
        return self.HEAD + 2 * self.nprobes

    def probe_sq(self, i: int) -> int:
        return self.HEAD + i

    def probe_norm(self, i: int) -> int:
        return self.HEAD + self.nprobes + i

    def local(self, *, step_time: float, grad_sq: float, acc_sq: float, probe_sq: Sequence[float],
              seed_fp: float = 1.0, momentum: float = 0.0) -> list[float]:
        """One tensor's vector on one rank, from squared norms (the norms are their square roots).

        Every value is clamped to STAT_MAX (`clamp_stat`) so that it converts to float32 and its sum
        over ranks stays finite; a non-finite input stays non-finite, so the reduced vector is
        non-finite on every rank.
        """
        if len(probe_sq) != self.nprobes:
            raise ValueError(f"expected {self.nprobes} probe norms, got {len(probe_sq)}")
        out = [1.0, step_time, grad_sq, _sqrt(grad_sq), acc_sq, _sqrt(acc_sq), momentum, *probe_sq,
               *(_sqrt(v) for v in probe_sq)]
        if self.seed_check:
            out += [seed_fp, seed_fp * seed_fp]
        return [clamp_stat(v) for v in out]


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
