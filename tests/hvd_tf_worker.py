"""Rank-side entry for TensorFlow jobs (tests/tf/test_tensorflow_hvd.py): init horovod.tensorflow, run, report.

Like hvd_worker.py but without importing torch: `hvd_tf_worker.py MODULE_FILE FUNCTION JSON_ARGS`.
"""

import json
import os
import sys
from pathlib import Path


def main() -> None:
    path, name, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    import tensorflow as tf

    # 2 ranks share 2 cores: one compute thread each (Horovod's ops are asynchronous)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import horovod.tensorflow as hvd
    from hvd_harness import load_test_module

    module = load_test_module(path, "_xo_tf_test_module")
    hvd.init()
    result = getattr(module, name)(*args)
    out = Path(os.environ["CROSSOVER_RESULT_DIR"]) / f"rank{hvd.rank()}.json"
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
