"""Horovod compression objects for `horovod.tensorflow`: adaptive (GraVAC, DQ-SGD) and static sparsification.

Use:  tape = hvd.DistributedGradientTape(tape, compression=AdaptiveCompression())
      opt = hvd.DistributedOptimizer(opt, compression=AdaptiveCompression())   # horovod.tensorflow.keras

How it fits Horovod's TensorFlow hook (docs/tensorflow.md, docs/architecture.md): one "begin step"
`tf.py_function` per traced step (horovod_ext/_tf_host.py) feeds the framework-free step driver
(crossover/driver/, the same as horovod.torch's) with the previous step's reduced statistics
and returns this step's plan `[send_cf, floor_cf, candidate_cf, step, previous step time]`, which every
compress of the step reads. Everything else here is tensor movement, in graph:
* compressed payloads carry the driver's `SparseStatsLayout` for two probes (floor, candidate); the
  allreduce sums it over ranks, decompress adds it to an accumulator variable, the next "begin step"
  hands the sums to the driver (one step late, as with torch);
* rank-specific top-k selections travel by an in-graph `hvd.allgather` issued inside `compress` (the
  stock allreduce then carries only the statistics); random-k values at shared indices and dense sends
  go in the allreduced payload. The payload's length changes with the plan: Horovod's TF ops take the
  runtime shape, and all ranks change it on the same step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from crossover.adaptive.static import StaticPolicy
from crossover.compression.wire import INDEX_BYTES, SparseStatsLayout, gather_bitmap_bytes, shared_seed
from crossover.driver import (
    CfPolicy,
    SparseStepDriver,
    check_momentum,
    gravac_or_dense,
    keras_optimizer_momentum,
    reported_momentum,
)
from horovod_ext._class_guard import CompressionType
from horovod_ext._facade import AdaptiveFacade
from horovod_ext._tf_host import TFHookBase, check_op, hook_context, safe_name, tracing_function
from horovod_ext.tf_quantization import DqsgdCompression

__all__ = ["AdaptiveCompression", "FP16Compression", "GravacCompression", "StaticCompression"]

log = logging.getLogger(__name__)
COMPRESSORS = ("topk", "randomk")  # the TF kernels; dgc/redsync exist for horovod.torch only
_LAYOUT = SparseStatsLayout(2, checks=False)  # TF always measures the floor and the candidate; no agreement checks
_ACC = _LAYOUT.length + 2  # tensors, step time, the layout's sums from ||g||^2 on, bytes sent, bytes dense
_MODE_DENSE, _MODE_ALLGATHER, _MODE_ALLREDUCE = 0, 1, 2


def _k_for(numel: int, cf: tf.Tensor) -> tf.Tensor:
    """Elements kept at compression factor cf, as crossover.compression.selectors.k_for: ceil(n / cf) in [1, n]."""
    k = tf.math.ceil(tf.constant(float(numel), tf.float64) / cf)
    return tf.cast(tf.clip_by_value(k, 1.0, float(numel)), tf.int32)


def _transport(numel: int, k: tf.Tensor, world: int, shared: bool) -> tf.Tensor:
    """crossover.compression.cost_model.choose_transport in graph (k is known at run time only).

    Shared indices allreduce; rank-specific ones allgather (index + value, 8 bytes) while that sends
    fewer bytes than a ring allreduce of the dense fp32 tensor, i.e. while (n-1) k 8 < 2 (n-1)/n numel 4.
    """
    if shared:
        return tf.where(k >= numel, _MODE_DENSE, _MODE_ALLREDUCE)
    ag = float(world - 1) * tf.cast(k, tf.float64) * 8.0
    ar = 2.0 * (world - 1) / world * numel * 4.0
    return tf.where(tf.logical_and(k < numel, ag < ar), _MODE_ALLGATHER, _MODE_DENSE)


def _stratified_indices(numel: int, k: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """k sorted distinct indices < numel, one per stratum [j n // k, (j+1) n // k), from a shared seed."""
    j = tf.range(tf.cast(k, tf.int64), dtype=tf.int64)
    k64 = tf.cast(k, tf.int64)
    lo = j * numel // k64
    width = (j + 1) * numel // k64 - lo
    u = tf.random.stateless_uniform(tf.shape(j), seed=seed, dtype=tf.float64)
    off = tf.minimum(tf.cast(tf.floor(u * tf.cast(width, tf.float64)), tf.int64), width - 1)
    return tf.cast(lo + off, tf.int32)


# The allgather's payload is rows of two int32. Where a bitmap costs fewer bytes than the indices
# (crossover.compression.wire.gather_bitmap: 4 k > ceil(n / 64) 8, about k > n / 32), a rank sends a bit per
# element (element i: bit i % 8 of byte i // 8) in ceil(n / 64) rows, then its k values in ascending index order,
# two per row; else (index, value) pairs. Every rank sends the same k (exact top-k at the step's CF), so the rule and
# the rows agree on every rank. Bytes go into the int32 rows by bitcast and come out the same way: no byte order.
_BIT_WEIGHTS = [1 << b for b in range(8)]


def _bitmap_rows(idx: tf.Tensor, numel: int) -> tf.Tensor:
    """Rows of the bitmap of `idx` (distinct int32 indices < numel): ceil(numel / 64) rows of two int32 words."""
    rows = gather_bitmap_bytes(numel) // 8
    bits = tf.scatter_nd(idx[:, None], tf.ones(tf.shape(idx), tf.uint8), [rows * 64])
    # distinct powers of two: the sum is the bitwise OR, at most 255
    octets = tf.reduce_sum(tf.reshape(bits, [rows * 8, 8]) * tf.constant(_BIT_WEIGHTS, tf.uint8), 1)
    return tf.reshape(tf.bitcast(tf.reshape(octets, [rows * 2, 4]), tf.int32), [rows, 2])


def _value_rows(vals: tf.Tensor) -> tf.Tensor:
    """float32 values as rows of two int32 (bit for bit), the last row padded with a zero."""
    padded = tf.pad(vals, [[0, tf.size(vals) % 2]])
    return tf.reshape(tf.bitcast(padded, tf.int32), [-1, 2])


def _unpack_bitmaps(gathered: tf.Tensor, numel: int, k: tf.Tensor, world: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Every rank's (positions, values) from an allgather of `_bitmap_rows` + `_value_rows` parts, rank by rank."""
    rows = gather_bitmap_bytes(numel) // 8
    parts = tf.reshape(gathered, [world, -1, 2])
    octets = tf.reshape(tf.bitcast(parts[:, :rows, :], tf.uint8), [world, rows * 8])  # one byte per 8 elements
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(octets[:, :, None], tf.constant(list(range(8)), tf.uint8)), 1)
    mask = tf.reshape(bits, [world, rows * 64])[:, :numel] > 0
    pos = tf.cast(tf.where(mask)[:, 1], tf.int32)  # row-major: rank by rank, ascending, k per rank
    vals = tf.reshape(tf.bitcast(parts[:, rows:, :], tf.float32), [world, -1])[:, :k]
    return pos, tf.reshape(vals, [-1])




# ---------------------------------------------------------------------------------------------
# Sparsification (GraVAC / static)
# ---------------------------------------------------------------------------------------------
@dataclass
class _Ctx:
    mode: tf.Tensor
    numel: int
    shape: tf.TensorShape
    gathered: tf.Tensor
    idx: tf.Tensor
    k: tf.Tensor
    bitmap: tf.Tensor  # the allgather's rows are bitmaps + values (else pairs)
    sent_bytes: tf.Tensor
    dense_bytes: float


class _SparseCompression(TFHookBase):
    """Selection (top-k, random-k), error feedback, transport and telemetry for horovod.tensorflow."""

    _plan_len = 5  # [send_cf, floor_cf, candidate_cf, step, previous step time]

    def __init__(self, compressor: str, policy: CfPolicy, *, error_feedback: bool, min_compress_numel: int,
                 seed: int, log_csv: str | None, passthrough: bool = False, tensorboard: Any = None,
                 momentum: float | None = None) -> None:
        # the optimizer's momentum, in the statistics: the policy caps the CF by it. A tape does not see the optimizer:
        # unset, UNKNOWN_MOMENTUM (0.9), the safe side, until Horovod's Keras DistributedOptimizer shows it one
        self._momentum_setting = check_momentum(momentum)
        self.momentum = reported_momentum(self._momentum_setting)
        if compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {', '.join(COMPRESSORS)} with horovod.tensorflow "
                             f"(dgc and redsync have torch kernels only); got {compressor!r}")
        super().__init__(min_compress_numel=min_compress_numel, error_feedback=error_feedback, seed=seed)
        self.compressor = compressor
        self.shared_indices = compressor == "randomk"
        self.driver = SparseStepDriver(policy, compressor=compressor, seed=seed, log_csv=log_csv, rank=hvd.rank,
                                       tensorboard=tensorboard, checks=False)
        self.log_csv = log_csv
        self._passthrough_all = passthrough  # compression off: Horovod's dense path, untouched

    @property
    def policy(self) -> CfPolicy:
        return self.driver.policy

    def _acc_len(self) -> int:
        return _ACC

    def _optimizer_seen(self, opt: Any) -> None:
        """Horovod's Keras DistributedOptimizer was built around `opt` with this object (horovod_ext/keras_guard.py):
        unless `momentum=` was given, report `opt`'s momentum (read once, before the first step traces the statistics;
        an unreadable one keeps UNKNOWN_MOMENTUM)."""
        if self._momentum_setting is None:
            m = keras_optimizer_momentum(opt)
            if m is not None:
                self.momentum = m

    # ------------------------------------------------------------------ run time (py_function)
    def _rt_begin(self) -> np.ndarray:
        """Once per step, before any compress of it runs: hand the last step to the driver, plan."""
        with self._lock:
            acc = self._read_and_clear()
            drv = self.driver
            drv.count(int(acc[-2]), int(acc[-1]))
            drv.add_sums([1.0, *acc[1:-2]], int(acc[0]), _LAYOUT)
            rec = drv.begin_step(time.perf_counter())
            send = rec.sent_cf
            floor = rec.probes[0] if rec.probes else send
            cand = rec.probes[-1] if rec.probes else send
            if send not in (1.0, floor, cand):
                raise RuntimeError(f"policy plan sends CF {send}: it must be 1 or a probed CF")
            return np.array([send, floor, cand, float(drv.step), drv.last_step_time], np.float64)

    # ------------------------------------------------------------------ Horovod interface (traced)
    def _compress_float(self, tensor: tf.Tensor, plan: tf.Tensor, key: str, numel: int) -> tuple[Any, Any]:
        world = hvd.size()
        send, floor, cand = plan[0], plan[1], plan[2]
        step = tf.cast(plan[3], tf.int64)
        x = tf.reshape(tensor, [-1])
        residual = self._residual(key, numel) if self.error_feedback else None
        acc = x + residual.read_value() if residual is not None else x
        dense_sq = tf.reduce_sum(tf.square(acc))
        k_floor, k_cand = _k_for(numel, floor), _k_for(numel, cand)
        k_send = tf.where(send > 1.0, _k_for(numel, tf.maximum(send, 1.0)), numel)
        mode = tf.where(send > 1.0, _transport(numel, k_send, world, self.shared_indices), _MODE_DENSE)
        seed = tf.stack([tf.constant(shared_seed(self.seed, 0, key), tf.int64), step])
        if self.shared_indices:
            # floor: stratified shared indices; candidate: a shared random subset of them (multi-level)
            idx_floor = _stratified_indices(numel, k_floor, seed)
            vals_floor = tf.gather(acc, idx_floor)
            sub = tf.sort(tf.random.experimental.stateless_shuffle(
                tf.range(k_floor), seed=seed + tf.constant([0, 0x5DEECE66D], tf.int64))[:k_cand])
            sq_floor = tf.reduce_sum(tf.square(vals_floor))
            sq_cand = tf.reduce_sum(tf.square(tf.gather(vals_floor, sub)))
            idx_send = tf.cond(k_send >= k_floor, lambda: idx_floor, lambda: tf.gather(idx_floor, sub))
        else:
            # exact top-k of |acc| at the floor, sorted: the candidate and the sent set are prefixes of it
            _, idx_floor = tf.math.top_k(tf.abs(acc), k_floor, sorted=True)
            cum = tf.cumsum(tf.square(tf.gather(acc, idx_floor)))
            sq_floor, sq_cand = cum[k_floor - 1], cum[k_cand - 1]
            idx_send = idx_floor[:tf.minimum(k_send, k_floor)]
        grad_sq = tf.reduce_sum(tf.square(x)) if residual is not None else dense_sq
        # SparseStatsLayout(2): [1, step time, ||g||^2, ||g||, ||g+e||^2, ||g+e||, momentum, floor/candidate sq, norms]
        stats = tf.stack([tf.constant(1.0), tf.cast(plan[4], tf.float32), grad_sq, tf.sqrt(grad_sq), dense_sq,
                          tf.sqrt(dense_sq), tf.constant(self.momentum, tf.float32), sq_floor, sq_cand,
                          tf.sqrt(sq_floor), tf.sqrt(sq_cand)])
        name = f"crossover.allgather.{self._uid}.{safe_name(key)}"
        bitmap_bytes = gather_bitmap_bytes(numel)
        bitmap = tf.cast(k_send, tf.int64) * INDEX_BYTES > bitmap_bytes  # wire.gather_bitmap, in graph

        def dense_branch():
            return (tf.concat([acc, stats], 0), tf.zeros([0, 2], tf.int32), tf.zeros([0], tf.int32),
                    tf.zeros_like(acc))

        def allgather_branch():
            def as_bitmap():
                ordered = tf.sort(idx_send)
                return tf.concat([_bitmap_rows(ordered, numel), _value_rows(tf.gather(acc, ordered))], 0)

            def as_pairs():
                return tf.stack([idx_send, tf.bitcast(tf.gather(acc, idx_send), tf.int32)], axis=1)

            gathered = hvd.allgather(tf.cond(bitmap, as_bitmap, as_pairs), name=name)
            left = tf.tensor_scatter_nd_update(acc, idx_send[:, None], tf.zeros(tf.shape(idx_send), acc.dtype))
            return stats, gathered, idx_send, left

        def allreduce_branch():
            vals = tf.gather(acc, idx_send)
            left = tf.tensor_scatter_nd_update(acc, idx_send[:, None], tf.zeros_like(vals))
            return tf.concat([vals, stats], 0), tf.zeros([0, 2], tf.int32), idx_send, left

        payload, gathered, idx, left = tf.switch_case(mode, [dense_branch, allgather_branch, allreduce_branch])
        payload.set_shape([None])
        deps = []
        if residual is not None:
            deps.append(residual.assign(left))
        sent = tf.cast(tf.size(payload) * 4, tf.float64)  # what this rank hands to Horovod, in bytes
        k64 = tf.cast(k_send, tf.float64)
        part = tf.where(bitmap, bitmap_bytes + 8.0 * tf.math.ceil(k64 / 2.0), 8.0 * k64)  # cost_model.gather_part_bytes
        sent += tf.where(tf.equal(mode, _MODE_ALLGATHER), part, 0.0)
        with tf.control_dependencies(deps):
            payload = tf.identity(payload)
        ctx = _Ctx(mode=mode, numel=numel, shape=tensor.shape, gathered=gathered, idx=idx,
                   k=tf.minimum(k_send, numel), bitmap=bitmap, sent_bytes=sent, dense_bytes=float(numel * 4))
        return payload, ctx

    def _decompress_payload(self, tensor: Any, ctx: Any) -> Any:
        world = hvd.size()
        stats = tf.cast(tensor[-_LAYOUT.length:], tf.float64)
        scale = stats[0]  # 1 for Average, world size for Sum (times any pre/postscale)
        ok = scale > 0
        safe = tf.where(ok, scale, 1.0)
        to_sum = world / safe  # turns a reduced statistic into the sum over ranks
        # the accumulator: [tensors, step time, sums over ranks in _LAYOUT from ||g||^2 on (the momentum: its mean),
        # bytes sent, dense]
        mom = _LAYOUT.MOMENTUM
        vec = tf.concat([tf.stack([tf.constant(1.0, tf.float64), stats[1] / safe]), stats[2:mom] * to_sum,
                         stats[mom:mom + 1] / safe, stats[mom + 1:] * to_sum,
                         tf.stack([ctx.sent_bytes, tf.constant(ctx.dense_bytes, tf.float64)])], 0)
        vec = tf.where(ok, vec, tf.constant([0.0] * _LAYOUT.length + [1.0, 1.0], tf.float64) * vec)
        upd = self._acc().assign_add(vec)
        n = ctx.numel
        factor = tf.cast(safe / world, tf.float32)

        def dense():
            return tensor[:n]

        def gathered():
            def pairs():
                return ctx.gathered[:, 0], tf.bitcast(ctx.gathered[:, 1], tf.float32)

            idx, vals = tf.cond(ctx.bitmap, lambda: _unpack_bitmaps(ctx.gathered, n, ctx.k, world), pairs)
            return tf.scatter_nd(idx[:, None], vals * factor, [n])  # overlapping indices add up

        def shared():
            return tf.scatter_nd(ctx.idx[:, None], tensor[:ctx.k], [n])

        out = tf.switch_case(ctx.mode, [dense, gathered, shared])
        with tf.control_dependencies([upd]):
            out = tf.reshape(tf.identity(out), ctx.shape)
        self._mark_decompressed()
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self, include_residuals: bool = True) -> dict[str, Any]:
        """Everything a resumed run needs to continue the same schedule (residuals as numpy arrays)."""
        with self._lock:
            state = self.driver.state_dict()
            state["bytes_sent"], state["bytes_dense"] = self._bytes_now()
            if include_residuals:
                state["residuals"] = self._residuals_state()
            return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()` (between steps); the step in flight, if any, is dropped. Everything is
        checked first: a bad state raises ValueError and changes nothing."""
        with self._lock:
            has_residuals = isinstance(state, Mapping) and "residuals" in state
            residuals = self._check_residuals(state["residuals"]) if has_residuals else None
            self.driver.load_state_dict(state)
            if self._acc_var is not None:
                self._read_and_clear()
            self.seed = self.driver.seed
            if residuals is not None:
                self._load_residuals(residuals)
            if self.driver.current is not None:  # its statistics were in the accumulator: they are lost
                self.driver.current.tensors = 0

    def sync(self, root_rank: int = 0) -> None:
        """Make every rank's policy state equal to `root_rank`'s (elastic reset, resume); residuals stay."""
        state = hvd.broadcast_object(self.state_dict(include_residuals=False), root_rank=root_rank,
                                     name="crossover.compression.sync")
        self.load_state_dict(state)


class GravacCompression(_SparseCompression):
    """GraVAC for horovod.tensorflow: sparsify with `compressor`, adapting the compression factor.

    `**gravac`: any setting of `crossover.adaptive.gravac.GravacPolicy` (cf_min, cf_max, epsilon, omega,
    window, gain, search, cf_step, reopen_drift, warmup_steps, ewma_alpha, scaling); what is not given
    keeps the policy's default, so `AdaptiveCompression()` is exactly the policy's defaults (docs/gravac.md).
    Same settings as the torch object (docs/compression.md); `compressor` is "topk" (exact top-k,
    allgather) or "randomk" (shared seed, allreduce). `enabled=False`: Horovod's dense path, untouched
    (nothing is logged then). `tensorboard`: a directory (rank 0 writes) or a writer with add_scalar.
    `momentum`: your optimizer's SGD momentum or Adam's beta1, 0 for none; the policy caps the compression by it.
    Unset, Horovod's Keras `DistributedOptimizer` shows this object the optimizer it wraps, and its `momentum` or
    `beta_1` is read; a gradient tape does not see the optimizer, and this object then assumes 0.9
    (`crossover.driver.UNKNOWN_MOMENTUM`: the CF stays where the commonest recipes keep accuracy) (docs/accuracy.md).
    """

    def __init__(self, compressor: str = "topk", *, error_feedback: bool = True, min_compress_numel: int = 16384,
                 enabled: bool = True, seed: int = 0, log_csv: str | None = None, tensorboard: Any = None,
                 momentum: float | None = None, **gravac: Any) -> None:
        pol = gravac_or_dense(enabled, **gravac)
        super().__init__(compressor, pol, error_feedback=error_feedback, min_compress_numel=min_compress_numel,
                         seed=seed, log_csv=log_csv, passthrough=not enabled, tensorboard=tensorboard,
                         momentum=momentum)
        self.enabled = bool(enabled)


class StaticCompression(_SparseCompression):
    """A fixed compression factor: `StaticCompression("topk", cf=100)` is static top-k at 1 %."""

    def __init__(self, compressor: str = "topk", *, cf: float = 100.0, error_feedback: bool = True,
                 min_compress_numel: int = 16384, seed: int = 0, log_csv: str | None = None,
                 tensorboard: Any = None) -> None:
        pol = StaticPolicy(cf=cf)
        super().__init__(compressor, pol, error_feedback=error_feedback, min_compress_numel=min_compress_numel,
                         seed=seed, log_csv=log_csv, passthrough=pol.plan().send_cf == 1.0, tensorboard=tensorboard)


class AdaptiveCompression(AdaptiveFacade):
    """GraVAC (default) or DQ-SGD (`policy="dqsgd"`) for horovod.tensorflow; see horovod_ext/_facade.py."""

    _gravac = GravacCompression
    _dqsgd = DqsgdCompression


class FP16Compression(metaclass=CompressionType):
    """fp16 casts (like hvd.Compression.fp16) with byte counters; summable, so plain allreduce.

    May be built inside a tf.function, as Horovod's TF2 example does with `hvd.Compression.fp16`:
    TensorFlow traces such a function more than once and builds a new object each time, and must not
    create a variable after the first trace, so objects built inside a tf.function share one counter
    variable (their `stats()` count all of them together). Built outside, each object counts its own.
    """

    __hash__ = object.__hash__
    _shared_counts: tf.Variable | None = None  # the counter of objects built inside a tf.function

    def __init__(self) -> None:
        self._counts: tf.Variable | None = None
        self._in_function = tracing_function()

    @staticmethod
    def _new_counter() -> tf.Variable:
        with tf.init_scope():
            return tf.Variable(tf.zeros([2], tf.int64), trainable=False, name="crossover_fp16_bytes")

    def _var(self) -> tf.Variable:
        if self._counts is None:
            if self._in_function:
                if FP16Compression._shared_counts is None:
                    FP16Compression._shared_counts = self._new_counter()
                self._counts = FP16Compression._shared_counts
            else:
                self._counts = self._new_counter()
        return self._counts

    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Cast float32/float64 to float16 (others untouched) and count bytes."""
        check_op(hook_context(self)[1])
        if isinstance(tensor, tf.IndexedSlices):
            return tensor, None
        n = tf.cast(tf.size(tensor), tf.int64)
        if tensor.dtype in (tf.float32, tf.float64):
            out, ctx = tf.cast(tensor, tf.float16), tensor.dtype
            sent = n * 2
        else:
            out, ctx = tensor, None
            sent = n * tensor.dtype.size
        upd = self._var().assign_add(tf.stack([sent, n * tensor.dtype.size]))
        with tf.control_dependencies([upd]):
            return tf.identity(out), ctx

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Cast back to the gradient's dtype."""
        return tensor if ctx is None else tf.cast(tensor, ctx)

    def stats(self, debug: bool = False) -> dict[str, Any]:
        """Bytes handed to Horovod vs the dense bytes (same keys as the other compressions)."""
        sent, dense = (int(v) for v in self._var().numpy())
        return {"step": None, "compression_factor": 2.0, "gain": None, "bytes_sent": sent, "bytes_dense": dense}
