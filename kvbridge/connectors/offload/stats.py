"""Small latency summaries for connector stats. Pure Python."""

from __future__ import annotations

import statistics
from collections import deque


class LatencyStats:
    """Keeps the last `window` samples (seconds) and summarises them in milliseconds."""

    def __init__(self, window: int = 1024) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self.count = 0
        self.total_s = 0.0

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self.count += 1
        self.total_s += seconds

    def summary(self) -> dict[str, float]:
        if not self._samples:
            return {"count": 0}
        ordered = sorted(self._samples)
        return {
            "count": self.count,
            "mean_ms": 1e3 * self.total_s / self.count,
            "p50_ms": 1e3 * statistics.median(ordered),
            "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "max_ms": 1e3 * ordered[-1],
        }
