"""CROSSOVER_LOG=info, the one switch that shows the library's decisions: a real 2-rank Horovod job prints, on rank
0 only, when a search begins, what it settled on and why, and the momentum cap."""

from __future__ import annotations

from hvd_harness import run_function


def logged_job(epochs):
    import io
    import logging

    from benchmarks.digits import train_digits
    from crossover import AdaptiveCompression

    handlers = [h for h in logging.getLogger("crossover").handlers if getattr(h, "_crossover", False)]
    buf = io.StringIO()
    for h in handlers:
        h.setStream(buf)
    train_digits(AdaptiveCompression(), epochs=epochs, lr=0.02, momentum=0.9)
    return {"handlers": len(handlers), "lines": buf.getvalue().splitlines()}


def test_crossover_log_shows_the_decisions_on_rank_0_only():
    r0, r1 = run_function(logged_job, args=[6], timeout=300, env={"CROSSOVER_LOG": "info"})
    assert r1["handlers"] == 0 and r0["handlers"] == 1
    text = "\n".join(r0["lines"])
    assert "momentum 0.9 caps the CF at 10" in text, text
    assert "search 1" in text and "settled on" in text and "timed in this search" in text, text
    assert all(line.startswith("crossover ") for line in r0["lines"])


def test_unset_configures_nothing():
    [r0] = run_function(logged_job, np=1, args=[1], timeout=120)
    assert r0["handlers"] == 0 and r0["lines"] == []
