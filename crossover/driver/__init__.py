"""The step driver: what an adaptive compression does per step that is not moving tensors.

Above both the policies (``crossover/adaptive/``) and the codecs (``crossover/compression/``), below the
framework glue (``horovod_ext/``, ``crossover/ddp/``): plans, one-step-late observation, byte counters, the CSV
log, saved state. ``sparse.py`` drives compression-factor policies, ``quant.py`` bit-width ones.
"""

from crossover.driver.quant import QuantStepDriver
from crossover.driver.settings import (
    DQSGD_PARAMS,
    UNKNOWN_MOMENTUM,
    check_min_numel,
    check_momentum,
    dqsgd_settings,
    gravac_or_dense,
    keras_optimizer_momentum,
    lr_at,
    optimizer_momentum,
    reported_momentum,
)
from crossover.driver.sparse import CfPolicy, SparseStepDriver, StepRecord
from crossover.driver.steplog import StepLog
from crossover.driver.transport import (
    ALLTOALL_DEFAULT_TRANSPORT,
    DEFAULT_TRANSPORT,
    TRANSPORTS,
    check_transport,
)

__all__ = ["ALLTOALL_DEFAULT_TRANSPORT", "DEFAULT_TRANSPORT", "DQSGD_PARAMS", "TRANSPORTS", "UNKNOWN_MOMENTUM",
           "CfPolicy", "QuantStepDriver", "SparseStepDriver", "StepLog", "StepRecord",
           "check_min_numel", "check_momentum", "check_transport", "dqsgd_settings", "gravac_or_dense",
           "keras_optimizer_momentum", "lr_at", "optimizer_momentum", "reported_momentum"]
