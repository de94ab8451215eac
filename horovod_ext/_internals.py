"""Every use of Horovod's private internals, in one place, behind a version check.

Horovod's compression hook passes a bare tensor: no parameter name, no step, no optimizer. The glue
recovers them from Horovod's calling frames, and the crossover scheduler and the Keras guard patch
Horovod's functions. All of that depends on Horovod's source, so it lives here and is checked
against the versions it was written for (`KNOWN_VERSIONS`). On another version every lookup
returns "unknown" (compression keys tensors by their position in the step, the optimizer's process
set and Adasum cannot be seen) and the patches refuse, after one clear warning.

What is touched (Horovod 0.28.1):
* horovod.torch: the frames of `_DistributedOptimizer._allreduce_grad_async(self, p)` /
  `_grouped_allreduce_grad_async` (locals `p`, `self`; `self._parameter_names`, `self.process_set`;
  `_parameter_names` with the public `param_groups` gives the parameters' registration order),
  and `_DistributedAdasumOptimizer._allreduce_grad_async` (Adasum compresses parameter deltas).
* horovod.tensorflow: the frames of `hvd.allreduce` / `grouped_allreduce` (locals `compression`, `op`)
  and of the `allreduce_fn` cond branch, plain or autograph-converted (`tf__` prefix).
* horovod.torch `_DistributedOptimizer._handles` / `_requires_update` (`torch_quiet_synchronize`: the
  optimizer's handles are waited for by polling before Horovod's own synchronize runs);
* horovod.torch.mpi_ops `synchronize`/`poll`/`_handle_map` and `_DistributedOptimizer.__init__` /
  `.synchronize` (crossover scheduler: horovod_ext/scheduling.py), horovod.tensorflow.keras
  `DistributedOptimizer` (Keras 3 guard, and the optimizer shown to our compression object:
  horovod_ext/keras_guard.py): those modules call
  `check_version(feature)` before they patch.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["KNOWN_VERSIONS", "check_version", "version_supported", "torch_hook_caller", "torch_parameter_order",
           "torch_quiet_synchronize", "torch_wait_quietly", "tf_hook_context", "ADASUM_ERROR"]

log = logging.getLogger(__name__)

KNOWN_VERSIONS = ("0.28.1",)
ADASUM_ERROR = ("crossover compression does not support op=hvd.Adasum (Adasum compresses parameter deltas, "
                "not gradients): use op=hvd.Average or hvd.Sum, or compression=hvd.Compression.none with Adasum")
_warned: set[str] = set()


def horovod_version() -> str | None:
    try:
        import horovod
    except ImportError:
        return None
    return getattr(horovod, "__version__", None)


def version_supported() -> bool:
    """Whether the installed Horovod is one whose internals this module was written against."""
    return horovod_version() in KNOWN_VERSIONS


def check_version(feature: str) -> bool:
    """True if `feature` may use Horovod's internals here; otherwise warn once, naming what is off."""
    if version_supported():
        return True
    if feature not in _warned:
        _warned.add(feature)
        log.warning("crossover: %s is turned off: it relies on internals of Horovod %s, and this is Horovod %s. "
                    "Install Horovod %s (make setup) to use it.", feature, " / ".join(KNOWN_VERSIONS),
                    horovod_version(), KNOWN_VERSIONS[-1])
    return False


# ---------------------------------------------------------------------------------------------
# horovod.torch: who is calling compress()
# ---------------------------------------------------------------------------------------------
_adasum_code: Any = None  # the code of _DistributedAdasumOptimizer._allreduce_grad_async (False: none)


def _is_adasum_frame(frame: Any) -> bool:
    global _adasum_code
    if _adasum_code is None:  # looked up once: this runs for every gradient of every step
        try:
            from horovod.torch.optimizer import _DistributedAdasumOptimizer
        except ImportError:  # pragma: no cover - Horovod without torch
            _adasum_code = False
        else:
            _adasum_code = _DistributedAdasumOptimizer._allreduce_grad_async.__code__
    return frame.f_code is _adasum_code


