"""Prometheus metrics of the P/D proxy, in their own registry, named like a node's (serve/metrics.py)
with a `kvbridge_proxy_` prefix.

The proxy counts requests, retries and fallbacks as they happen (`ProxyMetrics.*`); the per-node
figures are read from the node pools at scrape time, so they are never a second copy to keep in step:

    kvbridge_proxy_node_healthy{role,node}           1 in rotation, 0 ejected
    kvbridge_proxy_node_in_flight{role,node}         requests on the node now
    kvbridge_proxy_node_requests_total{role,node}    requests sent to it (every attempt)
    kvbridge_proxy_node_failures_total{role,node}    requests that failed on it and ejected it
    kvbridge_proxy_node_ejections_total{role,node}   times it left the rotation
    kvbridge_proxy_node_readmissions_total{role,node} times a health check brought it back
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbridge.serve.node_pool import NodeState, NodeStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LABELS = ["role", "node"]


class _NodeCollector(Collector):
    def __init__(self, snapshot: Callable[[], Sequence[NodeStats]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        nodes = self._snapshot()
        healthy = GaugeMetricFamily("kvbridge_proxy_node_healthy", "1 while the node is in rotation, 0 ejected", labels=_LABELS)
        in_flight = GaugeMetricFamily("kvbridge_proxy_node_in_flight", "Requests on the node now", labels=_LABELS)
        counters = {
            "num_requests": CounterMetricFamily("kvbridge_proxy_node_requests", "Requests sent to the node", labels=_LABELS),
            "num_failures": CounterMetricFamily(
                "kvbridge_proxy_node_failures", "Requests that failed on the node (unreachable, 5xx, silent)", labels=_LABELS
            ),
            "num_ejections": CounterMetricFamily("kvbridge_proxy_node_ejections", "Times the node was ejected", labels=_LABELS),
            "num_readmissions": CounterMetricFamily(
                "kvbridge_proxy_node_readmissions", "Times a health check brought the node back", labels=_LABELS
            ),
        }
        for node in nodes:
            labels = [node.role, node.url]
            healthy.add_metric(labels, 1.0 if node.state is NodeState.HEALTHY else 0.0)
            in_flight.add_metric(labels, node.num_in_flight)
            for name, family in counters.items():
                family.add_metric(labels, getattr(node, name))
        yield healthy
        yield in_flight
        yield from counters.values()


class ProxyMetrics:
    """Request outcomes, retries and fallbacks of the proxy, plus its nodes' figures."""

    def __init__(self, node_snapshot: Callable[[], Sequence[NodeStats]], kv_releases: Callable[[], tuple[int, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvbridge_proxy_requests", "Completion requests by outcome", ["outcome"], registry=r
        )  # outcome: ok | client_error | upstream_error | unavailable | timeout | aborted
        self.retries = Counter("kvbridge_proxy_retries", "Attempts on another node after a failure", ["leg"], registry=r)
        self.recompute_fallbacks = Counter(
            "kvbridge_proxy_recompute_fallbacks",
            "Requests sent to a decode node without KV params because no prefill node could answer",
            registry=r,
        )
        self.dispatches = Counter(
            "kvbridge_proxy_dispatches",
            "Disaggregated requests by how their two legs were sent: in_turn (the prefill's answer first) or "
            "at_once (together, the prefill offering its KV to the decode node's inbox)",
            ["mode"],
            registry=r,
        )
        self.recomputes = Counter(
            "kvbridge_proxy_recomputes",
            "Answers whose prompt the decode node computed itself instead of pulling its KV, by reason "
            "(serve/proxy_report.py: RECOMPUTE_REASONS)",
            ["reason"],
            registry=r,
        )
        r.register(_NodeCollector(node_snapshot))
        r.register(_ReleaseCollector(kv_releases))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReleaseCollector(Collector):
    def __init__(self, kv_releases: Callable[[], tuple[int, int]]) -> None:
        self._kv_releases = kv_releases

    def collect(self) -> Iterator[CounterMetricFamily]:
        released, failed = self._kv_releases()
        family = CounterMetricFamily(
            "kvbridge_proxy_kv_releases",
            "Prefill leases the proxy released after a failed decode leg, or whose offer the decode could not take",
            labels=["outcome"],
        )
        family.add_metric(["released"], released)
        family.add_metric(["failed"], failed)
        yield family
