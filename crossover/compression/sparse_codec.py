"""Sparsification with error feedback, multi-level probes and a transport per tensor: one codec for
every host (horovod.torch's compression objects, the PyTorch DDP hook), and its wire formats.

`SparseCodec.encode(key, tensor, rec, step_time, comm, kind)` compresses one gradient for the step
described by `rec` (a `StepPlan`, such as the step driver's record: the CF to send and the CFs to probe)
and returns the payload the host reduces; `decode` turns the reduced payload back into the averaged
gradient and the reduced statistics vector, which the host hands to the step driver.

Parts (GRACE's split): a selector (`selectors.py`, rank-specific top-k class or shared-index
random-k), an error-feedback memory (`memory.py`), and the wire formats at the end of this module behind the
`Collectives` interface: dense, values at shared or agreed indices by allreduce, pairs or a bitmap by allgather,
the sparse reduce-scatter. The step session decides `kind` per tensor (crossover/driver/transport.py). A plan
whose ``transport`` is ``cost_model.AGREED`` sends a rank-specific selector's tensors at the index set agreed the
step before (`agreed.py`): one allreduce of k values instead of an allgather of every rank's k pairs; one whose
``transport`` is ``cost_model.SCATTER`` sends them by the sparse reduce-scatter (`scatter.py`): an alltoall to
the indices' owners in `encode`, the owners' largest sums by allgather in `decode` (hosts with `alltoall_async`).

The statistics vector rides along: appended to summable payloads, or alone as the host's allreduce when the
values travel by allgather. The host's reduction may average or sum, with pre/postscale factors: `receive` is
told `weight = reduced_one / world`, the factor the host applied to a sum (1/world for Average, 1 for Sum), and
applies it to allgathered values, which the host never scaled.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from . import agreed, cost_model, kernels, scatter
from .checks import check_seed
from .collectives import AlltoallCollectives, Collectives
from .memory import ErrorFeedback
from .selectors import Selection, Selector, apply_mask, k_for, make_selector, take_at
from .wire import CHECK_LEN, Agreement, SparseStatsLayout, gather_bitmap, gather_bitmap_bytes, shared_seed

__all__ = ["SparseCodec", "SparseCtx", "StepPlan", "gather_rows", "receive", "send_allgather", "split_stats"]

DENSE, ALLREDUCE, ALLGATHER, AGREED, SCATTER = (cost_model.DENSE, cost_model.ALLREDUCE, cost_model.ALLGATHER,
                                                 cost_model.AGREED, cost_model.SCATTER)  # what ctx.kind says


class StepPlan(Protocol):
    """What the codec reads of the step in flight (the step driver's ``StepRecord`` is one)."""

    step: int  # steps begun, identical on every rank: seeds the shared random choices
    sent_cf: float  # the CF to send (1 = dense)
    probes: tuple[float, ...]  # the CFs whose norms to measure


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


class SparseCodec:
    """Selector + error-feedback memory + transports for float32 gradients."""

    def __init__(self, compressor: str, *, error_feedback: bool = True, seed: int = 0,
                 grad_norms: bool = False, fixed_gather: bool = False, dense_stats_apart: bool = False) -> None:
        self.selector: Selector = make_selector(compressor)
        # the statistics end with the agreement checks (wire.SparseStatsLayout, wire.Agreement): what every rank must
        # do alike with each tensor, judged in decode before any collective of the codec's own is waited on
        self.checks = True
        # Every rank's allgather carries exactly k pairs (hosts whose allgather needs equal sizes, e.g.
        # torch.distributed on Gloo): an overshoot of the selector returns to the residual, a shortfall
        # is padded with pairs that add nothing.
        self.fixed_gather = bool(fixed_gather)
        # With exactly k values per rank, a selection dense enough (wire.gather_bitmap: about CF < 32) goes as
        # a bitmap of the tensor and its values (a third fewer bytes at CF 10). False: always pairs (an A/B switch,
        # like the Horovod objects' `grouped`; set it alike on every rank).
        self.gather_bitmap = self.fixed_gather
        # A dense payload is the gradient itself, and its statistics go in `ctx.stats_apart` for the host to
        # reduce (hosts whose reduction of a small vector costs less than copying the gradient to append it).
        self.dense_stats_apart = bool(dense_stats_apart)
        self.compressor = compressor
        self.memory = ErrorFeedback(error_feedback)
        self.seed = check_seed(seed)
        self.grad_norms = grad_norms  # also measure ||g|| of the raw gradient (one more read pass)
        self._outputs: dict[str, torch.Tensor] = {}
        self._packed: dict[str, torch.Tensor] = {}
        self._zeroed: dict[str, torch.Tensor] = {}  # key -> its residual, known all-zero since a dense send
        self._agreed: dict[str, agreed.AgreedSet] = {}  # key -> the index set agreed for its next step
        self._scores: dict[str, torch.Tensor] = {}
        self._scatters: list[SparseCtx] = []  # SCATTER tensors of the step whose allgather has not begun

    def forget_agreed(self) -> None:
        """Drop every agreed index set (elastic reset): the next step of each tensor draws its set from the
        shared seed. Call it on every rank alike. Reduce-scattered tensors of an abandoned step are forgotten too."""
        self._agreed.clear()
        self._scatters = []

    def agreed_state(self) -> dict[str, list]:
        """The agreed index sets (the same on every rank), as plain values for a checkpoint."""
        return agreed.sets_to_state(self._agreed)

    def load_agreed(self, state: object) -> None:
        """Replace the agreed sets by `agreed_state()` output (checked first: ValueError, nothing changed)."""
        self._agreed = agreed.sets_from_state(state)

    def encode(self, key: str, tensor: torch.Tensor, rec: StepPlan, step_time: float, comm: Collectives,
               kind: str, momentum: float = 0.0) -> tuple[torch.Tensor, SparseCtx, int]:
        """(payload for the host's reduction, context for `decode`, bytes this rank sends). `kind`: the tensor's
        transport, decided by the caller (crossover/driver/transport.py: DENSE for a step that sends dense);
        `momentum`: the optimizer's, reported to the policy in the statistics (wire.SparseStatsLayout)."""
        numel = tensor.numel()
        grad = tensor.detach().reshape(-1)
        if not grad.is_contiguous():
            grad = grad.contiguous()
        residual = self.memory.residual(key, grad)
        levels = sorted({cf for cf in (*rec.probes, rec.sent_cf) if cf > 1})
        acc = grad  # what this rank sends in a dense step: the gradient, plus a residual still held
        if levels:
            self._zeroed.pop(key, None)
        elif residual is not None and self._zeroed.get(key) is not residual:
            # The first dense step after compressed ones: what error feedback still holds goes out with it
            # (as the TensorFlow glue sends acc = g + e), once; the residual then stays zero until a
            # compressed step, and later dense steps skip this pass.
            acc = residual.add_(grad)
        seed = shared_seed(self.seed, rec.step, key)
        send_cf = rec.sent_cf
        k = k_for(numel, send_cf) if send_cf > 1 else numel
        if kind == cost_model.AGREED:
            return self._encode_agreed(key, tensor, grad, residual, rec, step_time, comm, levels, k, seed,
                                       momentum)
        sel = self.selector.select(key, grad, residual, levels[0], seed) if levels else None
        grad_sq = None  # ||g|| apart from the residual: read by the selection pass when it can
        if self.grad_norms and residual is not None:
            grad_sq = sel.sumsq_grad if sel is not None and sel.sumsq_grad is not None else kernels.sumsq(grad)
        sq: dict[float, float] = {}  # cf -> ||C_cf(acc)||^2; higher CFs compress the first-level selection
        masks: dict[float, torch.Tensor] = {}
        for cf in levels:
            if cf == levels[0]:
                sq[cf] = sel.sumsq_sel
            else:
                masks[cf] = self.selector.subselect(sel, numel, cf, seed ^ int(cf))
                sq[cf] = kernels.sumsq(sel.val[masks[cf]].contiguous())
        acc_sq = sel.sumsq_acc if sel is not None else kernels.sumsq(acc)
        layout = SparseStatsLayout(len(rec.probes))
        bitmap = bool(kind == cost_model.ALLGATHER and self.fixed_gather and self.gather_bitmap
                      and gather_bitmap(k, numel))
        agree = self._agreement(tensor, rec, kind, comm, bitmap)
        stats = torch.tensor(layout.local(step_time=step_time, grad_sq=acc_sq if grad_sq is None else grad_sq,
                                          acc_sq=acc_sq, probe_sq=[sq.get(cf, acc_sq) for cf in rec.probes],
                                          checks=agree.values(comm.size()), momentum=momentum),
                             dtype=torch.float32, device=grad.device)
        ctx = SparseCtx(kind=DENSE, key=key, shape=tensor.shape, numel=numel,
                        nstats=layout.length, grad=grad, residual=residual, agreement=agree,
                        local_finite=math.isfinite(acc_sq) and (grad_sq is None or math.isfinite(grad_sq)))
        if send_cf > 1 and send_cf != levels[0]:  # send a higher level: the rest returns to the residual
            sel = apply_mask(sel, masks[send_cf], residual)
        if sel is not None:
            ctx.idx, ctx.val = sel.idx, sel.val  # what this rank sent (to undo a non-finite step)
        if kind == cost_model.DENSE:
            if sel is not None and residual is not None:  # undo the selection: send acc whole
                kernels.scatter_add(residual, sel.idx, sel.val)
                acc = residual
            if self.dense_stats_apart:  # no copy: the gradient's own storage (the residual buffer stays ours)
                payload = grad.copy_(acc) if acc is residual else acc
                ctx.stats_apart = stats
            else:
                payload = send_dense(acc, stats)
            if acc is residual:  # the residual went out whole: zero until a compressed step
                residual.zero_()
                self._zeroed[key] = residual
            return payload, ctx, (numel + stats.numel()) * 4
        if kind == cost_model.ALLREDUCE:
            ctx.kind, ctx.k = ALLREDUCE, sel.idx.numel()
            payload = send_shared(sel, stats)
            return payload, ctx, payload.numel() * 4
        if kind == cost_model.SCATTER:
            payload, ctx.handle, nbytes = send_scatter(sel, stats, comm, f"crossover.scatter.a2a.{key}",
                                                       numel, cost_model.scatter_bitmap(k, numel, comm.size()))
            ctx.kind, ctx.k, ctx.step = SCATTER, k, rec.step
            self._scatters = [c for c in self._scatters if c.step == rec.step] + [ctx]  # drop an abandoned step's
            return payload, ctx, nbytes + stats.numel() * 4
        rows = sel.idx.numel()
        if self.fixed_gather:
            if rows > k:  # keep the k largest; the rest returns to the residual
                sel = apply_mask(sel, _largest(sel.val, k), residual)
            ctx.bitmap = bitmap
            rows = gather_rows(k, numel, ctx.bitmap)
        packed = self._packed_buf(key, rows + HEADER_ROWS, grad.device)
        scratch = self.selector.buffers.get(key, "gather.bitmap", numel, torch.float32, grad.device) \
            if ctx.bitmap else None
        payload, ctx.handle = send_allgather(sel, stats, comm, f"crossover.allgather.{key}", packed,
                                             tensor.shape, ctx.bitmap, scratch)
        ctx.kind, ctx.k = ALLGATHER, k
        return payload, ctx, packed.numel() * 4 + stats.numel() * 4

    def decode(self, reduced: torch.Tensor, ctx: SparseCtx, comm: Collectives,
               stats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the averaged gradient in the tensor's shape, the reduced statistics vector).

        `stats`: the reduction of `ctx.stats_apart`, when encode put the statistics there.

        Non-finite reduced statistics (some rank's gradient had inf/NaN; identical on every rank) undo
        this step for the tensor: its residual goes back to what it was before `encode` (or to zeros on
        a rank whose own gradient was non-finite, or whose payload was dense and took the residual),
        and it decodes to NaN on every rank, so that a GradScaler-style check skips the step
        everywhere, as it would with stock Horovod.
        """
        if stats is None:
            stats = split_stats(reduced, ctx.nstats)
        host = stats.tolist()  # the one read of the reduced statistics (a device sync on a GPU)
        world = comm.size()
        if ctx.agreement is not None:  # before any wait: a disagreement raises on every rank instead of hanging
            ctx.agreement.check(host[len(host) - CHECK_LEN:], host[0], world, ctx.key, comm.rank())
        finite = all(math.isfinite(v) for v in host)
        if ctx.kind == AGREED:
            self._receive_agreed(reduced, ctx, comm, host[0], finite)
        out = None
        if ctx.kind != DENSE:
            out = self._outputs.get(ctx.key)
            if out is None or out.numel() != ctx.numel or out.device != reduced.device:
                out = torch.empty(ctx.numel, dtype=torch.float32, device=reduced.device)
                self._outputs[ctx.key] = out
        if ctx.kind == SCATTER:
            flat = self._receive_scatter(ctx, comm, finite, host[0] / world, out)
        else:
            flat = receive(reduced, ctx, comm, out, host[0] / world)
        if not finite:
            self._undo(ctx)
            flat.fill_(float("nan"))
        ctx.grad = ctx.residual = ctx.val = ctx.stats_apart = ctx.stats_handle = None  # drop the step's tensors
        return flat.view(ctx.shape), stats

    def _encode_agreed(self, key: str, tensor: torch.Tensor, grad: torch.Tensor, residual: torch.Tensor | None,
                       rec: StepPlan, step_time: float, comm: Collectives, levels: list[float], k: int,
                       seed: int, momentum: float) -> tuple[torch.Tensor, SparseCtx, int]:
        """Values of grad + residual at the set agreed for this step (else drawn from the seed), summed by
        the host; this rank's proposals for the next step's set by allgather; the rest stays in the residual."""
        numel, world = grad.numel(), comm.size()
        have = self._agreed.pop(key, None)
        if have is not None and (have.step, have.k, have.numel) == (rec.step, k, numel):
            idx, hashes = have.idx.to(grad.device), have.hashes  # a loaded set comes on the CPU
        else:
            idx = agreed.bootstrap(numel, k, seed, grad.device)
            hashes = agreed.fingerprint(key, rec.step, "seed", idx)
        val = self.selector.buffers.get(key, "agreed", k, torch.float32, grad.device)
        grad_sq = kernels.sumsq(grad) if self.grad_norms and residual is not None else None
        sel = take_at(grad, residual, idx, val)
        acc_sq, sel_sq = sel.sumsq_acc, sel.sumsq_sel
        sq = {levels[0]: sel_sq}
        for cf in levels[1:]:  # higher probed CFs: the largest of the agreed values (norms only, never sent)
            sq[cf] = kernels.sumsq(val[self.selector.subselect(sel, numel, cf, seed ^ int(cf))].contiguous())
        layout = SparseStatsLayout(len(rec.probes))
        agree = self._agreement(tensor, rec, cost_model.AGREED, comm, False)
        stats = torch.tensor(layout.local(step_time=step_time, grad_sq=acc_sq if grad_sq is None else grad_sq,
                                          acc_sq=acc_sq, probe_sq=[sq.get(cf, acc_sq) for cf in rec.probes],
                                          checks=agree.values(world), momentum=momentum),
                             dtype=torch.float32, device=grad.device)
        check = torch.tensor(agreed.check_values(hashes), dtype=torch.float32, device=grad.device)
        proposals = self._propose(key, grad, residual, sel, world)
        payload, handle = send_agreed(val, check, stats, comm, f"crossover.agreed.{key}", proposals)
        ctx = SparseCtx(kind=AGREED, key=key, shape=tensor.shape, numel=numel,
                                  nstats=layout.length, handle=handle, idx=idx, k=k, val=val, grad=grad,
                                  residual=residual, step=rec.step, hashes=hashes, agreement=agree,
                                  local_finite=math.isfinite(acc_sq) and (grad_sq is None or math.isfinite(grad_sq)))
        return payload, ctx, payload.numel() * 4 + proposals.numel() * 4

    def _receive_agreed(self, reduced: torch.Tensor, ctx: SparseCtx, comm: Collectives, one: float,
                        finite: bool) -> None:
        """Check that every rank sent values at the same set, and agree on the next step's set (`one`: the reduced
        statistics' first entry, the factor the host applied to sums times world; `finite`: all of them are)."""
        gathered = comm.wait(ctx.handle) if ctx.handle is not None else None  # always: it completes everywhere
        world = comm.size()
        if not (math.isfinite(one) and one > 0 and finite):
            return  # a non-finite step (decoded to NaN, undone): no set agreed; the next draws from the seed
        check = reduced[ctx.k:ctx.k + cost_model.AGREED_CHECK].tolist()
        summed = [v * world / one for v in check]
        if not agreed.checks_agree(summed, world, ctx.hashes):
            raise RuntimeError(f"crossover compression: the ranks sent the values of {ctx.key!r} at different "
                               "agreed index sets (their compression state differs: call reset() or "
                               "load_state_dict() on every rank alike)")
        if gathered is None:  # no proposals (a dense set): the next step draws its set from the seed
            return
        nxt = ctx.step + 1
        idx = self._next_set(gathered.reshape(-1), world, ctx, shared_seed(self.seed, nxt, ctx.key) ^ _FILL_SEED)
        self._agreed[ctx.key] = agreed.AgreedSet(nxt, ctx.k, ctx.numel, idx,
                                                 agreed.fingerprint(ctx.key, nxt, "agreed", idx))

    def _receive_scatter(self, ctx: SparseCtx, comm: Collectives, finite: bool, weight: float,
                         out: torch.Tensor) -> torch.Tensor:
        """Scatter every owner's kept sums into `out` and return to the residual what this rank sent that no owner
        kept. The first decode of a step starts the allgathers of every reduce-scattered tensor of the step
        (`_start_gathers`): they travel together instead of one round trip after another. A non-finite step
        (`finite`: the reduced statistics, the same on every rank) decodes nothing: `decode` fills NaN. `weight`:
        the factor the host applied to sums."""
        if ctx.error is not None:  # met while an earlier decode started this tensor's allgather
            error, ctx.error = ctx.error, None
            raise error
        if ctx.gather is None:
            self._start_gathers(comm, ctx)
        gathered = comm.wait(ctx.gather)  # always: every rank started it
        if not finite:
            return out
        world, numel = comm.size(), ctx.numel
        keep = cost_model.scatter_keep(ctx.k, numel, world)
        idx, val = scatter.unpack_kept(gathered, world, numel, keep, cost_model.scatter_bitmap(ctx.k, numel, world))
        kernels.zero_scatter(out, idx, val.contiguous(), weight)
        if ctx.residual is not None and ctx.idx is not None and ctx.idx.numel():
            marks = self.selector.buffers.get(ctx.key, "scatter-marks", numel, torch.bool, out.device, zeroed=True)
            gone = scatter.lost(ctx.idx, idx, marks)
            kernels.scatter_add(ctx.residual, ctx.idx[gone].contiguous(), ctx.val[gone].contiguous())
        return out

    def _start_gathers(self, comm: Collectives, ctx: SparseCtx) -> None:
        """For `ctx` and every other reduce-scattered tensor of its step not begun yet, in encode order: wait for
        the alltoall, sum what this rank owns, keep the largest, start the allgather of the kept sums. Every
        rank starts every one of them, whatever its statistics say (a non-finite sum is gathered, then dropped)."""
        todo = [c for c in self._scatters if c.step == ctx.step and c.gather is None]
        if not any(c is ctx for c in todo):  # identity: a context holds tensors
            todo.append(ctx)
        self._scatters = []
        world, rank = comm.size(), comm.rank()
        for c in todo:
            numel = c.numel
            bitmap = cost_model.scatter_bitmap(c.k, numel, world)
            keep = cost_model.scatter_keep(c.k, numel, world)
            region = self.selector.buffers.get(c.key, "scatter-sums", scatter.stretch(numel, world), torch.float32,
                                               c.grad.device, zeroed=True)
            try:
                pos, val = scatter.unpack_received(comm.wait(c.handle), rank, world, numel, bitmap, c.key)
            except Exception as exc:  # another tensor's: raised at its own decode, after its agreement check
                if c is ctx:
                    raise
                c.error = exc
                continue
            pos, sums = scatter.reduce_owned(pos, val, keep, region)
            c.gather = comm.allgather_async(scatter.pack_kept(pos, sums, rank, world, numel, keep, bitmap),
                                            f"crossover.scatter.{c.key}")

    def _agreement(self, tensor: torch.Tensor, rec: StepPlan, kind: str, comm: Collectives,
                   bitmap: bool) -> Agreement:
        """What the other ranks must do alike with this tensor in this step (wire.Agreement). The seed counts where
        every rank draws from it what they must share: shared indices, and the agreed set's first draw."""
        shared_seed_needed = self.selector.shared_indices or kind == cost_model.AGREED
        return Agreement.of(tensor, compressor=self.compressor, sent_cf=rec.sent_cf, probes=rec.probes, transport=kind,
                            seed=self.seed if shared_seed_needed else None,
                            grouped=bool(getattr(comm, "grouped", False)), bitmap=bool(bitmap))

    def _propose(self, key: str, grad: torch.Tensor, residual: torch.Tensor | None, sel: Selection,
                 world: int) -> torch.Tensor:
        """This rank's proposals for the next step's set: the largest entries of the next accumulator as
        predicted now, the residual after this send plus this step's gradient (without error feedback: the
        gradient), ``ceil(k / W)`` of them, largest first."""
        score = grad
        if residual is not None:
            score = self._scores.get(key)
            if score is None or score.numel() != grad.numel() or score.device != grad.device:
                score = self._scores[key] = torch.empty_like(grad)
            torch.add(residual, grad, out=score)
        return agreed.propose(score, sel.idx.numel(), world)

    def _next_set(self, gathered: torch.Tensor, world: int, ctx: SparseCtx, seed: int) -> torch.Tensor:
        """The set for the step after ``ctx.step`` from every rank's gathered proposals (same on every rank)."""
        return agreed.merge_proposals(gathered, world, ctx.step, ctx.k, ctx.numel, seed)

    @staticmethod
    def _undo(ctx: SparseCtx) -> None:
        """Put the tensor's residual back as it was before this step's `encode`, without a copy.

        After encode the residual is `acc - sent` with `acc = grad + e_old`, so `e_old = residual +
        sent - grad` (up to float rounding). That needs this rank's gradient to be finite, and a sparse
        send (a dense send emptied the residual into the payload, which the reduction overwrote): in the
        other cases the residual is reset to zeros.
        """
        res = ctx.residual
        if res is None:
            return
        if not ctx.local_finite or ctx.kind == DENSE or ctx.idx is None:
            res.zero_()
            return
        kernels.scatter_add(res, ctx.idx, ctx.val.contiguous())
        res.sub_(ctx.grad)

    def _packed_buf(self, key: str, count: int, device: torch.device) -> torch.Tensor:
        buf = self._packed.get(key)
        if buf is None or buf.shape[0] < count or buf.device != device:
            buf = torch.empty((max(count, 1), 2), dtype=torch.int32, device=device)
            self._packed[key] = buf
        return buf[:count]


_FILL_SEED = 0x5851F42D4C957F2D  # decorrelates the fill of an agreed set from the step's own random draws


def _largest(val: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the k largest-magnitude entries of `val` (exactly k)."""
    keep = torch.zeros(val.numel(), dtype=torch.bool, device=val.device)
    keep[torch.topk(val.abs(), k, sorted=False).indices] = True
    return keep


# ---------------------------------------------------------------------------------------------
# Wire formats: `send_*` builds what the host reduces (and starts the codec's own collective); `receive` turns the
# reduced payload, and what was gathered, into the averaged gradient
# ---------------------------------------------------------------------------------------------
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
    return gather_bitmap_bytes(numel) // 8


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
    * `bitmap`: a bit per element of the tensor (`wire.gather_bitmap_bytes`), then the values of the set
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
