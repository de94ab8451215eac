"""The cost model: ring collectives' bytes and rounds, every transport from 2 to 1 024 workers, the choice rule and
the table generator (agreement with what the codec hands over: tests/unit/test_agreed_transport.py)."""

from __future__ import annotations

import math

import pytest

from crossover.compression import cost_model as cm
from crossover.driver.transport import choose_transport

WORLDS = [2 ** i for i in range(1, 11)]


def test_ring_collectives():
    assert cm.ring_allreduce(1000, 2) == cm.Cost(1000.0, 2.0)
    assert cm.ring_allreduce(1000, 8) == cm.Cost(1750.0, 14.0)
    assert cm.ring_allgather(100, 8) == cm.Cost(700.0, 7.0)
    assert cm.ring_allreduce(1000, 1).bytes == 0.0
    both = cm.ring_allreduce(1000, 4) + cm.ring_allgather(10, 4)
    assert (both.bytes, both.rounds, both.collectives) == (1500.0 + 30.0, 6.0 + 3.0, 2)
    link = cm.Link(alpha_s=1e-4, rate_bps=8e6)  # 1 MB/s
    assert math.isclose(cm.ring_allreduce(1e6, 2).time_s(link), 2 * 1e-4 + 1.0)


def test_compat_helpers_keep_their_values():
    assert cm.allreduce_bytes(1000, 2) == 4000.0
    assert cm.allgather_bytes(10, 3) == 160.0
    assert cm.allreduce_bytes(100, 4, width=2) == 300.0


@pytest.mark.parametrize("kind", cm.MODELLED)
def test_every_transport_is_modelled_from_2_to_1024_workers(kind):
    n, k = 1_000_000, 10_000
    for w in WORLDS:
        c = cm.transport_cost(kind, n, k, w)
        assert c.bytes > 0 and c.rounds > 0 and math.isfinite(c.time_s(cm.Link(5e-5, 1e9)))


def test_growth_with_workers():
    n, k = 25_600_000, 256_000
    grow = {kind: cm.transport_cost(kind, n, k, 1024).bytes / cm.transport_cost(kind, n, k, 2).bytes
            for kind in cm.MODELLED}
    for flat in (cm.DENSE, cm.FP16, cm.ALLREDUCE, cm.AGREED, cm.OKTOPK, cm.POWERSGD):
        assert grow[flat] <= 2.0, (flat, grow[flat])
    assert grow[cm.ALLGATHER] > 1000  # (W-1) k pairs: linear in W
    assert 9 < grow[cm.GTOPK] < 11  # log2 W
    # 2 -> 8 workers: the ring's 1.75x, the allgather's 7x
    assert cm.transport_cost(cm.AGREED, n, k, 8).bytes / cm.transport_cost(cm.AGREED, n, k, 2).bytes < 1.76
    assert cm.transport_cost(cm.ALLGATHER, n, k, 8).bytes / cm.transport_cost(cm.ALLGATHER, n, k, 2).bytes > 6.9


def test_agreed_sends_fewer_bytes_than_the_allgather_at_every_world_size():
    for w in WORLDS:
        for k in (30, 100, 10_000):  # (a handful of values sends less than the set's 8 check floats)
            agreed = cm.transport_cost(cm.AGREED, 10 ** 6, k, w).bytes
            assert agreed < cm.transport_cost(cm.ALLGATHER, 10 ** 6, k, w).bytes


def test_latency_terms():
    # a ring allreduce has 2 (W-1) rounds: at 1 024 workers and 50 us that alone is about 0.1 s
    c = cm.transport_cost(cm.ALLREDUCE, 10 ** 6, 10, 1024)
    assert c.rounds == 2 * 1023
    assert c.time_s(cm.Link(50e-6, 1e12)) == pytest.approx(0.1023, rel=1e-3)
    assert cm.transport_cost(cm.AGREED, 10 ** 6, 10, 1024).rounds == 2 * 1023 + 1023


def test_choose_transport():
    assert choose_transport(1000, 1000, 2, False) == cm.DENSE
    assert choose_transport(1000, 10, 2, True) == cm.ALLREDUCE
    assert choose_transport(1000, 10, 2, False) == cm.ALLGATHER
    assert choose_transport(1000, 10, 2, False, asked=cm.AGREED) == cm.AGREED
    assert choose_transport(1000, 10, 2, True, asked=cm.AGREED) == cm.ALLREDUCE  # shared indices: always allreduce
    assert choose_transport(1000, 200, 8, False) == cm.DENSE  # the allgather would send more than dense
    assert choose_transport(1000, 200, 8, False, asked=cm.AGREED) == cm.AGREED  # ... the agreed set does not
    assert choose_transport(1000, 998, 8, False, asked=cm.AGREED) == cm.DENSE  # k + check floats > n
    with pytest.raises(ValueError):
        choose_transport(0, 1, 2, False)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown transport"):
        cm.transport_cost("carrier-pigeon", 10, 1, 2)
    with pytest.raises(ValueError, match="world_size"):
        cm.transport_cost(cm.DENSE, 10, 1, 0)
    with pytest.raises(ValueError):
        cm.Link(alpha_s=-1.0, rate_bps=1e9)
    with pytest.raises(ValueError):
        cm.Link(alpha_s=0.0, rate_bps=0.0)


def test_cost_table_writes_a_table_and_a_plot(tmp_path):
    from benchmarks import cost_table

    out, png = tmp_path / "cost.md", tmp_path / "cost.png"
    assert cost_table.main(["--params", "1e6", "--cf", "100", "--out", str(out), "--png", str(png)]) == 0
    text = out.read_text()
    assert "| transport | 2 | 4 | 8 |" in text and "agreed top-k" in text and "1024 |" in text
    assert png.stat().st_size > 10_000
