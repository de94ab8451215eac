"""GraVAC compression-factor policy (Tyagi and Swany, IEEE CLOUD 2023, arXiv 2305.12201), one idea per module.

Imports run one way: ``types`` (Plan, StepStats, checks) and ``tunables`` <- ``gains`` (gain definitions and
their smoothing) <- ``paper`` (the paper's search) and ``ladder`` / ``ladder_state`` (the default search) <-
``policy`` (GravacPolicy: settings, warm-up, delegation, saved state). See docs/gravac.md.
"""

from crossover.adaptive.gravac.gains import GAINS
from crossover.adaptive.gravac.paper import SCALINGS
from crossover.adaptive.gravac.policy import SEARCHES, GravacPolicy
from crossover.adaptive.gravac.types import Plan, StepStats

__all__ = ["GAINS", "SCALINGS", "SEARCHES", "GravacPolicy", "Plan", "StepStats"]
