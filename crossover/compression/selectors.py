"""Sparsifying compressors: pick which elements of (gradient + residual) to send at a given CF.

Each selector works on flat float tensors through the kernels in `kernels.py` (one fused pass for
error feedback + selection), and returns a `Selection`. Two families:

* rank-specific indices (`topk`, `dgc`, `redsync`): each rank picks its own largest elements, so the
  payload must travel by allgather (values and indices);
* shared indices (`randomk`): every rank draws the same indices from a seed, so the values can be
  summed by allreduce.

Multi-level compression (GraVAC): `subselect` compresses an existing selection further, so the
candidate CF costs only a pass over the (small) floor selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .wire import k_for

__all__ = ["SELECTORS", "Selection", "Selector", "apply_mask", "k_for", "make_selector"]


@dataclass
class Selection:
    """Chosen elements: int32 indices into the flat tensor and their values (same length)."""

    idx: torch.Tensor
    val: torch.Tensor
    sumsq_acc: float  # ||gradient + residual||^2 over the whole tensor
    sumsq_sel: float  # ||selected values||^2
    sumsq_grad: float | None = None  # ||gradient||^2 without the residual, when the selection pass read it


class _Buffers:
    """Reusable output buffers per tensor key: allocating large buffers costs more than selecting."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}

    def get(self, key: str, what: str, n: int, dtype: torch.dtype, device: torch.device, *,
            zeroed: bool = False) -> torch.Tensor:
        """`n` elements of the buffer (key, what); `zeroed`: all zero (False) when (re)allocated, for users that
        leave it so after each use."""
        buf = self._bufs.get((key, what))
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = (torch.zeros if zeroed else torch.empty)(max(n, 1), dtype=dtype, device=device)
            self._bufs[(key, what)] = buf
        return buf[:n]


