"""The agreed index set: top-k indices that every rank shares without a collective of their own.

Rank-specific top-k selections differ per rank, so they travel by allgather and every worker receives
about W k pairs. Values at indices every rank shares sum, so they travel by one allreduce of k values,
whose bytes per worker do not grow with W. The agreed set makes top-k indices shared, one step late:

* at step t each rank sends the values of its accumulator (gradient + residual) at the set agreed for t,
  summed by the host's allreduce; everything else stays in its residual (error feedback);
* in the same step each rank proposes ``m = ceil(s k / W)`` indices for step t+1, ``s = min(1/2, 1/W)``
  (`cost_model.agreed_share`): the largest entries of its prediction of the next accumulator (its residual after
  this send + this step's gradient), in descending order; the proposals travel by one allgather of m int32 per
  rank (at most 2 k bytes per worker, 4 k / W beyond 2 ranks). While W k exceeds half the tensor (CF < 2 W)
  the set takes no proposals (s = 0): it is drawn from the shared seed, random-k's indices, and nothing is
  gathered;
* every rank merges the same gathered proposals the same way (`merge_proposals`): the union, ranked by
  position in the proposing rank's list (ties between ranks broken by a rotation that changes every step),
  cut to k, and filled up to k with indices drawn from the shared seed. So every rank holds the same set for
  step t+1 with no further communication. The drawn part matters: a set of proposals only sends, step after
  step, what single ranks' noisy accumulators rank highest, and leaves the rest of the residual to grow stale
  (on the digits MLP at 8 ranks it lost even to random-k; reports/transport-study.md).

The first step of a tensor, a step after a dense or skipped one, or after a change of k uses k indices
drawn from the shared seed (random-k) instead. A fingerprint of the set rides in the payload
(`fingerprint`: four 5-bit hashes of a digest of the set, and their squares): their sums over ranks tell every
rank whether all ranks used the same set (Cauchy-Schwarz: sum h^2 = W mean(h)^2 only when every h is equal).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from . import kernels
from .cost_model import AGREED_CHECK, agreed_proposals

__all__ = ["AgreedSet", "check_values", "checks_agree", "fingerprint", "merge_proposals", "propose",
           "sets_from_state", "sets_to_state"]

PROPOSAL_SLACK = 2  # a sampled threshold keeps about twice the proposals: the exact top m is among them
SAMPLE_MIN = 4096  # elements sampled at least to set that threshold (as the top-k selector samples)
SAMPLE_HITS = 16  # ... and the threshold keeps at least this many of them: a rank statistic of fewer is noise
CHECK_LEVELS = 32  # each fingerprint hash is in [0, 32): its square summed over 1 024 ranks stays within fp32's
# rounding tolerance after an average (about 1e6 x 2^-24); four of them: a mismatch slips through once in 2^20


@dataclass
class AgreedSet:
    """The index set agreed for one tensor and step."""

    step: int  # the step it is for
    k: int
    numel: int
    idx: torch.Tensor  # sorted int32, k distinct indices < numel
    hashes: tuple[int, ...]


def fingerprint(key: str, step: int, origin: str, idx: torch.Tensor) -> tuple[int, ...]:
    """Four hashes in [0, CHECK_LEVELS) of a set: a digest of its tensor key, step, origin and every index (two
    indices moved by one change it, as the indices' sum would not)."""
    h = hashlib.blake2b(f"{key}:{step}:{origin}:{idx.numel()}".encode(), digest_size=8)
    if idx.numel():
        h.update(idx.to(torch.int32).cpu().numpy().tobytes())
    d = h.digest()
    return tuple(b % CHECK_LEVELS for b in d[:AGREED_CHECK // 2])


def check_values(hashes: tuple[int, ...]) -> list[float]:
    """The AGREED_CHECK floats a rank appends to its agreed values: each hash and its square."""
    out = [float(v) for h in hashes for v in (h, h * h)]
    assert len(out) == AGREED_CHECK
    return out


def checks_agree(summed: list[float], world: int, hashes: tuple[int, ...]) -> bool:
    """Whether the check floats summed over ``world`` ranks say every rank sent ``hashes``.

    Sum h = W h_own and sum h^2 = W h_own^2 hold together only when every rank's h equals h_own; the sums
    are of integers below 2^24, exact in fp32; the tolerance covers an averaging op's rounding.
    """
    tol = 0.25
    for i, h in enumerate(hashes):
        if abs(summed[2 * i] - world * h) > tol or abs(summed[2 * i + 1] - world * h * h) > tol:
            return False
    return True


def bootstrap(numel: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """k sorted distinct indices drawn from the shared seed (random-k): the set when none was agreed."""
    idx = torch.empty(k, dtype=torch.int32, device=device)
    kernels.random_indices(numel, k, seed, idx)
    return idx


def propose(score: torch.Tensor, k: int, world: int, share: float | None = None) -> torch.Tensor:
    """This rank's ``ceil(share k / W)`` proposals (``share``: ``cost_model.agreed_share`` unless given): indices
    of the largest |score|, largest first (int32; empty when the share is 0).

    A threshold from a strided sample keeps about ``PROPOSAL_SLACK`` times too many in one pass (the C
    kernel), then an exact top among those few; a sample that set the threshold too high falls back to
    an exact top-k over the whole tensor (slower, same result).
    """
    n = score.numel()
    m = min(n, agreed_proposals(k, n, world, share))
    if m == 0:
        return torch.empty(0, dtype=torch.int32, device=score.device)
    ns = min(n, max(SAMPLE_MIN, n // 1000))
    keep = max(PROPOSAL_SLACK * m, SAMPLE_HITS * n // ns)  # elements the threshold should keep
    if 4 * keep < n:
        sample = torch.empty(ns, dtype=torch.float32, device=score.device)
        kernels.sample_abs(score, None, ns, sample)
        thr = kernels.threshold_for_density(sample, keep / n)
        idx = torch.empty(2 * keep, dtype=torch.int32, device=score.device)
        val = torch.empty(2 * keep, dtype=torch.float32, device=score.device)
        got = kernels.ef_select(score, None, thr, idx, val)
        if got.count >= m and got.qualifying <= idx.numel():  # every element above the threshold is here
            top = torch.topk(val[:got.count].abs(), m, sorted=True).indices
            return idx[top]
    return torch.topk(score.abs(), m, sorted=True).indices.to(torch.int32)


def merge_proposals(gathered: torch.Tensor, world: int, step: int, k: int, numel: int, seed: int) -> torch.Tensor:
    """The set every rank derives from the gathered proposals (``world`` rows of m, rank order): sorted int32.

    Union ranked by (position in its rank's list, (rank - step) mod W), first occurrence kept, cut to k;
    fewer than k distinct indices are filled up with indices drawn from ``seed`` that are not in the union.
    Deterministic in its arguments: identical on every rank.
    """
    if gathered.numel() % world:
        raise RuntimeError(f"agreed index proposals: {gathered.numel()} indices do not split into {world} ranks "
                           "(ranks disagree on the transport or on k)")
    m = gathered.numel() // world
    props = gathered.reshape(world, m).to(torch.int64)
    if props.numel() and (int(props.min()) < 0 or int(props.max()) >= numel):
        raise RuntimeError(f"agreed index proposals out of range [0, {numel}) (ranks disagree on the tensor)")
    shift = step % world
    order = torch.roll(props, -shift, dims=0).t().reshape(-1)  # position-major, rotated rank-minor
    pos = torch.arange(order.numel(), dtype=torch.int32, device=order.device)
    first = torch.full((numel,), order.numel(), dtype=torch.int32, device=order.device)
    first.scatter_reduce_(0, order, pos, reduce="amin")  # each proposed index's first position
    union = order[first[order] == pos][:k]
    need = k - union.numel()
    if need > 0:  # every distinct proposal is in: an index was proposed iff its first position is set
        pool = bootstrap(numel, min(numel, k + union.numel()), seed, union.device).to(torch.int64)
        pool = pool[first[pool] == order.numel()]
        pick = torch.empty(min(need, pool.numel()), dtype=torch.int32, device=union.device)
        kernels.random_indices(pool.numel(), pick.numel(), seed ^ 0x2545F4914F6CDD1D, pick)
        union = torch.cat([union, pool[pick.long()]])
    return torch.sort(union).values.to(torch.int32)


def sets_to_state(sets: dict[str, AgreedSet]) -> dict[str, list]:
    """Agreed sets as plain values: key -> [step, k, numel, indices]."""
    return {key: [a.step, a.k, a.numel, a.idx.tolist()] for key, a in sets.items()}


def sets_from_state(state: object) -> dict[str, AgreedSet]:
    """`sets_to_state` output back as agreed sets (on the CPU), checked: ValueError naming what is wrong."""
    if not isinstance(state, dict):
        raise ValueError(f"agreed index sets must be a mapping of key -> [step, k, numel, indices], got {state!r:.80}")
    out = {}
    for key, entry in state.items():
        idx = _check_entry(key, entry)
        step, k, numel, _ = entry
        out[key] = AgreedSet(step, k, numel, idx, fingerprint(key, step, "agreed", idx))
    return out


def _check_entry(key: object, entry: object) -> torch.Tensor:
    bad = ValueError(f"agreed index set {key!r}: expected [step, k, numel, k sorted distinct indices < numel], "
                     f"got {entry!r:.80}")
    if not isinstance(key, str) or not isinstance(entry, (list, tuple)) or len(entry) != 4:
        raise bad
    step, k, numel, idx = entry
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (step, k, numel)) or step < 0 \
            or not 1 <= k <= numel < 2 ** 31 or not isinstance(idx, list) or len(idx) != k \
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in idx):
        raise bad
    t = torch.tensor(idx, dtype=torch.int64)
    if not bool((t[1:] > t[:-1]).all()) or int(t[0]) < 0 or int(t[-1]) >= numel:
        raise bad
    return t.to(torch.int32)