def torch_hook_caller(tensor: Any, depth: int = 2) -> tuple[str | None, Any]:
    """(Horovod's parameter name, the calling DistributedOptimizer) for a gradient handed to compress.

    `depth` counts frames above this function up to Horovod's (2: called from a compression
    object's `compress`). (None, None) when called from elsewhere (a direct `hvd.allreduce(...,
    compression=...)`) or on an unknown Horovod version. Raises ValueError under Adasum.
    """
    if not check_version("parameter names for compression state (tensors are keyed by position)"):
        return None, None
    import torch

    frame = sys._getframe(depth)
    param = None
    for _ in range(4):
        if frame is None:
            break
        if _is_adasum_frame(frame):
            raise ValueError(ADASUM_ERROR)
        loc = frame.f_locals
        p = loc.get("p")
        if param is None and isinstance(p, torch.Tensor) and (p.grad is tensor or loc.get("tensor") is tensor):
            param = p
        opt = loc.get("self")
        if param is not None and hasattr(opt, "_parameter_names"):
            return opt._parameter_names.get(param), opt
        frame = frame.f_back
    return None, None


def torch_process_set(opt: Any) -> Any:
    """The process set the optimizer reduces over (None: the global set, or not known)."""
    ps = getattr(opt, "process_set", None)
    if ps is None:
        return None
    try:
        from horovod.torch.mpi_ops import global_process_set
    except ImportError:  # pragma: no cover
        return None
    return None if ps is global_process_set or getattr(ps, "process_set_id", 0) == 0 else ps


# ---------------------------------------------------------------------------------------------
# horovod.tensorflow: where compress() is traced
# ---------------------------------------------------------------------------------------------
def tf_hook_context(compression: Any, depth: int = 2) -> tuple[bool, Any]:
    """(called inside Horovod's allreduce cond branch, the reduction op) for a TF compress call.

    Reads the calling frames: `hvd.allreduce` / `hvd.grouped_allreduce` hold `op` next to
    `compression`, and run inside the cond's `allreduce_fn`. Under autograph (tf.function converts
    Horovod's code) the frames live in generated files and nested helpers, hence the search.
    (False, None) on an unknown Horovod version.
    """
    if not check_version("the TensorFlow compression's view of Horovod's op and cond"):
        return False, None
    frame = sys._getframe(depth)
    op, found_op, in_cond = None, False, False
    for _ in range(48):
        if frame is None:
            break
        name = frame.f_code.co_name
        if name in ("allreduce_fn", "tf__allreduce_fn"):
            in_cond = True
            break
        if name in ("allreduce_grads", "tf__allreduce_grads"):
            break
        if not found_op:
            loc = frame.f_locals
            if loc.get("compression") is compression and "op" in loc:
                op, found_op = loc["op"], True
        frame = frame.f_back
    return in_cond, op


# ---------------------------------------------------------------------------------------------
# horovod.torch patches of the crossover scheduler (policy: horovod_ext/scheduling.py)
# ---------------------------------------------------------------------------------------------
#: modules that bind `synchronize` from horovod.torch.mpi_ops at import (0.28.1)
TORCH_SYNC_MODULES = ("horovod.torch.mpi_ops", "horovod.torch", "horovod.torch.functions", "horovod.torch.optimizer",
                      "horovod.torch.sync_batch_norm")


class TorchPatch:
    """Replaces horovod.torch's `synchronize` (wherever it was bound) and `_DistributedOptimizer.__init__` /
    `.synchronize`; `orig` keeps Horovod's own (`sync`, `poll`, `init`, `opt_sync`) for the replacements."""

    def __init__(self) -> None:
        self.orig: dict[str, Any] = {}
        self._modules: list[Any] = []

    @property
    def active(self) -> bool:
        return bool(self.orig)

    def apply(self, *, synchronize: Any, optimizer_init: Any, optimizer_synchronize: Any, feature: str) -> bool:
        """Install the replacements (idempotent); False, after one warning, on an unknown Horovod."""
        if self.orig:
            return True
        if not check_version(feature):
            return False
        import horovod.torch  # noqa: F401 - imports every module patched below
        import horovod.torch.mpi_ops as mpi_ops
        import horovod.torch.optimizer as optimizer

        cls = optimizer._DistributedOptimizer
        self.orig.update(sync=mpi_ops.synchronize, poll=mpi_ops.poll, init=cls.__init__, opt_sync=cls.synchronize)
        for name in TORCH_SYNC_MODULES:
            mod = sys.modules.get(name)
            if mod is not None and getattr(mod, "synchronize", None) is self.orig["sync"]:
                mod.synchronize = synchronize
                self._modules.append(mod)
        # DistributedOptimizer() copies _DistributedOptimizer.__dict__ into a new class at every call,
        # so optimizers built from now on get these methods.
        cls.__init__ = optimizer_init
        cls.synchronize = optimizer_synchronize
        return True

    def undo(self) -> None:
        """Put Horovod's functions back (optimizers built meanwhile keep the patched methods)."""
        if not self.orig:
            return
        import horovod.torch.optimizer as optimizer

        for mod in self._modules:
            mod.synchronize = self.orig["sync"]
        self._modules.clear()
        optimizer._DistributedOptimizer.__init__ = self.orig["init"]
        optimizer._DistributedOptimizer.synchronize = self.orig["opt_sync"]
        self.orig.clear()


