"""Every tunable number of the GraVAC policy, each with the one-line reason for its value.

The measurements behind them are in docs/gravac-tunables.md and the run histories under reports/history/.
Change one here, run ``tests/unit/test_gravac_replay.py`` (it then fails: regenerate the recordings with
``python tests/gravac_recordings.py`` and say in the commit which decisions changed and why), and re-run the
benchmark matrix (reports/benchmarks-tta.md).
"""

from __future__ import annotations

# ---------------------------------------------------------------- settings' defaults (GravacPolicy(...))
#: Lowest compressed CF: the paper's CF_min; top-k 10x kept dense's accuracy on every workload measured.
CF_MIN = 10.0
#: Highest CF: top-k 1000x lost accuracy on 4 of 6 workloads, a cost step times cannot show. Under an optimizer of
#: momentum m the ladder stops at CF_MAX x (1 - m) (ladder.momentum_cap; docs/accuracy.md).
CF_MAX = 100.0
#: Gain a CF needs to be sent: the delivered gain is ~1 for a CF that keeps up; 0.5 rejects one delivering under half.
EPSILON = 0.5
#: Relative tolerance between compression throughputs: 0.1 is above the step-time noise of a shared machine.
OMEGA = 0.1
#: Weight of the newest step in the gain EWMAs: about a 10-step memory.
EWMA_ALPHA = 0.1
#: Ladder: ratio between neighbouring CFs (dense, 10, 100): a rung is worth a trial only if it differs tenfold.
CF_STEP = 10.0
#: Ladder: a settled CF's median step time that moves by more than this re-opens the search.
REOPEN_DRIFT = 0.25

# ---------------------------------------------------------------- windows
#: ``window="auto"``: a window is this fraction of the steps observed so far: short runs adapt early.
AUTO_WINDOW_FRACTION = 0.02
#: ... at least this many steps: a median of fewer cannot be trusted.
AUTO_WINDOW_MIN = 4
#: ... at most this many: long runs still re-judge within a few hundred steps.
AUTO_WINDOW_MAX = 500

# ---------------------------------------------------------------- ladder: timing a trial
#: Steps at the start of a trial that are not timed: a CF switch renegotiates the collectives (1.2x-1.5x).
SWITCH_SKIP = 1
#: ... at the start of the run's first trial: the process's own warm-up (memory, first negotiations).
FIRST_TRIAL_SKIP = 3
#: A step over this many times the median of its window's faster half is a pause (evaluation, checkpoint).
PAUSE_FACTOR = 2.0
#: A walk up from a settled CF times each higher CF for at least this many steps: a short median lies.
WALK_UP_STEPS = 12
#: A lower CF is skipped when predicted this many times beyond omega's allowance (slow rungs are costly), and a trial
#: ends after two timed steps this far behind (2.2x): two steps that slow after the switch step are no accident.
SKIP_MARGIN = 2.0
#: ... and after its switch step alone when this far behind (3.3x at omega 0.1): SKIP_MARGIN times the costliest switch
#: (1.5x); dense under the momentum cap at 300 Mbit/s steps 4.2x-4.6x a CF-10 step (each such step costs 3 more).
SWITCH_MARGIN = 3.0
#: ... dense only beyond this: the 1 / CF extrapolation overrates dense's time (no compression cost).
DENSE_MARGIN = 4.0

# ---------------------------------------------------------------- ladder: dense against cf_min
#: Dense and cf_min within (1 + omega) ** TIE_BAND are a near-tie, decided on pooled alternating windows.
TIE_BAND = 3
#: A near-tie is decided once each side has this many timed steps, when they are apart by (1 + omega) ** 2.
TIE_EARLY = 10
#: ... else at this many: 4-step windows could not tell steps 12 % apart on a busy machine.
TIE_STEPS = 16
#: Each alternating window of a near-tie is at least this long.
TIE_WINDOW = 6

# ---------------------------------------------------------------- ladder: settled
#: Step-time drift is judged on the median of at least this many steps: 20-step medians already move 25 %.
DRIFT_MIN_STEPS = 20
#: A drift re-open that settles back where it was multiplies the wait before the next by this (else 2):
#: false alarms then cost O(log steps) searches.
FALSE_ALARM_GROWTH = 4
