"""crossover for horovod.tensorflow: `from crossover.tensorflow import AdaptiveCompression`.

    import horovod.tensorflow as hvd
    tape = hvd.DistributedGradientTape(tape, compression=AdaptiveCompression())

Keras: `horovod.tensorflow.keras.DistributedOptimizer` only synchronizes tf-keras (Keras 2)
optimizers. With TensorFlow >= 2.16, `tf.keras` is Keras 3 unless `TF_USE_LEGACY_KERAS=1` is set
(with the `tf-keras` package installed), and Horovod's wrapper then silently skips the allreduce.
Importing this module makes `horovod.tensorflow.keras.DistributedOptimizer` refuse a Keras 3
optimizer with a clear error; `check_keras_optimizer(opt)` does the same check on its own.
Nothing here imports torch. See docs/tensorflow.md.
"""

from __future__ import annotations

import logging

from horovod_ext.keras_guard import KERAS3_MESSAGE, KerasVersionError, check_keras_optimizer, install_keras_guard
from horovod_ext.tf_compression import AdaptiveCompression, FP16Compression, GravacCompression, StaticCompression
from horovod_ext.tf_quantization import DqsgdCompression, QSGDCompression

__all__ = ["AdaptiveCompression", "DqsgdCompression", "FP16Compression", "GravacCompression", "KERAS3_MESSAGE",
           "KerasVersionError", "QSGDCompression", "StaticCompression", "check_keras_optimizer", "install_keras_guard"]

log = logging.getLogger(__name__)

install_keras_guard()
