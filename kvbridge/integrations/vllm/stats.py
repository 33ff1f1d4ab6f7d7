"""kvbridge's connector statistics on vLLM's `/metrics`, as gauges named `kvbridge_<side>_<path>`.

Each half of the adapter snapshots its kvbridge connector's `get_stats()` (at most once per
`SNAPSHOT_INTERVAL_S`, since it may summarize history, and in every step where a request or a
transfer ended) and returns it from vLLM's `get_kv_connector_stats`; vLLM carries it to its stat
loggers, where `KVBridgePromMetrics` sets one gauge per numeric leaf: e.g. the NixlConnector
worker's `bytes_transferred` becomes `kvbridge_worker_bytes_transferred`, the offload scheduler's
`hit_blocks` `kvbridge_scheduler_hit_blocks` (a MultiConnector's children add their key to the
path). Values are the connector's running totals, so a new kvbridge statistic appears without
touching this file.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvbridge.serve.metrics import flatten_numeric

SNAPSHOT_INTERVAL_S = 1.0
# Leaves shown in vLLM's periodic "KV Transfer metrics" log line (all of them reach /metrics).
_LOGGED = ("num_transfers", "bytes_transferred", "num_failures", "num_load_errors", "hit_blocks", "stores_planned_blocks")


@dataclass
class KVBridgeStats(KVConnectorStats):
    """A snapshot: {"worker_bytes_transferred": 1.2e9, ...}. The newer snapshot wins when merged."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return KVBridgeStats(data={**self.data, **other.data})

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if k.endswith(_LOGGED)}

    def is_empty(self) -> bool:
        return not self.data


class StepTimer:
    """Time the adapter spends in vLLM's per-step connector calls, its kvbridge connector's included.

    `step()` closes a step; `summary()` gives the mean and max over the steps since the last summary,
    in microseconds, so /metrics shows what one engine step pays for the connector.
    """

    def __init__(self) -> None:
        self._current = 0.0
        self._total = 0.0
        self._max = 0.0
        self._steps = 0
        self.num_steps = 0

    @contextlib.contextmanager
    def timing(self):
        """Count the time spent inside the block toward this step."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._current += time.perf_counter() - start

    def step(self) -> None:
        self._total += self._current
        self._max = max(self._max, self._current)
        self._steps += 1
        self.num_steps += 1
        self._current = 0.0

    def summary(self) -> dict[str, float]:
        mean = self._total / self._steps if self._steps else 0.0
        out = {"step_us_mean": mean * 1e6, "step_us_max": self._max * 1e6, "steps": self.num_steps}
        self._total, self._max, self._steps = 0.0, 0.0, 0
        return out


class StatsSnapshots:
    """Rate-limited snapshots of one connector half's `get_stats()`, prefixed with the half's name."""

    def __init__(self, side: str, interval_s: float = SNAPSHOT_INTERVAL_S) -> None:
        self.side = side
        self.interval_s = interval_s
        self._last = float("-inf")

    def take(self, get_stats, *, force: bool = False) -> KVBridgeStats | None:
        """A snapshot, or None within `interval_s` of the last one unless `force`d.

        The halves force one in a step where a request or a transfer ended: vLLM stops stepping an
        idle engine, so a snapshot skipped there would leave /metrics showing a lease, a read or a
        held request that has ended, until the next request comes.
        """
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return None
        self._last = now
        return KVBridgeStats(data=flatten_numeric(get_stats(), self.side))


# Gauges live in prometheus_client's process-wide registry: made once per name, even when vLLM
# builds its stat loggers again (several engines or LLM instances in one process).
_GAUGES: dict[str, Any] = {}


class KVBridgePromMetrics(KVConnectorPromMetrics):
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx)
        if labels is None:
            return
        for key, value in transfer_stats_data.items():
            if not isinstance(value, (int, float)):
                continue
            name = f"kvbridge_{key}"
            gauge = _GAUGES.get(name)
            if gauge is None:
                gauge = _GAUGES[name] = self._gauge_cls(
                    name=name,
                    documentation=f"kvbridge connector statistic {key} (running total or current value)",
                    labelnames=self._labelnames,
                    multiprocess_mode="mostrecent",
                )
            gauge.labels(*labels).set(value)
