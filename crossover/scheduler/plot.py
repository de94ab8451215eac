"""A PNG of the crossover turns: per device, one lane per job, compute and communication side by side.

Drawn from the workers' telemetry (:mod:`crossover.scheduler.telemetry`) by ``crossover-run --plot`` and
``crossover-bench --crossover``. Each lane shows, for one job on one device, when it computed (it held the
device), when it waited on communication (device given back) and when it waited for its turn; blocks wide
enough are labelled in place. The window covers a few steps after the first ones (start-up is not
representative). matplotlib is imported here only (Agg backend: no display needed).
"""

from __future__ import annotations

import statistics
from typing import IO, Any

from crossover.scheduler.telemetry import Interval, Stream, merge_intervals

__all__ = ["plot_timeline", "pick_window", "STATES"]

# state -> (legend text, colour, hatch, in-block label); drawn in this order, the last on top
STATES = {
    "wait_comm": ("communicating (device given back)", "#f28e2b", None, "comm"),
    "wait_device": ("waiting for its turn", "#d9d9d9", "///", "wait"),
    "compute": ("computing (holds the device)", "#4e79a7", None, "compute"),
}
MAX_PANELS = 4  # devices drawn at most (the ones shared by the most jobs): more would not be readable
LABEL_CHAR_FRACTION = 0.0072  # share of the window one 7-point character takes on the 10-inch figure: labels that fit


def pick_window(streams: list[Stream], skip_steps: int = 3, steps: int = 6) -> tuple[float, float]:
    """A window of about ``steps`` step periods of the slowest job, after its first ``skip_steps`` steps (the
    whole run when it is shorter)."""
    spans = [t for s in streams for ivs in s.spans.values() for iv in ivs for t in iv]
    if not spans:
        return 0.0, 1.0
    lo, hi = min(spans), max(spans)
    periods, starts = [], []
    for s in streams:
        times = [st["t"] for st in s.steps]
        if len(times) > 1:
            periods.append(statistics.median(b - a for a, b in zip(times, times[1:])))
        if len(times) > skip_steps:
            starts.append(times[skip_steps])
    if not periods:
        return lo, hi
    t0 = max(starts) if starts else lo
    t1 = min(hi, t0 + steps * max(periods))
    if t1 - t0 < 0.25 * (hi - lo) and hi - lo <= steps * max(periods) * 2:
        return lo, hi  # a short run: show it whole
    return t0, max(t1, t0 + 1e-3)


def _lanes(streams: list[Stream]) -> list[tuple[str, list[tuple[str, dict[str, list[Interval]]]]]]:
    """[(device, [(job, {state: merged intervals})])], devices shared by the most jobs first."""
    devices: dict[str, dict[str, dict[str, list[Interval]]]] = {}
    for s in streams:
        per_job = devices.setdefault(s.device_key, {})
        states = per_job.setdefault(s.job, {name: [] for name in STATES})
        for name in STATES:
            states[name] += s.spans.get(name, [])
    out = []
    for dev, jobs in sorted(devices.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:MAX_PANELS]:
        out.append((dev, [(job, {n: merge_intervals(iv) for n, iv in st.items()}) for job, st in sorted(jobs.items())]))
    return out


def plot_timeline(streams: list[Stream], out: str | IO[bytes], *, window: tuple[float, float] | None = None,
                  title: str | None = None, dpi: int = 110) -> dict[str, Any]:
    """Draw the turns of ``streams`` into the PNG ``out`` (a path or a binary file); returns what was drawn
    (``window``, ``devices``, ``jobs``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0, t1 = window or pick_window(streams)
    width = t1 - t0
    scale, unit = (1e3, "ms") if width < 2.0 else (1.0, "s")
    panels = _lanes(streams)
    rows = sum(len(jobs) for _, jobs in panels)
    fig, axes = plt.subplots(len(panels) or 1, 1, squeeze=False, sharex=True,
                             figsize=(10, 1.3 + 0.62 * rows + 0.45 * len(panels)))
    for ax, (dev, jobs) in zip(axes[:, 0], panels):
        for i, (_, states) in enumerate(reversed(jobs)):
            for name, (_text, colour, hatch, label) in STATES.items():
                bars = [(max(a, t0), min(b, t1)) for a, b in states[name] if b > t0 and a < t1]
                if not bars:
                    continue
                ax.broken_barh([((a - t0) * scale, (b - a) * scale) for a, b in bars], (i - 0.36, 0.72),
                               facecolors=colour, edgecolors="white" if hatch is None else "#9a9a9a",
                               linewidth=0.6, hatch=hatch)
                for a, b in bars:
                    if b - a >= (len(label) + 2) * LABEL_CHAR_FRACTION * width:
                        ax.text(((a + b) / 2 - t0) * scale, i, label, ha="center", va="center", fontsize=7,
                                color="white" if name == "compute" else "black", clip_on=True)
        ax.set_yticks(range(len(jobs)))
        ax.set_yticklabels([job for job, _ in reversed(jobs)], fontsize=9)
        ax.set_ylim(-0.6, len(jobs) - 0.4)
        ax.set_title(f"device {dev}", fontsize=9, loc="left")
        ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    last = axes[-1, 0]
    last.set_xlim(0, width * scale)
    last.set_xlabel(f"time ({unit}; 0 = {_clock(t0)}). Blank: outside a training step (start-up, data loading, "
                    f"evaluation)", fontsize=8)
    handles = [Patch(facecolor=c, edgecolor="#9a9a9a" if h else c, hatch=h, label=text)
               for text, c, h, _ in (STATES[n] for n in ("compute", "wait_comm", "wait_device"))]
    height = fig.get_figheight()
    fig.suptitle(title or "crossover turns: while one job communicates, another computes on the device",
                 fontsize=10, y=1 - 0.08 / height, va="top")
    fig.legend(handles=handles, loc="upper center", ncol=3, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.36 / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.56 / height))
    fig.savefig(out, dpi=dpi, format="png")
    plt.close(fig)
    return {"window": [t0, t1], "devices": [d for d, _ in panels], "jobs": sorted({s.job for s in streams})}


def _clock(t: float) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"