def torch_handle_pending(handle: Any) -> bool:
    """Whether `handle` is a horovod.torch collective still known to Horovod (not yet synchronized)."""
    mpi_ops = sys.modules.get("horovod.torch.mpi_ops")
    return mpi_ops is not None and handle in mpi_ops._handle_map


def torch_submit_missing(opt: Any) -> None:
    """What horovod.torch 0.28.1's `synchronize()` does first: allreduce what backward did not."""
    completed: set[Any] = set()
    for key in opt._handles:
        if isinstance(key, tuple):
            completed.update(key)
        else:
            completed.add(key)
    for p in opt._requires_update - completed:
        opt._handles[p] = opt._allreduce_grad_async(p)
    for p, (handle, _ctx) in list(opt._handles.items()):
        if handle is None:
            opt._handles[p] = opt._allreduce_grad_async(p)


def torch_replace_handles(opt: Any, replace: Any) -> None:
    """`opt._handles[key] = (replace(handle), ctx)` for every handle `replace` accepts (returns non-None)."""
    for key, (handle, ctx) in list(opt._handles.items()):
        new = replace(handle)
        if new is not None:
            opt._handles[key] = (new, ctx)


def torch_named_parameters(opt: Any) -> list[tuple[str, Any]]:
    """Horovod's (name, parameter) of the optimizer's param_groups in their order (the same on every rank: the
    model's registration order); a parameter once. Empty on an unknown Horovod version."""
    names = getattr(opt, "_parameter_names", None)
    if not isinstance(names, dict) or not version_supported():
        return []
    named: dict[str, Any] = {}
    for group in getattr(opt, "param_groups", ()):
        for p in group.get("params", ()):
            name = names.get(p)
            if name is not None and name not in named:
                named[name] = p
    return list(named.items())


def torch_parameter_order(opt: Any) -> dict[str, int]:
    """Horovod's parameter name -> position of the parameter in the optimizer's param_groups."""
    return {name: i for i, (name, _) in enumerate(torch_named_parameters(opt))}


# ---------------------------------------------------------------------------------------------
# horovod.torch: waiting on an optimizer's handles without spinning
# ---------------------------------------------------------------------------------------------
#: Longest sleep between two polls of a pending handle: the most latency a quiet wait adds (seconds).
QUIET_POLL_MAX_S = 2e-4


def torch_wait_quietly(handle: Any, max_sleep: float = QUIET_POLL_MAX_S) -> None:
    """Return once the horovod.torch collective `handle` has finished, polling with sleeps (20 us, doubling
    up to `max_sleep`). Horovod's own wait spins in C++ on sched_yield: on a machine with a core per rank
    that core is then taken from Horovod's background thread and the network stack while they do the work."""
    import horovod.torch as hvd

    if hvd.poll(handle):
        return
    delay = 2e-5
    while not hvd.poll(handle):
        time.sleep(delay)
        delay = min(2 * delay, max_sleep)


def torch_quiet_synchronize(opt: Any, submitted: Callable[[], None] | None = None) -> bool:
    """Make `opt.synchronize()` (called by `step()`) wait on its allreduce handles quietly, then run Horovod's
    own synchronize (which finds them finished). `submitted` is called once every gradient of the step is handed
    to Horovod, before the first wait (the compression object starts its last collectives there). Installs on
    this optimizer only (an instance attribute that holds no reference to it); idempotent; False, after one
    warning, on an unknown Horovod version."""
    if "_crossover_quiet_sync" in vars(opt):
        return True
    if not check_version("waiting on gradients without spinning a core (Horovod's own wait is used)"):
        return False
    ref = weakref.ref(opt)

    def synchronize() -> Any:
        o = ref()
        if o is None:  # pragma: no cover - the optimizer is gone
            return None
        if o.process_set.included():
            torch_submit_missing(o)
            if submitted is not None:
                submitted()
            for handle, _ctx in list(o._handles.values()):
                if isinstance(handle, int):  # not a sparse allreduce's callable, not the scheduler's stand-in
                    torch_wait_quietly(handle)
        return type(o).synchronize(o)

    opt.synchronize = synchronize
    opt._crossover_quiet_sync = True
    return True
