"""DQ-SGD and QSGD for `horovod.tensorflow`: stochastic quantization with bits chosen per step.

Use:  tape = hvd.DistributedGradientTape(tape, compression=AdaptiveCompression(
          policy="dqsgd", total_steps=T, lr=0.1))

Same plumbing as tf_compression (one "begin step" py_function per traced step, horovod_ext/_tf_host.py,
feeds the framework-free `QuantStepDriver` of crossover/driver/ and returns the step's bits).
Per gradient, in graph:
error feedback (optional), max-norm scale, stochastic rounding to `2**(bits-1) - 1` levels with a
stateless seed from (seed, tensor, step, rank), then either

* allgather of `[scale as 4 bytes, b-bit codes packed LSB first]` (the layout of
  crossover/compression/quantize.py) issued inside `compress`, the stock allreduce carrying `[1, ||x||^2]`;
* or allreduce of the dequantized values in float16 with `[1, mean square]` appended,

whichever sends fewer bytes at `b_max` bits for this world size (chosen per tensor at trace time;
at 2 to 3 ranks always the allgather).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from crossover.compression import cost_model
from crossover.compression.wire import shared_seed
from crossover.driver import QuantStepDriver, dqsgd_settings, lr_at
from crossover.driver.transport import check_quant_transport, quant_route
from horovod_ext._tf_host import TFHookBase, safe_name

__all__ = ["DqsgdCompression", "QSGDCompression", "pack_codes", "unpack_codes"]

log = logging.getLogger(__name__)
LR = Union[float, Callable[[int], float], Any]
# accumulator slots: tensors, global ||x||^2, elements quantized, bytes sent, bytes dense
_QACC = 5
_EIGHT = np.arange(8, dtype=np.uint64)  # element (and byte) positions in a 64-bit group


def pack_codes(codes: tf.Tensor, bits: tf.Tensor) -> tf.Tensor:
    """Pack codes (ints in [0, 2**bits)) b bits each, LSB first, into uint8: ceil(n/8) * b bytes."""
    n = tf.size(codes)
    groups = (n + 7) // 8
    c = tf.cast(tf.pad(codes, [[0, groups * 8 - n]]), tf.uint64)
    b = tf.cast(bits, tf.uint64)
    shifts = tf.constant(_EIGHT) * b
    words = tf.reduce_sum(tf.bitwise.left_shift(tf.reshape(c, [groups, 8]), shifts), axis=1)  # no overlap
    byte_shifts = tf.constant(_EIGHT * 8)
    by = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words[:, None], byte_shifts), tf.constant(255, tf.uint64))
    return tf.reshape(tf.cast(by[:, :bits], tf.uint8), [-1])


def unpack_codes(packed: tf.Tensor, numel: int, bits: tf.Tensor) -> tf.Tensor:
    """Inverse of pack_codes for a batch: packed [R, ceil(n/8) * b] uint8 -> codes [R, n] int32."""
    rows = tf.shape(packed)[0]
    groups = (numel + 7) // 8
    by = tf.reshape(tf.cast(packed, tf.uint64), [rows, groups, bits])
    by = tf.pad(by, [[0, 0], [0, 0], [0, 8 - bits]])
    words = tf.reduce_sum(tf.bitwise.left_shift(by, tf.constant(_EIGHT * 8)), axis=2)
    b = tf.cast(bits, tf.uint64)
    mask = tf.bitwise.left_shift(tf.constant(1, tf.uint64), b) - 1
    codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words[:, :, None], tf.constant(_EIGHT) * b), mask)
    return tf.cast(tf.reshape(codes, [rows, groups * 8])[:, :numel], tf.int32)


@dataclass
class _QCtx:
    kind: str
    numel: int
    shape: tf.TensorShape
    bits: tf.Tensor
    levels: tf.Tensor
    gathered: tf.Tensor | None
    sent_bytes: tf.Tensor


class _QuantizedBase(TFHookBase):
    """Quantization machinery shared by the adaptive (DQ-SGD) and fixed-bits (QSGD) TF objects."""

    _plan_len = 2  # [bits, step]

    def __init__(self, driver: QuantStepDriver, *, error_feedback: bool, min_compress_numel: int, seed: int,
                 transport: str, b_max: int) -> None:
        check_quant_transport(transport)
        super().__init__(min_compress_numel=min_compress_numel, error_feedback=error_feedback, seed=seed)
        self.driver = driver
        self.transport = transport
        self._b_max = b_max

    def _acc_len(self) -> int:
        return _QACC

    def _lr_at(self, step: int) -> float | None:
        return None

    # ------------------------------------------------------------------ run time (py_function)
    def _rt_begin(self) -> np.ndarray:
        """Once per step: observe the last step's global norm, then plan this step's bits."""
        with self._lock:
            acc = self._read_and_clear()
            drv = self.driver
            drv.count(int(acc[3]), int(acc[4]))
            if acc[0] > 0:  # the in-graph sums are already over ranks
                drv.add_tensor(int(acc[2]))
                drv.add_sq_sum(float(acc[1]))
            bits = drv.begin_step(hvd.size())
            drv.lr = self._lr_at(drv.step)
            return np.array([float(bits), float(drv.step)], np.float64)

    # ------------------------------------------------------------------ Horovod interface (traced)
    def _compress_float(self, tensor: tf.Tensor, plan: tf.Tensor, key: str, numel: int) -> tuple[Any, Any]:
        world, rank = hvd.size(), hvd.rank()
        bits = tf.cast(plan[0], tf.int32)
        step = tf.cast(plan[1], tf.int64)
        s_int = tf.bitwise.left_shift(1, bits - 1) - 1
        s = tf.cast(s_int, tf.float32)
        x = tf.reshape(tensor, [-1])
        residual = self._residual(key, numel) if self.error_feedback else None
        if residual is not None:
            x = x + residual.read_value()
        sq = tf.reduce_sum(tf.square(x))
        absx = tf.abs(x)
        mx = tf.reduce_max(absx)
        scale = tf.where(mx > 0, mx, 1.0)  # an all-zero tensor quantizes to zeros at any scale
        # independent rounding per rank: the seed mixes (seed, tensor) with (step, rank)
        seed = tf.stack([tf.constant(shared_seed(self.seed, 0, key), tf.int64), step * 65536 + rank])
        u = tf.random.stateless_uniform([numel], seed=seed, dtype=tf.float32)
        mag = tf.minimum(tf.floor(absx * (s / scale) + u), s)
        levels = tf.cast(tf.where(x < 0, -mag, mag), tf.int32)
        kind = quant_route(self.transport, numel, self._b_max, world)
        deps = []
        if residual is not None:
            deps.append(residual.assign(x - tf.cast(levels, tf.float32) * (scale / s)))
        if kind == cost_model.ALLGATHER:
            packed = pack_codes(levels + s_int, bits)
            seg = tf.concat([tf.bitcast(tf.reshape(scale, [1]), tf.uint8)[0], packed], 0)
            with tf.control_dependencies(deps):
                gathered = hvd.allgather(seg, name=f"crossover.qallgather.{self._uid}.{safe_name(key)}")
            payload = tf.stack([tf.constant(1.0), sq])
            sent = tf.cast(tf.size(seg) + 8, tf.float64)
        else:  # dequantized values sum in fp16; the norm travels as a mean square below fp16's max
            gathered = None
            vals = tf.cast(levels, tf.float32) * (scale / s)
            payload = tf.cast(tf.concat([vals, tf.stack([tf.constant(1.0), tf.minimum(sq / numel, 60000.0)])], 0),
                              tf.float16)
            sent = tf.cast(tf.size(payload) * 2, tf.float64)
        with tf.control_dependencies(deps):
            payload = tf.identity(payload)
        return payload, _QCtx(kind=kind, numel=numel, shape=tensor.shape, bits=bits, levels=s_int,
                              gathered=gathered, sent_bytes=sent)

    def _decompress_payload(self, tensor: Any, ctx: Any) -> Any:
        world = hvd.size()
        stats = tf.cast(tensor[-2:], tf.float64)
        scale_back = stats[0]  # 1 for Average, world size for Sum
        ok = scale_back > 0
        safe = tf.where(ok, scale_back, 1.0)
        sq = stats[1] * (ctx.numel if ctx.kind != cost_model.ALLGATHER else 1) * world / safe
        one = tf.constant(1.0, tf.float64)
        vec = tf.stack([tf.where(ok, one, 0.0), tf.where(ok, sq, 0.0), tf.constant(float(ctx.numel), tf.float64),
                        ctx.sent_bytes, tf.constant(float(ctx.numel * 4), tf.float64)])
        upd = self._acc().assign_add(vec)
        if ctx.kind != cost_model.ALLGATHER:
            out = tf.cast(tensor[:ctx.numel], tf.float32)
        else:
            seg = tf.reshape(ctx.gathered, [world, -1])  # one segment per rank, all the same length
            scales = tf.reshape(tf.bitcast(seg[:, :4], tf.float32), [world, 1])
            levels = unpack_codes(seg[:, 4:], ctx.numel, ctx.bits) - ctx.levels
            weight = tf.cast(safe / world, tf.float32)
            s = tf.cast(ctx.levels, tf.float32)
            out = tf.reduce_sum(tf.cast(levels, tf.float32) * (scales / s), axis=0) * weight
        with tf.control_dependencies([upd]):
            out = tf.reshape(tf.identity(out), ctx.shape)
        self._mark_decompressed()
        return out

    def state_dict(self) -> dict[str, Any]:
        """Step counter, bits, counters, residuals (numpy arrays); DQ-SGD: its policy with the calibrated budget."""
        with self._lock:
            state = self.driver.state_dict()
            state["bytes_sent"], state["bytes_dense"] = self._bytes_now()
            state["residuals"] = self._residuals_state()
            return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()` between steps; everything checked first (ValueError, nothing changed)."""
        with self._lock:
            residuals = self._check_residuals(state.get("residuals", {}) if isinstance(state, Mapping) else {})
            self.driver.load_state_dict(state)
            if self._acc_var is not None:
                self._read_and_clear()
            self._load_residuals(residuals)


