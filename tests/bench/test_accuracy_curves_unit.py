"""benchmarks/accuracy_curves.py's schedule methods (``topk:A>B@F``), parsed without Horovod."""

from __future__ import annotations

import pytest

from benchmarks.accuracy_curves import _switch


def test_a_schedule_names_its_switch_step_and_cf():
    assert _switch("topk:100>10@0.5", 560) == (280, 10.0)
    assert _switch("topk:10>100@0.25", 400) == (100, 100.0)
    assert _switch("topk:100", 560) is None and _switch("dense", 560) is None and _switch("gravac", 5) is None


@pytest.mark.parametrize("bad", ["topk:100>10", "topk:100>10@1.5", "topk:100>10@0", "topk:100>0.5@0.5"])
def test_a_bad_schedule_is_refused(bad):
    with pytest.raises(ValueError, match="topk:A>B@F"):
        _switch(bad, 100)
