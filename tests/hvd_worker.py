"""Rank-side entry of hvd_harness.run_function: init Horovod, call the function, write its result."""

import importlib.util
import json
import sys
from pathlib import Path

import horovod.torch as hvd
from hvd_harness import write_result


def main() -> None:
    path, name, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    sys.path.insert(0, str(Path(path).resolve().parent))  # its folder: it may import a sibling test module
    spec = importlib.util.spec_from_file_location("_xo_test_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hvd.init()
    write_result(getattr(module, name)(*args))


if __name__ == "__main__":
    main()
