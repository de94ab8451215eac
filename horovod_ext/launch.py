"""Run a Python training script with crossover scheduling turned on.

    python -m horovod_ext.launch train.py --lr 0.1
    python -m horovod_ext.launch -m mypackage.train --lr 0.1

This is what ``crossover-run`` starts on every rank. It installs the horovod.torch patch
(:func:`horovod_ext.scheduling.install`) and then runs the script as ``python train.py`` would:
``__name__ == "__main__"``, ``sys.argv = ["train.py", ...]``, the script's folder first on
``sys.path``. ``CROSSOVER_SCHED=0`` in the environment runs the script without scheduling.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

USAGE = "usage: python -m horovod_ext.launch (SCRIPT | -m MODULE) [ARGS...]\n"


def main(argv: Sequence[str] | None = None) -> None:
    """Install crossover scheduling, then run the script or module given in ``argv``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        sys.stderr.write(USAGE)
        raise SystemExit(2 if not args or args[0] == "-m" else 0)
    if os.environ.get("CROSSOVER_SCHED", "1").strip().lower() not in ("0", "off", "false", "no"):
        from horovod_ext import scheduling

        scheduling.install(force=True)
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    script = args[0]
    if not os.path.isfile(script):
        sys.stderr.write(f"crossover launch: no such script: {script}\n")
        raise SystemExit(2)
    sys.argv = [script, *args[1:]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