class QSGDCompression(_QuantizedBase):
    """Static QSGD: `bits` per element (2 = TernGrad-style ternary), stochastic rounding, max-norm scale.
    `tensorboard`: as DqsgdCompression's."""

    def __init__(self, bits: int = 8, *, error_feedback: bool = False, min_compress_numel: int = 16384,
                 seed: int = 0, transport: str = "auto", tensorboard: Any = None) -> None:
        self.fixed_bits = bits
        super().__init__(QuantStepDriver(bits=bits, tensorboard=tensorboard, rank=hvd.rank),
                         error_feedback=error_feedback, min_compress_numel=min_compress_numel, seed=seed,
                         transport=transport, b_max=bits)


class DqsgdCompression(_QuantizedBase):
    """DQ-SGD for horovod.tensorflow: the bits of each step from gradient norm, learning rate, step, horizon.

    total_steps (required): the horizon T. lr (required with TensorFlow, Horovod does not pass the
    optimizer): a number, a callable step -> lr, or a Keras optimizer whose `learning_rate` (a value
    or a schedule of `iterations`) is read every step. error_budget=None calibrates on the first step.
    tensorboard: a directory (rank 0 writes) or a writer with add_scalar (docs/tensorflow.md).
    """

    def __init__(self, *, total_steps: int, lr: LR = None, error_budget: float | None = None,
                 target_bits: int = 6, b_min: int = 2, b_max: int = 8, decay: float = 0.999,
                 error_feedback: bool = False, min_compress_numel: int = 16384, seed: int = 0,
                 transport: str = "auto", tensorboard: Any = None) -> None:
        if lr is None:
            raise ValueError("DQ-SGD needs the learning rate: with horovod.tensorflow pass lr= (a number, a "
                             "callable step -> lr, or the Keras optimizer to read it from)")
        optimizer_lr = hasattr(lr, "learning_rate")
        if not callable(lr) and not optimizer_lr and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                                                      or not lr > 0):
            raise ValueError(f"lr must be a number > 0, a callable step -> lr, or an optimizer with "
                             f"`learning_rate`, got {lr!r}")
        settings = dqsgd_settings(total_steps=total_steps, lr=None if optimizer_lr else lr, error_budget=error_budget,
                                  target_bits=target_bits, b_min=b_min, b_max=b_max, decay=decay)
        self.total_steps, self.lr, self.target_bits = total_steps, lr, target_bits
        super().__init__(QuantStepDriver(bits=target_bits, dqsgd=settings, tensorboard=tensorboard, rank=hvd.rank),
                         error_feedback=error_feedback, min_compress_numel=min_compress_numel, seed=seed,
                         transport=transport, b_max=b_max)

    @property
    def policy(self) -> Any:
        return self.driver.policy

    def _lr_at(self, step: int) -> float | None:
        lr = self.lr
        if hasattr(lr, "learning_rate"):  # a Keras optimizer: its value, or its schedule at `iterations`
            value = lr.learning_rate
            if callable(value):
                value = value(lr.iterations)
            return float(np.asarray(value))
        return lr_at(lr, step, lambda: None)
