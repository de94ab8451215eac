r"""DQ-SGD bit-width policy (Yan, Huang, Lan, Song, arXiv 2107.14575), as derived in docs/dqsgd.md.

Pure Python, standard library only: plain numbers in, a bit width out. The policy never touches a
tensor; the caller quantizes (``crossover.compression.quantize``), measures and reports *global*
numbers, so every rank fed the same observations in the same order plans the same bits (like
``gravac.py``). Per step::

    plan = policy.plan()                       # BitsPlan(bits, levels) for the coming step
    ...quantize with plan.levels (s = 2**(bits-1) - 1) into plan.bits-bit codes...
    policy.observe(DqsgdStats(grad_sq_norm=..., numel=..., lr=..., step=t, total_steps=T))

The plan for step t uses the observation of step t-1 (the norm of the gradient about to be
quantized is not known on every rank before it is sent; it rides in the payload of step t-1).

Derivation (the closed form is ours, from the bound the paper states; the paper body was not
available to check it). The bound has the form

    E_T <= decay^T e_0 + sum_t decay^(T-1-t) eta_t^2 (sigma^2 + q(s_t) ||g_t||^2)

with the variance of the stochastic quantizer with s levels bounded by
``q(s) <= min(d / s^2, sqrt(d) / s)`` (d elements). Only the quantization term depends on the bits:
``Q = sum_t w_t q(s_t)`` with weights ``w_t = decay^(T-1-t) eta_t^2 ||g_t||^2``. Minimise the bits
sent, ``sum_t b_t`` (times d), subject to ``Q <= error_budget`` (= epsilon).

On either branch of the bound q is a power law, ``q(s) = c s^-k`` (c = d, k = 2 on d/s^2; c = sqrt(d),
k = 1 on sqrt(d)/s), and with ``s ~= 2^(b-1)`` (one sign bit), ``q = c 2^(-k (b-1))``. The Lagrangian
``sum_t b_t + lambda (sum_t w_t q(s_t) - epsilon)`` is stationary where
``1 = lambda k ln2 w_t q(s_t)`` for every t: every step's term ``w_t q(s_t)`` is the same, and the
budget being spent, each equals ``epsilon / T``. This equal split needs no future information, so
it can be applied online, step by step:

    choose s_t with  w_t q(s_t) = epsilon / T,  i.e.  q(s_t) = 2^(-L_t),
    L_t = log2(T / epsilon) + log2 ||g_t||^2 + 2 log2 eta_t + (T-1-t) log2 decay.

* d/s^2 branch: ``s_t = sqrt(d 2^L_t)``, so with ``b = 1 + log2 s``:
  ``b_t = b0 + log2 ||g_t|| + log2 eta_t + ((T-1-t)/2) log2 decay`` with ``b0 = 1 + 1/2 log2(d T / epsilon)``
  (the form in REFERENCE.md section 5).
* sqrt(d)/s branch: ``s_t = sqrt(d) 2^L_t``, so every coefficient doubles:
  ``b_t = b0' + 2 log2 ||g_t|| + 2 log2 eta_t + (T-1-t) log2 decay`` with ``b0' = 1 + 1/2 log2 d + log2(T / epsilon)``.
* ``min`` (the default, the tightest): the smallest s meeting the target on either branch,
  ``s_t = sqrt(d) 2^min(L_t, L_t / 2)``. The sqrt(d)/s branch is the one that applies while
  ``s_t < sqrt(d)``, i.e. always for tensors larger than ``s_max^2`` (16 129 elements at 8 bits).

Terms: b0 sets the overall level from the budget (more elements d or steps T, or a smaller
epsilon, mean more bits); ``log2 ||g_t||``: a large gradient carries a large absolute quantization
error, so it gets more bits; ``log2 eta_t``: the error enters the iterate scaled by the step size, so
a decaying learning rate lowers the bits; ``((T-1-t)/2) log2 decay`` (< 0 before the end): an error
made early is contracted by decay at every later step, so early steps get fewer bits and the bits
grow toward the end of training.

Integer decision: the levels a b-bit code holds are ``s = 2^(b-1) - 1`` (``b = ceil(log2(s + 1)) + 1``),
so the plan is the smallest b with ``2^(b-1) - 1 >= s_t``, ``b_t = ceil(1 + log2(1 + s_t))``, clamped to
[b_min, b_max]; a zero gradient gets b_min. Rounding up keeps every unclamped step within its share
epsilon / T. Clamping at b_min spends less than the share (the bits cannot go lower), clamping at
b_max spends more (``summary()['budget_spent']`` tracks the bound's quantization term as it is spent,
with the bits actually used). The equal split is exactly optimal for the continuous relaxation on
one branch; with integer bits it is within one bit per step of the optimum (checked against a brute
force in tests/unit/test_dqsgd_policy.py).

Inputs, as the caller must compute them (plain numbers, identical on every rank):
``grad_sq_norm``: the squared norm that multiplies q(s) in the variance of the update applied: for a
summed update the sum over ranks (and tensors) of ``||g_r||^2`` (with error feedback, of gradient +
residual, i.e. of what is quantized); for an update averaged over n ranks the same sum divided by
n^2 (each rank quantizes independently, so variances add). ``numel``: d, elements each rank
quantizes per step (using the total over tensors in q is conservative when each tensor has its own
scale). ``lr``: eta_t. Optional ``step`` (index of the observed step; default: the previous + 1) and
``total_steps`` (updates the horizon T). Bad values (not finite, negative norm, non-positive lr or
numel) are ignored identically on every rank, as in gravac.py: the step still advances and the plan
keeps the last good numbers; ``summary()['ignored']`` counts them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from crossover.adaptive._state import Restorable, check_saved_state
from crossover.compression.wire import MAX_BITS, MIN_BITS, levels_for_bits

__all__ = [
    "VARIANCE_BOUNDS",
    "BitsPlan",
    "DqsgdPolicy",
    "DqsgdStats",
    "error_budget_for_bits",
    "quantization_variance",
    "target_levels",
]

#: Names accepted for ``variance_bound``: which bound q(s) on the quantizer variance the policy uses.
VARIANCE_BOUNDS = ("min", "d/s^2", "sqrt(d)/s")

_STATE_VERSION = 1
_TOL = 1e-9  # slack before rounding up, so a target that is exactly a level count is not pushed up


def quantization_variance(s: float, numel: int, variance_bound: str = "min") -> float:
    """The bound q(s) on E||Q(g) - g||^2 / ||g||^2: min(d/s^2, sqrt(d)/s), or one of its branches."""
    d = float(numel)
    if variance_bound == "d/s^2":
        return d / (s * s)
    if variance_bound == "sqrt(d)/s":
        return math.sqrt(d) / s
    return min(d / (s * s), math.sqrt(d) / s)


def _log2_target(log2_weight: float, numel: int, total_steps: int, error_budget: float,
                 variance_bound: str) -> float:
    """log2 of the level count s that makes w * q(s) = error_budget / T, from log2 w."""
    big_l = math.log2(total_steps / error_budget) + log2_weight
    half_log_d = 0.5 * math.log2(numel)
    if variance_bound == "d/s^2":
        return half_log_d + 0.5 * big_l
    if variance_bound == "sqrt(d)/s":
        return half_log_d + big_l
    return half_log_d + min(big_l, 0.5 * big_l)


def target_levels(*, grad_sq_norm: float, numel: int, lr: float, step: int, total_steps: int, decay: float,
                  error_budget: float, variance_bound: str = "min") -> float:
    """The continuous level count s_t with w_t q(s_t) = error_budget / T (0.0 for a zero gradient).

    w_t = decay^(T-1-t) lr^2 grad_sq_norm; a step at or past the horizon counts as the last one.
    Returns ``math.inf`` when s_t overflows a float. The continuous bits are 1 + log2(s_t).
    """
    if grad_sq_norm == 0.0:
        return 0.0
    t = min(step, total_steps - 1)
    log2_w = (total_steps - 1 - t) * math.log2(decay) + 2.0 * math.log2(lr) + math.log2(grad_sq_norm)
    e = _log2_target(log2_w, numel, total_steps, error_budget, variance_bound)
    return math.inf if e > 1000.0 else 2.0**e


def _unclamped_bits(s_target: float) -> int:
    """Smallest b >= 1 with 2**(b-1) - 1 >= s_target (1025 for an infinite target)."""
    if not s_target > 0.0:
        return 1
    if math.isinf(s_target):
        return 1025
    return max(1, math.ceil(1.0 + math.log2(1.0 + s_target) - _TOL))


def _bits_for_target(s_target: float, b_min: int, b_max: int) -> int:
    """Smallest b in [b_min, b_max] with 2**(b-1) - 1 >= s_target (b_max if none)."""
    return max(b_min, min(b_max, _unclamped_bits(s_target)))


def error_budget_for_bits(bits: int, *, grad_sq_norm: float, numel: int, lr: float, total_steps: int,
                          variance_bound: str = "min") -> float:
    """The error_budget that makes the last step (t = T-1) plan exactly ``bits`` for these numbers.

    A way to calibrate: give typical end-of-training values of the norm and the learning rate; the
    bits then fall toward the start of training by the decay term. epsilon = T lr^2 ||g||^2 q(s(bits)).
    """
    s = levels_for_bits(bits)
    return total_steps * lr * lr * grad_sq_norm * quantization_variance(s, numel, variance_bound)


@dataclass(frozen=True)
class BitsPlan:
    """Bits per element for one step, identical on every rank fed the same observations.

    ``bits``: b in [b_min, b_max] (one sign bit + b-1 magnitude bits).
    ``levels``: s = 2**(bits-1) - 1, the magnitude levels of the quantizer (1 at 2 bits: ternary).
    """

    bits: int
    levels: int


@dataclass(frozen=True)
class DqsgdStats:
    """Global numbers of one step, identical on every rank (the caller reduces them).

    ``grad_sq_norm``: squared norm multiplying q(s) in the update's quantization variance (see the
    module docstring: summed over ranks, divided by n^2 for an average over n ranks).
    ``numel``: d, elements quantized per rank per step. ``lr``: learning rate eta of that step.
    ``step``: index of that step (None: the previous observation's + 1, the first being 0).
    ``total_steps``: the horizon T, if it changed (None: keep the current one).
    ``bits``: bits actually sent on that step, for budget accounting (None: the policy's plan).
    """

    grad_sq_norm: float
    numel: int
    lr: float
    step: int | None = None
    total_steps: int | None = None
    bits: int | None = None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class DqsgdPolicy(Restorable):
    """DQ-SGD bit widths as a deterministic state machine (see the module docstring for the rule).

    Keyword-only parameters:
      total_steps: horizon T, int >= 1 (training steps; a step past it plans like the last one).
      error_budget: epsilon > 0, the bound's quantization term allowed over the whole run, in units of
        lr^2 * grad_sq_norm (squared parameter distance); see :func:`error_budget_for_bits`.
      b_min: fewest bits, int >= 2 (a sign bit and one magnitude bit: ternary), default 2.
      b_max: most bits, int in [b_min, 8], default 8: codes then fit one uint8 and 127 levels keep
        the relative error of a large gradient small; more bits would not halve the bytes of fp16.
      decay: contraction factor per step of the bound, in (0, 1), default 0.999: an error made k
        steps before the end is weighted decay^k (for strongly convex f about 1 - mu * lr). Each
        bit of the ramp toward the end spans 1/|log2 decay| steps (693 at 0.999) on the sqrt(d)/s
        branch, twice that on d/s^2.
      variance_bound: "min" (default, the tightest bound) or one of its branches "d/s^2" (the closed
        form of REFERENCE.md) or "sqrt(d)/s"; both branches alone over-estimate q, so they spend
        more bits than needed but keep the budget.
      ewma_alpha: weight of the newest grad_sq_norm in an exponential moving average, in (0, 1];
        default 1.0 = no smoothing (the last step's norm is the best one-step-ahead estimate, and the
        bits may change every step); lower values trade responsiveness for steadier bits.
      initial_bits: bits of the steps planned before any valid observation, in [b_min, b_max]
        (default b_max: nothing is known, so be safe).
    """

    def __init__(
        self,
        *,
        total_steps: int,
        error_budget: float,
        b_min: int = MIN_BITS,
        b_max: int = MAX_BITS,
        decay: float = 0.999,
        variance_bound: str = "min",
        ewma_alpha: float = 1.0,
        initial_bits: int | None = None,
    ) -> None:
        if not _is_int(total_steps) or total_steps < 1:
            raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
        if not _is_real(error_budget) or error_budget <= 0:
            raise ValueError(f"error_budget must be a finite number > 0, got {error_budget!r}")
        if not _is_int(b_min) or not MIN_BITS <= b_min <= MAX_BITS:
            raise ValueError(f"b_min must be an int in [{MIN_BITS}, {MAX_BITS}], got {b_min!r}")
        if not _is_int(b_max) or not MIN_BITS <= b_max <= MAX_BITS:
            raise ValueError(f"b_max must be an int in [{MIN_BITS}, {MAX_BITS}], got {b_max!r}")
        if b_min > b_max:
            raise ValueError(f"b_min must be <= b_max, got b_min={b_min!r} b_max={b_max!r}")
        if not _is_real(decay) or not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}")
        if variance_bound not in VARIANCE_BOUNDS:
            raise ValueError(f"variance_bound must be one of {', '.join(VARIANCE_BOUNDS)}; got {variance_bound!r}")
        if not _is_real(ewma_alpha) or not 0.0 < ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha!r}")
        if initial_bits is not None and (not _is_int(initial_bits) or not b_min <= initial_bits <= b_max):
            raise ValueError(f"initial_bits must be None or an int in [b_min, b_max] = [{b_min}, {b_max}], "
                             f"got {initial_bits!r}")
        self._T0 = total_steps
        self._eps = float(error_budget)
        self._b_min = b_min
        self._b_max = b_max
        self._decay = float(decay)
        self._bound = variance_bound
        self._alpha = float(ewma_alpha)
        self._initial = initial_bits
        self._reset_state()

    def _reset_state(self) -> None:
        self._T = self._T0
        self._next_step = 0  # index of the step the next plan is for
        self._sq_norm: float | None = None  # EWMA of grad_sq_norm (None before a valid observation)
        self._lr: float | None = None
        self._numel: int | None = None
        self._observations = 0
        self._ignored = 0
        self._spent = 0.0  # the bound's quantization term so far, with the bits actually used

    # ------------------------------------------------------------------ decisions
    def target_levels(self) -> float | None:
        """Continuous level count s* behind the next plan (None before a valid observation)."""
        if self._sq_norm is None:
            return None
        return target_levels(grad_sq_norm=self._sq_norm, numel=self._numel, lr=self._lr, step=self._next_step,
                             total_steps=self._T, decay=self._decay, error_budget=self._eps,
                             variance_bound=self._bound)

    def plan(self) -> BitsPlan:
        """Bits for the next step; pure (no side effects), the same result until observe()."""
        s_target = self.target_levels()
        if s_target is None:
            bits = self._b_max if self._initial is None else self._initial
        else:
            bits = _bits_for_target(s_target, self._b_min, self._b_max)
        return BitsPlan(bits=bits, levels=levels_for_bits(bits))

    # ------------------------------------------------------------------ observations
    def observe(self, stats: DqsgdStats) -> None:
        """Feed the global numbers of one step, in step order (identically on every rank)."""
        step = stats.step if _is_int(stats.step) and stats.step >= 0 else None
        horizon = stats.total_steps if _is_int(stats.total_steps) and stats.total_steps >= 1 else None
        used = stats.bits if _is_int(stats.bits) and MIN_BITS <= stats.bits <= MAX_BITS else None
        g, lr, d = stats.grad_sq_norm, stats.lr, stats.numel
        valid = (_is_real(g) and g >= 0 and _is_real(lr) and lr > 0 and _is_int(d) and d >= 1
                 and (stats.step is None or step is not None)
                 and (stats.total_steps is None or horizon is not None)
                 and (stats.bits is None or used is not None))
        t = self._next_step if step is None else step
        if not valid:
            self._ignored += 1
            self._next_step = t + 1
            return
        if used is None:
            used = self.plan().bits
        if horizon is not None:
            self._T = horizon
        g, lr = float(g), float(lr)
        self._spent += self._term(g, d, lr, t, used)
        self._sq_norm = g if self._sq_norm is None else self._sq_norm + self._alpha * (g - self._sq_norm)
        self._lr = lr
        self._numel = d
        self._observations += 1
        self._next_step = t + 1

    def _term(self, g: float, d: int, lr: float, t: int, bits: int) -> float:
        """decay^(T-1-t) lr^2 g q(s(bits)): this step's share of the bound's quantization term."""
        if g == 0.0:
            return 0.0
        k = max(0, self._T - 1 - t)
        log2_w = k * math.log2(self._decay) + 2.0 * math.log2(lr) + math.log2(g)
        q = quantization_variance(levels_for_bits(bits), d, self._bound)
        return 2.0 ** min(1000.0, log2_w + math.log2(q))

    # ------------------------------------------------------------------ telemetry
    @property
    def step(self) -> int:
        """Index of the step the next plan() is for (0 before any observation)."""
        return self._next_step

    @property
    def total_steps(self) -> int:
        """Current horizon T (the constructor's, or the last observed ``total_steps``)."""
        return self._T

    @property
    def bits(self) -> int:
        """Bits of the next plan."""
        return self.plan().bits

    @property
    def config(self) -> dict[str, Any]:
        """Constructor arguments, as plain values."""
        return {
            "total_steps": self._T0,
            "error_budget": self._eps,
            "b_min": self._b_min,
            "b_max": self._b_max,
            "decay": self._decay,
            "variance_bound": self._bound,
            "ewma_alpha": self._alpha,
            "initial_bits": self._initial,
        }

    def summary(self) -> dict[str, Any]:
        """Read-only snapshot for telemetry (plain values)."""
        plan = self.plan()
        s_target = self.target_levels()
        continuous = None if s_target is None or s_target == 0.0 else 1.0 + math.log2(s_target)
        return {
            "step": self._next_step,
            "total_steps": self._T,
            "bits": plan.bits,
            "levels": plan.levels,
            "target_levels": s_target,
            "continuous_bits": continuous,
            "clamped": s_target is not None and plan.bits != _unclamped_bits(s_target),
            **self._observed(),
            "error_budget": self._eps,
            "budget_per_step": self._eps / self._T,
        }

    # ------------------------------------------------------------------ checkpointing
    def _observed(self) -> dict[str, Any]:
        """What the observations so far set: the fields both summary() and state_dict() report."""
        return {"grad_sq_norm": self._sq_norm, "lr": self._lr, "numel": self._numel,
                "observations": self._observations, "ignored": self._ignored, "budget_spent": self._spent}

    def state_dict(self) -> dict[str, Any]:
        """Full state as JSON-serialisable plain values."""
        return {
            "version": _STATE_VERSION,
            "config": self.config,
            "total_steps": self._T,
            "next_step": self._next_step,
            **self._observed(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the saved config must equal this policy's config. Every field is
        checked first (present, of its type, in its range): ValueError naming it, and nothing changed."""
        if not isinstance(state, Mapping):
            raise ValueError(f"DqsgdPolicy state must be a mapping, got {type(state).__name__}")
        check_saved_state("DqsgdPolicy", state, _STATE_VERSION, self.config)
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise ValueError(f"DqsgdPolicy state: missing field(s) {', '.join(missing)}")

        def count(name: str, lo: int) -> int:
            v = state[name]
            if not _is_int(v) or v < lo:
                raise ValueError(f"DqsgdPolicy state: {name} must be an int >= {lo}, got {v!r}")
            return int(v)

        def real(name: str, ok: Any, want: str) -> float | None:
            v = state[name]
            if v is None:
                return None
            if not _is_real(v) or not ok(v):
                raise ValueError(f"DqsgdPolicy state: {name} must be None or {want}, got {v!r}")
            return float(v)

        total, next_step = count("total_steps", 1), count("next_step", 0)
        observations, ignored = count("observations", 0), count("ignored", 0)
        sq_norm = real("grad_sq_norm", lambda v: v >= 0, "a finite number >= 0")
        lr = real("lr", lambda v: v > 0, "a finite number > 0")
        numel = None if state["numel"] is None else count("numel", 1)
        spent = real("budget_spent", lambda v: v >= 0, "a finite number >= 0")
        if spent is None:
            raise ValueError("DqsgdPolicy state: budget_spent must be a finite number >= 0, got None")
        if (sq_norm is None) != (lr is None) or (sq_norm is None) != (numel is None):
            raise ValueError("DqsgdPolicy state: grad_sq_norm, lr and numel are all None (nothing observed yet) or "
                             f"all set; got {sq_norm!r}, {lr!r}, {numel!r}")
        # checked: apply
        self._T, self._next_step = total, next_step
        self._sq_norm, self._lr, self._numel = sq_norm, lr, numel
        self._observations, self._ignored, self._spent = observations, ignored, spent

    def __repr__(self) -> str:
        return f"DqsgdPolicy(step={self._next_step}, total_steps={self._T}, bits={self.plan().bits})"
