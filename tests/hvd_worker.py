"""Rank-side entry of hvd_harness.run_function: init Horovod, call the function, write its result."""

import json
import sys

import horovod.torch as hvd
from hvd_harness import load_test_module, write_result


def main() -> None:
    path, name, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    module = load_test_module(path, "_xo_test_module")
    hvd.init()
    write_result(getattr(module, name)(*args))


if __name__ == "__main__":
    main()
