"""``python -m benchmarks.netem``: the emulated network's command line (:mod:`benchmarks.netem.cli`)."""

import sys

from .cli import main

sys.exit(main())
