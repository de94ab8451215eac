"""`from crossover import AdaptiveCompression` before torch and Horovod are imported, in a real 2-rank
horovod.torch job: the object decides its framework at first use (horovod_ext/_dispatch.py) and then
behaves exactly like the horovod.torch object (same decisions, weights, parameter-name keys).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hvd_harness import run_script


def test_object_built_before_horovod_torch_is_the_torch_object_at_first_use():
    res = run_script((Path(__file__).resolve().parents[1] / "hvd_torch_import_order.py"), np=2, timeout=180)
    for r in res:
        assert r["built_before"] == "horovod_ext._dispatch", r  # nothing known yet: decided later
        assert r["late_module"] == "horovod_ext.torch_compression"
        assert r["early_impl"] == "horovod_ext.torch_compression"
        assert not r["tensorflow_imported"]
        # Horovod's parameter names reach the compression through the first call's extra frame too
        # the weight travels compressed on its own (the bias, below min_compress_numel, dense), its residual named
        assert r["early"]["residual_keys"] == ["weight"], r
        assert r["early"] == r["late"], (r["early"], r["late"])
        assert max(r["early"]["cfs"]) > 1
    assert res[0]["early"]["weights"] == res[1]["early"]["weights"]


def test_names_before_any_framework_import_nothing_and_say_how_to_choose():
    code = ("import sys\n"
            "from crossover import AdaptiveCompression, QSGDCompression\n"
            "q = QSGDCompression(4)\n"
            "assert not {'torch', 'tensorflow', 'horovod'} & set(sys.modules), sorted(sys.modules)\n"
            "try:\n"
            "    q.stats()\n"
            "except RuntimeError as exc:\n"
            "    print(type(q).__module__, '|', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    module, msg = proc.stdout.split("|", 1)
    assert module.strip() == "horovod_ext._dispatch"
    assert "crossover.tensorflow import QSGDCompression" in msg and "torch_quantization import QSGDCompression" in msg
