"""Prometheus metrics of one node server, in their own registry (several servers may share a process).

The API handlers (serve/api.py) call `observe_*` as requests arrive and finish; `GET /metrics`
calls `set_engine_stats(await engine.call(get_stats))` and then `render()`. Engine and connector
statistics are whatever numeric leaves `EngineCore.get_stats()` returns, flattened into gauges
named `kvbridge_engine_<path>` (e.g. `{"connector": {"bytes_transferred": 5}}` becomes
`kvbridge_engine_connector_bytes_transferred 5.0`), so a new connector statistic appears without
touching this file. The `vllm:*` series routers read by name come from the same snapshot
(serve/vllm_metrics.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbridge.serve.vllm_metrics import VllmMetricsCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_NAME_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def flatten_numeric(stats: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts, keyed by their '_'-joined, Prometheus-safe path.

    Booleans become 0/1; strings, lists, None and non-finite numbers are skipped.
    """
    flat: dict[str, float] = {}
    if isinstance(stats, dict):
        for key, value in stats.items():
            name = _NAME_BAD_CHARS.sub("_", str(key))
            flat.update(flatten_numeric(value, f"{prefix}_{name}" if prefix else name))
    elif isinstance(stats, (bool, int, float)) and prefix:
        value = float(stats)
        if math.isfinite(value):
            flat[prefix] = value
    return flat


class _EngineStatsCollector(Collector):
    """Exposes the last `get_stats()` snapshot as gauges, at scrape time."""

    def __init__(self) -> None:
        self.snapshot: dict[str, float] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, value in sorted(self.snapshot.items()):
            yield GaugeMetricFamily(f"kvbridge_engine_{name}", f"EngineCore.get_stats()['{name}']", value=value)


class ServerMetrics:
    """Request counters, token counters, latency histograms and engine-stat gauges of one node."""

    def __init__(self, role: str, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.info = Gauge("kvbridge_node_info", "Constant 1, labelled with the node's role", ["role"], registry=r)
        self.info.labels(role=role).set(1)
        self.requests = Counter(
            "kvbridge_requests", "Completion requests by outcome", ["outcome"], registry=r
        )  # outcome: ok | bad_request | aborted | error
        self.prompt_tokens = Counter("kvbridge_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvbridge_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("kvbridge_cached_prompt_tokens", "Prompt tokens from the prefix cache", registry=r)
        self.external_tokens = Counter(
            "kvbridge_external_prompt_tokens", "Prompt tokens loaded through the KV connector", registry=r
        )
        self.running = Gauge("kvbridge_requests_running", "Requests in flight on this node", registry=r)
        self.pd_refused = Counter(
            "kvbridge_pd_admissions_refused", "do_remote_decode requests refused at once (HTTP 429) by the lease "
            "quota, by scope: client, total (serve/lease_quota.py)", ["scope"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "kvbridge_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "kvbridge_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self._engine_stats = _EngineStatsCollector()
        r.register(self._engine_stats)
        self._vllm = VllmMetricsCollector(model_name)  # vllm:* series that routers read by name
        r.register(self._vllm)

    def observe_finished(self, outcome: str, prompt_tokens: int, generated: int, cached: int, external: int) -> None:
        self.requests.labels(outcome=outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.cached_tokens.inc(cached)
        self.external_tokens.inc(external)

    def observe_rejected(self, outcome: str = "bad_request") -> None:
        self.requests.labels(outcome=outcome).inc()

    def set_engine_stats(self, stats: dict[str, Any]) -> None:
        self._engine_stats.snapshot = flatten_numeric(stats)
        self._vllm.stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