class Selector:
    """Base: subclasses define `select` (first level) and may override `subselect` (further levels)."""

    name = "base"
    shared_indices = False  # True: same indices on every rank (allreduce-able payload)
    sample_fraction = 0.001  # fraction of elements sampled to estimate a threshold
    min_samples = 4096
    exact_limit = 65536  # selections up to this size are trimmed exactly
    trim_slack = 1.1  # top-k keeps at most trim_slack * k elements

    def __init__(self) -> None:
        self.buffers = _Buffers()

    def _sample(self, key: str, grad: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        n = min(grad.numel(), max(self.min_samples, int(grad.numel() * self.sample_fraction)))
        out = self.buffers.get(key, "sample", n, torch.float32, grad.device)
        kernels.sample_abs(grad, residual, n, out)
        return out

    def _threshold(self, sample: torch.Tensor, density: float) -> float | torch.Tensor:
        if sample.device.type != "cpu":  # stays on the device: no host round trip before the selection
            return kernels.threshold_tensor(sample, density)
        return kernels.threshold_for_density(sample, density)

    def _select_ge(self, key: str, grad: torch.Tensor, residual: torch.Tensor | None, thr: float | torch.Tensor,
                   cap: int) -> tuple[int, Selection]:
        """Elements with |acc| >= thr (at most cap): (how many, the selection)."""
        idx = self.buffers.get(key, "idx", cap, torch.int32, grad.device)
        val = self.buffers.get(key, "val", cap, torch.float32, grad.device)
        count, _qual, sumsq_acc, sumsq_sel, sumsq_grad = kernels.ef_select(grad, residual, thr, idx, val)
        if count == 0:  # nothing passed: send the largest element so every payload is non-empty
            src = residual if residual is not None else grad  # == acc when nothing was selected
            j = int(torch.argmax(src.abs()).item())
            idx[0], val[0] = j, src[j]
            if residual is not None:
                src[j] = 0.0
            count, sumsq_sel = 1, float(val[0].item()) ** 2
        return count, Selection(idx[:count], val[:count], sumsq_acc, sumsq_sel, sumsq_grad)

    def select(self, key: str, grad: torch.Tensor, residual: torch.Tensor | None, cf: float,
               seed: int) -> Selection:
        """First level: elements of acc = grad + residual at compression factor cf.

        With a residual, it is updated in place to acc minus what was selected.
        """
        raise NotImplementedError

    def subselect(self, sel: Selection, numel: int, cf: float, seed: int) -> torch.Tensor:
        """Boolean mask over `sel` keeping about numel/cf of its largest-magnitude elements.

        Exact (kthvalue) on small selections; above `exact_limit` a threshold from a strided sample
        of the selection, which costs one pass instead of a selection algorithm.
        """
        k = k_for(numel, cf)
        n = sel.val.numel()
        if k >= n:
            return torch.ones(n, dtype=torch.bool, device=sel.val.device)
        mag = sel.val.abs()
        if n <= self.exact_limit:
            return mag >= torch.kthvalue(mag, n - k + 1).values  # the k-th largest magnitude
        stride = max(1, n // self.min_samples)
        return mag >= self._threshold(mag[::stride].contiguous(), k / n)


class TopK(Selector):
    """Approximate top-k: a threshold from a sample, one fused selection pass; a count above
    trim_slack * k (the sample's estimate was off) is trimmed back to about k."""

    name = "topk"

    def select(self, key, grad, residual, cf, seed):
        k, count, sel = self._sampled(key, grad, residual, cf)
        if count > self.trim_slack * k:  # trim the overshoot; trimmed elements go back to the residual
            numel = grad.numel()
            keep = Selector.subselect(self, sel, numel, numel / k, seed)
            sel = apply_mask(sel, keep, residual)
        return sel

    def _sampled(self, key, grad, residual, cf):
        """(k, count, selection): the elements at or above a threshold estimated from a sample for k / numel
        (count: how many; every element, count 0, where CF sends them all)."""
        numel = grad.numel()
        k = k_for(numel, cf)
        if k >= numel:
            return k, 0, _dense_selection(grad, residual)
        thr = self._threshold(self._sample(key, grad, residual), k / numel)
        count, sel = self._select_ge(key, grad, residual, thr, min(numel, 2 * k))
        return k, count, sel


class DGC(TopK):
    """Deep Gradient Compression's sampled threshold: no trim, the count varies around k."""

    name = "dgc"

    def select(self, key, grad, residual, cf, seed):
        return self._sampled(key, grad, residual, cf)[2]


class RedSync(Selector):
    """RedSync-style trimmed threshold: thr = mean + r * (max - mean) of |acc|, r found by bisection
    on a sample so that about k elements pass; then one selection pass."""

    name = "redsync"
    iterations = 20

    def select(self, key, grad, residual, cf, seed):
        numel = grad.numel()
        k = k_for(numel, cf)
        if k >= numel:
            return _dense_selection(grad, residual)
        sample = self._sample(key, grad, residual)
        if sample.device.type != "cpu":  # one small copy instead of a device round trip per bisection step;
            sample = sample.cpu()  # the CPU arithmetic also gives the CPU path's threshold exactly
        want = max(1.0, sample.numel() * k / numel)
        mean, mx = float(sample.mean()), float(sample.max())
        lo, hi = 0.0, 1.0
        for _ in range(self.iterations):  # bisection on the ratio r; each count is on the small sample
            mid = 0.5 * (lo + hi)
            if float((sample >= mean + mid * (mx - mean)).sum()) > want:
                lo = mid
            else:
                hi = mid
        thr = mean + lo * (mx - mean)
        return self._select_ge(key, grad, residual, thr, min(numel, 2 * k))[1]


class RandomK(Selector):
    """Random-k with indices drawn from a seed every rank shares: the payload sums by allreduce."""

    name = "randomk"
    shared_indices = True

    def select(self, key, grad, residual, cf, seed):
        numel = grad.numel()
        k = k_for(numel, cf)
        if k >= numel:
            return _dense_selection(grad, residual)
        idx = self.buffers.get(key, "idx", k, torch.int32, grad.device)
        kernels.random_indices(numel, k, seed, idx)
        val = self.buffers.get(key, "val", k, torch.float32, grad.device)
        return take_at(grad, residual, idx, val)

    def subselect(self, sel, numel, cf, seed):
        """A shared random subset (same on every rank) of the shared indices."""
        k = k_for(numel, cf)
        n = sel.val.numel()
        if k >= n:
            return torch.ones(n, dtype=torch.bool, device=sel.val.device)
        pick = torch.empty(k, dtype=torch.int32, device=sel.val.device)
        kernels.random_indices(n, k, seed ^ 0x5DEECE66D, pick)
        mask = torch.zeros(n, dtype=torch.bool, device=sel.val.device)
        mask[pick.long()] = True
        return mask


def _dense_selection(grad: torch.Tensor, residual: torch.Tensor | None) -> Selection:
    """CF 1: everything is selected; the residual (if any) becomes zero."""
    if residual is not None:
        acc = grad + residual
        residual.zero_()
    else:
        acc = grad.clone()
    idx = torch.arange(grad.numel(), dtype=torch.int32, device=grad.device)
    s = kernels.sumsq(acc)
    return Selection(idx, acc, s, s)


def take_at(grad: torch.Tensor, residual: torch.Tensor | None, idx: torch.Tensor, val: torch.Tensor) -> Selection:
    """The values of grad (+ residual, accumulated into it in place) at indices every rank shares, into `val`;
    with a residual, the taken entries are cleared from it (error feedback keeps the rest)."""
    if residual is not None:
        sumsq_acc = kernels.ef_accumulate(grad, residual)
        sumsq_sel = kernels.gather_take(residual, idx, val, True)
    else:
        sumsq_acc = kernels.sumsq(grad)
        sumsq_sel = kernels.gather_take(grad, idx, val, False)
    return Selection(idx, val, sumsq_acc, sumsq_sel)


def apply_mask(sel: Selection, keep: torch.Tensor, residual: torch.Tensor | None) -> Selection:
    """Keep `keep` of a selection; the dropped elements return to the residual (where they were zero)."""
    if residual is not None and not bool(keep.all()):
        drop = ~keep
        kernels.scatter_add(residual, sel.idx[drop].contiguous(), sel.val[drop].contiguous())
    val = sel.val[keep]
    return Selection(sel.idx[keep], val, sel.sumsq_acc, kernels.sumsq(val.contiguous()), sel.sumsq_grad)


SELECTORS: dict[str, type[Selector]] = {c.name: c for c in (TopK, DGC, RedSync, RandomK)}


def make_selector(name: str) -> Selector:
    """Selector by name; ValueError listing the known names otherwise."""
    try:
        return SELECTORS[name]()
    except KeyError:
        raise ValueError(f"compressor must be one of {', '.join(sorted(SELECTORS))}; got {name!r}") from None
