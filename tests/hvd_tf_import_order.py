"""A horovod.tensorflow script that imports crossover first (tests/tf/test_tensorflow_usage.py).

`from crossover import ...` comes before `import horovod.tensorflow`, and one object ("early") is even
built before it: every object must end up a horovod.tensorflow one, torch must never be imported, and
the reduced gradients must be right (eager and in a tf.function). Reports with a JSON file per rank.
"""

import json
import os
import sys
from pathlib import Path

from crossover import AdaptiveCompression, FP16Compression, QSGDCompression  # before horovod.tensorflow

early = AdaptiveCompression("topk", cf_min=2, cf_max=4, epsilon=0.5, min_compress_numel=1024)

import horovod.tensorflow as hvd  # noqa: E402 - the import order is what this script tests
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

N = 50_000


def _module_of(obj) -> str:
    """The module of the framework object behind crossover's wrappers (lazy object, facade)."""
    while "_impl" in getattr(obj, "__dict__", {}):
        obj = obj.__dict__["_impl"]
    return type(obj).__module__


def main() -> None:
    hvd.init()
    late = AdaptiveCompression("topk", cf_min=2, cf_max=4, epsilon=0.5, min_compress_numel=1024)
    fp16 = FP16Compression()
    qsgd = QSGDCompression(8)
    w = tf.Variable(tf.zeros([N]))

    def reduce(comp, g, traced):
        def grad(gt):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(w * gt)
            return hvd.DistributedGradientTape(tape, compression=comp).gradient(loss, [w])[0]

        return (tf.function(grad) if traced else grad)(tf.constant(g)).numpy()

    errors, early_cfs = {}, []
    step_fn = {}
    for step in range(6):
        gs = [np.random.default_rng(1000 * r + step).standard_normal(N).astype(np.float32) for r in range(hvd.size())]
        g = gs[hvd.rank()]
        for name, comp, dense in (("fp16", fp16, True), ("late", late, False), ("qsgd", qsgd, True)):
            out = reduce(comp, g, traced=False)
            if dense:  # the max abs error against the average
                errors[f"{name}_{step}"] = float(np.max(np.abs(out - np.mean(gs, 0))))
            else:  # sparse: the sum over ranks is conserved only with error feedback; check finiteness
                errors[f"{name}_{step}"] = 0.0 if np.all(np.isfinite(out)) else 1.0
        if "early" not in step_fn:
            def early_step(gt):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(w * gt)
                return hvd.DistributedGradientTape(tape, compression=early).gradient(loss, [w])[0]

            step_fn["early"] = tf.function(early_step)
        out = step_fn["early"](tf.constant(g)).numpy()
        errors[f"early_{step}"] = 0.0 if np.all(np.isfinite(out)) else 1.0
        early_cfs.append(early.stats()["compression_factor"])
    result = {"torch_imported": "torch" in sys.modules,
              "modules": {"early": _module_of(early), "late": _module_of(late), "qsgd": _module_of(qsgd)},
              "errors": errors, "early_stats": {k: v for k, v in early.stats().items()
                                               if not k.startswith("policy/")},
              "early_cfs": early_cfs}
    out = Path(os.environ["CROSSOVER_RESULT_DIR"]) / f"rank{hvd.rank()}.json"
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
