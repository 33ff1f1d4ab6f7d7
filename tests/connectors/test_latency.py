"""Latency summaries shared by the connectors' stats."""

from __future__ import annotations

import pytest

from kvbridge.connectors.latency import LatencyStats, percentiles_ms


def test_percentiles_interpolate_and_are_in_milliseconds():
    assert percentiles_ms([0.001, 0.002, 0.003, 0.004], (50, 100)) == pytest.approx([2.5, 4.0])
    assert percentiles_ms([], (50, 99)) == [0.0, 0.0]


def test_latency_stats_keep_a_window_but_count_everything():
    stats = LatencyStats(window=3)
    assert stats.summary() == {"count": 0}
    for seconds in (0.010, 0.001, 0.002, 0.003):
        stats.add(seconds)
    summary = stats.summary()
    assert summary["count"] == 4 and summary["mean_ms"] == pytest.approx(4.0)
    assert summary["p50_ms"] == pytest.approx(2.0) and summary["max_ms"] == pytest.approx(3.0)  # 10 ms left the window
