"""What every horovod.torch compression object of crossover shares: Horovod's side of the hook.

Horovod calls `compress(tensor)` once per gradient in the backward hook (no name, no step) and
`decompress(tensor, ctx)` in `synchronize()`. This base turns that into steps and keys:
* the parameter name and the calling optimizer come from horovod_ext/_internals.py (frames);
* a step begins at the first `compress` after a `decompress` (or when a name repeats);
* tensors that are not float32, or sparse, pass through untouched, and float32 ones under `min_compress_numel`
  (biases, BatchNorm) dense on their own; the larger float32 gradients travel in DDP's buckets (issue 43: one by
  one they cost the Horovod path more encodes, collectives and bytes than the DDP hook): those parameters in reverse
  registration order, cut at DDP's caps (crossover/compression/
  grouped.py `cut_buckets`, with the allgather groups' caps: 1 MiB, then 25 MiB), the same on every rank (checked
  at the first step: a bucket's shape would not tell). Horovod gets an empty tensor for each member; a bucket is
  encoded as one flat tensor the moment its last member arrives (in backward, as DDP's) or when `synchronize()`
  begins (members that never came), its payload and statistics by the glue's own allreduces (`BUCKET_KEY`:
  its residual, its agreement checks), decoded once and cut back into each member; a gradient alone in its
  bucket goes on its own. That
  holds for the CF policies' sparsifying codecs (GraVAC, static top-k), with the optimizer's default
  `op=hvd.Average`, on a model with at least one float32 parameter of `min_compress_numel` elements (else every
  gradient goes on its own: compressed at that size, through untouched below it);
* collectives a codec issues itself (allgather; alltoall for the sparse reduce-scatter) go through
  `HorovodCollectives`, bound to the
  calling optimizer's process set, and travel in groups (crossover/compression/grouped.py): one allgather
  per group of tensors, planned from the last step's tensors in reverse registration order (as DDP's
  buckets), sent once the group is complete and at the latest when synchronize() begins;
* the optimizer's `synchronize()` (in `step()`) first waits on its handles by polling with short sleeps:
  Horovod's own wait spins a core, which a machine with a core per rank takes from the background
  thread and the network.
Everything else is the step session (crossover/driver/session.py): a step driver and a codec.
"""

from __future__ import annotations

import json
import logging
import math
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch

from crossover.compression.grouped import GroupedCollectives, cut_buckets
from crossover.compression.wire import check_same_parameters
from crossover.driver import check_min_numel
from crossover.driver.flat import user_stats
from crossover.driver.session import LowRankSession, SparseSession, StepSession, finite_probe
from horovod_ext._class_guard import CompressionType, guard_constructors
from horovod_ext._internals import (
    torch_hook_caller,
    torch_named_parameters,
    torch_parameter_order,
    torch_process_set,
    torch_quiet_synchronize,
    torch_wait_quietly,
    version_supported,
)

__all__ = ["HorovodCollectives", "BUCKET_KEY", "OUTSIDE", "TorchHookBase", "SHARED_ERROR"]

#: The context of a tensor handed to compress outside an optimizer's step (sent and returned untouched).
OUTSIDE = "outside-an-optimizer-step"
#: The codec's key of bucket i (its residual, its collectives, its agreement checks): BUCKET_KEY + "000[first..last]"
#: (i zero-padded; its first and last parameters' names in registration order).
BUCKET_KEY = "crossover.bucket"

log = logging.getLogger(__name__)
_threads_said = False  # the oversubscription warning, once per process


