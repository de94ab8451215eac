"""The tests, one folder a part (unit, hvd, ddp, tf, scheduler, bench, project), share the harnesses and workers that
stand here: real multi-process jobs (`hvd_harness`, `ddp_harness`, `sched_harness`) and the recorded GraVAC runs."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
