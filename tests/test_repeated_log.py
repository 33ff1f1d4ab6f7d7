"""RepeatedWarnings: the first warning of a key at once, then one per window with the count folded in."""

from __future__ import annotations

import logging

from kvbridge.repeated_log import RepeatedWarnings


def test_repeats_within_the_window_are_counted_into_the_next_line(caplog):
    now = [0.0]
    warnings = RepeatedWarnings(logging.getLogger("kvbridge.test"), window_s=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvbridge.test"):
        assert warnings.warning("node-a", "node %s is down", "a")
        for _ in range(46):
            now[0] += 0.5
            assert not warnings.warning("node-a", "node %s is down", "a")
        assert warnings.warning("node-b", "node %s is down", "b")  # another key is its own
        now[0] = 31.0
        assert warnings.warning("node-a", "node %s is down", "a")
        now[0] = 70.0
        assert warnings.warning("node-a", "node %s is down", "a")  # nothing folded since: no count
    assert [r.getMessage() for r in caplog.records] == [
        "node a is down",
        "node b is down",
        "node a is down (and 46 more like it in the last 31 s)",
        "node a is down",
    ]