def _say_oversubscribed() -> None:
    """Warn once when this host's ranks x torch's threads exceed its cores: torchrun sets OMP_NUM_THREADS=1 for
    that, horovodrun does not (measured: a CNN's step at CF 10 on 2 cores, 89 ms with 2 threads a rank, 26 with 1)."""
    global _threads_said
    if _threads_said:
        return
    local, threads = hvd.local_size(), torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local > 1 and local * threads > cores:
        _threads_said = True
        fit = max(1, cores // local)
        log.warning("crossover: %d ranks on this host x %d torch threads each oversubscribe its %d cores (steps run "
                    "several times slower on CPU tensors): set OMP_NUM_THREADS=%d for horovodrun, or call "
                    "torch.set_num_threads(%d) in each rank, as torchrun does", local, threads, cores, fit, fit)

guard_constructors(hvd, ("DistributedOptimizer",))  # compression=AdaptiveCompression (the class) fails there

SHARED_ERROR = ("crossover: this compression object is already used by another DistributedOptimizer. Its state "
                "(error-feedback residuals keyed by parameter name, step counter, policy) belongs to one "
                "optimizer: create one compression object per hvd.DistributedOptimizer (stateless ones like "
                "hvd.Compression.fp16 or crossover's FP16Compression may be shared)")


class GradientKeys:
    """Keys for the gradients of one step: the host's name, else the gradient's position in the step.

    A name seen twice in one step means a new step began (the host did not say so).
    """

    def __init__(self) -> None:
        self._ordinal = 0
        self._seen: set[str] = set()

    def begin(self) -> None:
        """A new step starts: positions restart at 0."""
        self._ordinal = 0
        self._seen.clear()

    def key(self, name: str | None) -> tuple[str, bool]:
        """The key for the next gradient, and whether it was already seen this step (a new step began)."""
        key = name if name is not None else f"#{self._ordinal}"
        self._ordinal += 1
        repeated = key in self._seen
        self._seen.add(key)
        return key, repeated


class HorovodCollectives:
    """`crossover.compression.collectives.Collectives` over horovod.torch, on one process set."""

    def __init__(self, process_set: Any = None, quiet: bool = True) -> None:
        self.process_set = process_set
        self.quiet = quiet

    def size(self) -> int:
        return self.process_set.size() if self.process_set is not None else hvd.size()

    def rank(self) -> int:
        return self.process_set.rank() if self.process_set is not None else hvd.rank()

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        if self.process_set is None:
            return hvd.allgather_async(tensor, name=name)
        return hvd.allgather_async(tensor, name=name, process_set=self.process_set)

    def alltoall_async(self, tensor: torch.Tensor, splits: Sequence[int], name: str) -> Any:
        """Rows of `tensor` to each rank of the process set, ``splits[r]`` rows to rank r (Horovod's alltoall)."""
        cut = torch.tensor([int(s) for s in splits], dtype=torch.int32)
        kw = {} if self.process_set is None else {"process_set": self.process_set}
        return _Alltoall(hvd.alltoall_async(tensor, splits=cut, name=name, **kw))

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Any:
        """Average `tensor` over the process set (out of place; the default optimizer's op and scaling, so
        Horovod fuses it with the gradients of the same cycle)."""
        kw = {} if self.process_set is None else {"process_set": self.process_set}
        return hvd.allreduce_async(tensor, name=name, op=hvd.Average, **kw)

    def wait(self, handle: Any) -> torch.Tensor:
        a2a = isinstance(handle, _Alltoall)
        if a2a:
            handle = handle.handle
        if self.quiet:
            torch_wait_quietly(handle)  # Horovod's own wait spins a core
        out = hvd.synchronize(handle)
        return out[0] if a2a else out  # an alltoall's synchronize gives (rows, rows received per rank)


@dataclass
class _Alltoall:
    """Horovod's handle of an alltoall in flight (its synchronize returns a pair)."""

    handle: int


@dataclass
class _Bucket:
    """Float32 gradients of one step sent as one flat tensor, DDP's bucket (see the module's docstring)."""

    key: str  # the codec's key (its residual, its collectives' names, its agreement checks)
    members: list[tuple[str, torch.Tensor]]  # (key, gradient) in arrival order
    places: dict[str, tuple[int, int, torch.Size]] | None = None  # key -> (offset, numel, shape) in the bucket
    ctx: Any = None  # the codec's context, once encoded
    handle: Any = None  # the payload's allreduce
    out: torch.Tensor | None = None  # the decoded bucket


@dataclass
class _Member:
    """The context of one gradient sent in a bucket: its bucket, and its key there."""

    bucket: _Bucket
    key: str


class TorchHookBase(metaclass=CompressionType):
    """Step boundaries, keys and pass-through for a horovod.torch compression object; the subclass builds its
    step session (crossover/driver/session.py: a step driver and a codec) and passes it here."""

    def __init__(self, session: StepSession, *, min_compress_numel: int) -> None:
        self.min_compress_numel = check_min_numel(min_compress_numel)
        self.session = session
        self.grouped = True  # the codec's allgathers travel in groups (False: one per tensor, as before)
        self.quiet_wait = True  # step() polls its handles with short sleeps (False: Horovod's spinning wait)
        self.comm = GroupedCollectives(HorovodCollectives())
        self._order: dict[str, int] = {}  # parameter name -> registration ordinal in the optimizer
        self._keys = GradientKeys()
        self._phase = "idle"  # "compress" during backward, "submitted" once synchronize begins, then "decompress"
        self._owner: weakref.ReferenceType[Any] | None = None  # the one optimizer this object serves
        self._step_large = 0  # float32 tensors of the step in flight at or above min_compress_numel
        self._step_small = 0  # tensors passed through in the step in flight: below min_compress_numel
        self._step_other: set[str] = set()  # dtypes of floating gradients passed through as not float32
        self._warned_small = False
        self._warned_outside = False
        self._threads_checked = False  # CPU tensors: ranks x threads against the cores, at the first step
        self._passed: list[torch.Tensor] = []  # per tensor passed through this step: finite after the reduction
        self._layout: dict[str, tuple[str, int]] | None = None  # gradient key -> (bucket's key, its members)
        self._open: dict[str, _Bucket] = {}  # the step's buckets still filling or not yet sent, by key

    @property
    def policy(self) -> Any:
        return self.session.policy

    @property
    def codec(self) -> Any:
        """The session's codec (for reading: every call goes through the session)."""
        return self.session.codec

    @property
    def driver(self) -> Any:
        """The session's step driver (for reading)."""
        return self.session.driver

    # ------------------------------------------------------------------ Horovod interface
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Called by Horovod per gradient; returns the tensor to allreduce and a context."""
        name, opt = torch_hook_caller(tensor)  # must be called from here: Horovod is two frames up
        if opt is None and version_supported():  # hvd.allreduce(x, compression=...) outside an optimizer's step
            self._say_outside()
            return tensor, OUTSIDE  # the exact result: this object's state belongs to its optimizer's gradients
        if opt is not None:
            self._check_owner(opt)
            if self.session.family_open:  # compressor="auto": the family, agreed by the ranks before the first step
                self.session = self.session.for_optimizer(opt, HorovodCollectives(torch_process_set(opt)))
        first = self._phase != "compress"  # the step's first gradient
        if first:
            self._new_step()
            if not self._threads_checked and tensor.device.type == "cpu":
                self._threads_checked = True
                _say_oversubscribed()
        if opt is not None:
            ps = torch_process_set(opt)
            if ps is not self.comm.inner.process_set:
                old = self.comm
                self.comm = GroupedCollectives(HorovodCollectives(ps), first_bytes=old.first_bytes,
                                               group_bytes=old.group_bytes)
                self.comm.begin_step()
            if not self._order:
                self._order = torch_parameter_order(opt)
            if self._layout is None:
                self._layout = self._bucket_layout(opt)
        self.comm.enabled = self.grouped
        self.comm.inner.quiet = self.quiet_wait
        if first:
            self.session.optimizer_seen(opt)  # momentum, DQ-SGD's lr: once a step
        nbytes = tensor.numel() * tensor.element_size()
        small = tensor.numel() < self.min_compress_numel
        float32 = tensor.dtype == torch.float32 and not tensor.is_sparse
        if float32:
            self._step_small += int(small)
            self._step_large += int(not small)
        elif tensor.is_floating_point() and not tensor.is_sparse:
            self._step_other.add(str(tensor.dtype).replace("torch.", ""))
        place = (self._layout or {}).get(name) if float32 and name is not None else None
        if not float32 or (small and place is None) or self.session.skips_all():
            self.session.count(nbytes, nbytes)
            return tensor, None  # pass through untouched
        key, repeated = self._keys.key(name)
        if repeated:  # same parameter twice in one step: treat as a new step
            self._send_buckets()
            self.comm.flush()
            self._settle_step()
            self.session.begin_step(self.comm)
            self._keys.begin()
            self._keys.key(name)
            self.comm.begin_step()
        if place is not None:  # joins its bucket; Horovod reduces an empty tensor in its place
            bucket_key, expected = place
            bucket = self._open.get(bucket_key)
            if bucket is None:
                bucket = self._open[bucket_key] = _Bucket(bucket_key, [])
            bucket.members.append((key, tensor))
            if len(bucket.members) == expected:  # all in (else it leaves when synchronize() begins)
                self._send_bucket(self._open.pop(bucket_key))
            return tensor.new_empty(0), _Member(bucket, key)
        ordinal = self._order.get(key)  # backward runs roughly in reverse registration order; else arrival order
        self.comm.note(-ordinal if ordinal is not None else self._step_large, tensor.numel())
        return self._encode(key, tensor)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Called by Horovod in synchronize() with the reduced tensor; returns the averaged gradient."""
        if ctx is OUTSIDE:
            return tensor
        self._submitted()  # at the latest here (Horovod's own synchronize: no earlier call)
        self._phase = "decompress"  # also after a pass-through: the next compress starts a step
        if isinstance(ctx, _Member):
            return self._bucket_out(ctx)
        if ctx is None:
            if tensor.is_floating_point() and not tensor.is_sparse:
                self._passed.append(finite_probe(tensor))  # no sync here: read once, at the step's end
            return tensor
        return self._decode(tensor, ctx)

    def _submitted(self) -> None:
        """Every gradient of the step is in (synchronize() begins): the buckets and the groups still
        open leave now, before the first wait, rather than after the first handle completes (a negotiation round)."""
        if self._phase == "compress":
            self._send_buckets()
            self.comm.flush()
            self._phase = "submitted"

    def _encode(self, key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The session's payload and context for one gradient (or a bucket)."""
        payload, ctx = self.session.encode(key, tensor, self.comm)
        if getattr(ctx, "stats_apart", None) is not None:  # a dense payload: its statistics go by their own allreduce
            ctx.stats_handle = self.comm.inner.allreduce_async(ctx.stats_apart, f"crossover.stats.{key}")
        return payload, ctx

    def _decode(self, reduced: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The averaged gradient from its reduced payload (and its statistics' own allreduce, where it had one)."""
        handle = getattr(ctx, "stats_handle", None)
        stats = None if handle is None else self.comm.inner.wait(handle)
        return self.session.decode(reduced, ctx, self.comm, stats)

    def reset(self) -> None:
        """Forget the step in flight (call from a Horovod elastic reset callback); policy state stays. The bucket
        layout is made again at the next step, on every rank alike (a worker that joined makes its first)."""
        self._layout = None
        self._phase = "idle"
        self._keys.begin()
        self._passed.clear()
        self._open.clear()
        self.comm.reset()
        self.session.reset()

    # ------------------------------------------------------------------ telemetry and state
    def stats(self, debug: bool = False) -> dict[str, Any]:
        """Cumulative telemetry of this rank: step, CF or bits in use, bytes sent vs dense, whether the policy
        settled and why (crossover/driver/flat.py); `debug`: the policy's internals too (`policy/...`)."""
        self._between_steps()
        return user_stats(self.session.stats(), debug)

    def close_tensorboard(self) -> None:
        """`tensorboard=`: log the step in flight, write everything, stop logging (done at exit anyway)."""
        self.session.close_tensorboard()

    def state_dict(self, include_residuals: bool = True) -> dict[str, Any]:
        """Everything a resumed run needs to continue the same schedule."""
        self._between_steps()
        state = self.session.state_dict()
        if include_residuals:
            state["residuals"] = self.codec.memory.state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`; the step in flight (if any) is dropped.

        Everything (policy, counters, step records, residuals: finite, of the right size) is validated
        before anything is applied: a bad state raises ValueError and leaves this object unchanged.
        """
        session = self.session.for_state(state)  # compressor="auto" before the first step: the checkpoint's family
        if isinstance(state, Mapping) and "residuals" in state:
            session.codec.memory.validate(state["residuals"])
        in_flight = session.load_state_dict(state)
        self.session = session
        if "residuals" in state:
            self.codec.memory.load(state["residuals"])
        self._phase = "idle"
        self._keys.begin()
        self._passed.clear()
        self._open.clear()
        self.comm.reset()
        if in_flight:
            self._phase = "decompress"  # the next compress finishes the restored step

    def sync(self, root_rank: int = 0) -> None:
        """Make every rank's policy state equal to `root_rank`'s (after an elastic reset, or a resume
        where ranks loaded different checkpoints); residuals stay per rank. Runs on the optimizer's
        process set once a step has bound it (every member calls it; `root_rank` is a rank in that set)."""
        ps = self.comm.inner.process_set
        kw = {} if ps is None else {"process_set": ps}
        state = hvd.broadcast_object(self.state_dict(include_residuals=False), root_rank=root_rank,
                                     name="crossover.compression.sync", **kw)
        self.load_state_dict(state)

    # ------------------------------------------------------------------ internals
    def _say_outside(self) -> None:
        if not self._warned_outside:
            self._warned_outside = True
            log.info("crossover: %s used outside a DistributedOptimizer's step (hvd.allreduce(..., compression=...)): "
                     "the tensor goes through exactly, uncompressed (the object compresses its optimizer's "
                     "gradients; use hvd.Compression.fp16 to compress other tensors)", type(self).__name__)

    def _bucket_layout(self, opt: Any) -> dict[str, tuple[str, int]]:
        """DDP's buckets over this optimizer's float32 parameters (see the module's docstring): name -> (bucket's
        key, members in it); the same on every rank (the session, the optimizer's op, the parameters' order and sizes).
        Empty (every gradient on its own) where buckets do not apply. Checks first, on every rank, that the ranks'
        parameters are alike (a bucket's shape would not tell)."""
        named = torch_named_parameters(opt)
        mine = [(n, str(p.dtype).replace("torch.", ""), tuple(p.shape)) for n, p in named]
        check_same_parameters(self._gather_json(mine, "crossover.parameters"), self.comm.rank())
        if not isinstance(self.session, SparseSession) or isinstance(self.session, LowRankSession):
            return {}
        if getattr(opt, "op", hvd.Average) != hvd.Average:
            return {}
        # small tensors (biases, BatchNorm) stay out of the buckets and go dense, as DGC exempts them: top-k over
        # buckets that held them ended ResNet-18 at 0.46 accuracy against dense's 0.72 (reports/benchmarks-1gbit.md)
        named = [(n, p) for n, p in named if p.dtype == torch.float32 and p.requires_grad
                 and p.numel() >= self.min_compress_numel]
        named.reverse()  # backward runs roughly in reverse registration order, as DDP's first buckets assume
        layout: dict[str, tuple[str, int]] = {}  # keys sort in layout order (zero-padded index)
        for index, bucket in enumerate(cut_buckets([p.numel() for _, p in named], self.comm.first_bytes,
                                                    self.comm.group_bytes)):  # a bucket's allgather: one group
            if len(bucket) > 1:  # a gradient alone in its bucket goes on its own (its own key; no copy)
                # its key names its parameters (registration order): unique among optimizers, as Horovod's names
                key = f"{BUCKET_KEY}{index:03d}[{named[bucket[-1]][0]}..{named[bucket[0]][0]}]"
                layout.update((named[i][0], (key, len(bucket))) for i in bucket)
        return layout

    def _gather_json(self, obj: Any, name: str) -> list[Any]:
        """Every rank's `obj` (JSON: tuples come back as lists, compared as such) on the optimizer's process set
        (Horovod's allgather_object takes none in 0.28), in rank order; blocking."""
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        comm = self.comm.inner
        sizes = comm.wait(comm.allgather_async(torch.tensor([data.numel()]), f"{name}.sizes")).tolist()
        every = comm.wait(comm.allgather_async(data, name)).numpy().tobytes()
        offsets = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
        return [json.loads(every[offsets[r]:offsets[r + 1]]) for r in range(len(sizes))]

    def _send_buckets(self) -> None:
        """Send every bucket still open (synchronize() begins: whatever did not arrive will not), in layout order."""
        open_, self._open = self._open, {}
        for key in sorted(open_):
            self._send_bucket(open_[key])

    def _send_bucket(self, bucket: _Bucket) -> None:
        """Encode a bucket (its members are in: each of min_compress_numel elements) and start its reductions."""
        # the same layout on every rank: registration order (arrival order may differ), then names
        members = sorted(bucket.members, key=lambda m: (self._order.get(m[0], math.inf), m[0]))
        places, off = {}, 0
        for key, t in members:
            places[key] = (off, t.numel(), t.shape)
            off += t.numel()
        bucket.places = places
        flat = torch.cat([t.reshape(-1) for _, t in members])
        self.comm.note(-min(self._order.get(k, 0) for k, _ in members), flat.numel())
        payload, bucket.ctx = self._encode(bucket.key, flat)
        bucket.handle = self.comm.inner.allreduce_async(payload, bucket.key)

    def _bucket_out(self, member: _Member) -> torch.Tensor:
        """A member's averaged gradient: its part of the bucket, decoded at the first member's decompress."""
        bucket = member.bucket
        if bucket.out is None:
            bucket.out = self._decode(self.comm.inner.wait(bucket.handle), bucket.ctx).reshape(-1)
        off, n, shape = bucket.places[member.key]
        return bucket.out[off:off + n].view(shape)

    def _new_step(self) -> None:
        """The first compress of a step: say once if the last step compressed nothing for its size."""
        if self._step_other and not self._step_large and not self._warned_small:
            self._warned_small = True
            log.warning("crossover: no gradient was compressed in a step: gradients of dtype %s went through "
                        "uncompressed (Horovod's dense path; crossover compresses float32 gradients only, which "
                        "is what a float32 model trained with torch.autocast has); stats() reports CF 1",
                        "/".join(sorted(self._step_other)))
        elif self._step_small and not self._step_large and not self._warned_small:
            self._warned_small = True
            log.warning("crossover: no gradient was compressed in a step: all %d float32 gradients are smaller "
                        "than min_compress_numel=%d elements and went through uncompressed (Horovod's dense "
                        "path). Pass a smaller min_compress_numel to compress them.", self._step_small,
                        self.min_compress_numel)
        self._step_large = self._step_small = 0
        self._step_other.clear()
        self._settle_step()
        self.session.begin_step(self.comm)
        self._phase = "compress"
        self._keys.begin()
        self.comm.begin_step()

    def _settle_step(self) -> None:
        """The step in flight is over: the session settles it (crossover/driver/session.py)."""
        passed, self._passed = self._passed, []
        self.session.settle(passed)

    def _between_steps(self) -> None:
        """Settle the last step if it is over (called by stats() and state_dict())."""
        if self._phase == "decompress":
            self._settle_step()

    def _check_owner(self, opt: Any) -> None:
        """One optimizer per stateful compression object: a second live one raises (same on every rank)."""
        owner = self._owner() if self._owner is not None else None
        if owner is opt:
            return
        if owner is not None:
            raise ValueError(SHARED_ERROR)
        self._owner = weakref.ref(opt)
        if self.quiet_wait:
            torch_quiet_synchronize(opt, self._submitted)  # step() then waits on the gradients without spinning a core
