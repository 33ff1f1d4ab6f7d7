"""Latency percentiles for connector stats: the one way kvbridge summarises durations.

Percentiles interpolate linearly between samples (numpy's default), over a window of the most
recent samples, and are reported in milliseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np


def percentiles_ms(seconds: Iterable[float], percents: Sequence[float]) -> list[float]:
    """The `percents` percentiles of `seconds`, in milliseconds; zeros when there is no sample."""
    samples = np.fromiter(seconds, dtype=np.float64)
    if len(samples) == 0:
        return [0.0] * len(percents)
    return (np.percentile(samples, percents) * 1e3).tolist()


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
        p50, p99 = percentiles_ms(self._samples, (50, 99))
        return {
            "count": self.count,
            "mean_ms": 1e3 * self.total_s / self.count,
            "p50_ms": p50,
            "p99_ms": p99,
            "max_ms": 1e3 * max(self._samples),
        }
