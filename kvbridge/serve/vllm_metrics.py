"""The model-server metrics routers read, under vLLM's names and with vLLM's meanings.

The Gateway API Inference Extension's model-server protocol, llm-d's endpoint picker, vllm-router
and dashboards built for vLLM scrape these by name from `/metrics` (vllm/v1/metrics/loggers.py):

    vllm:num_requests_running   requests in the engine's running batch (vLLM: `len(scheduler.running)`)
    vllm:num_requests_waiting   requests admitted but not running: queued, or waiting for their KV to
                                arrive from a prefill node (vLLM counts both in its waiting queues)
    vllm:kv_cache_usage_perc    fraction of KV blocks in use, 0 to 1 (vLLM: 1 - free / total, where
                                cached blocks nobody holds count as free: they are evictable)
    vllm:cache_config_info      constant 1, labelled with the cache's config (block_size, num_gpu_blocks, ...)

Each carries vLLM's labels `model_name` (the served name) and `engine` ("0": one engine a node).
kvbridge's own series (serve/metrics.py) keep their names; these are computed at scrape time from the
same `EngineCore.get_stats()` snapshot.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

ENGINE_INDEX = "0"


class VllmMetricsCollector(Collector):
    """vLLM-named gauges from the last engine stats snapshot; nothing before the first scrape's stats."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.stats
        if not stats:
            return
        labels = ["model_name", "engine"]
        values = [self.model_name, ENGINE_INDEX]
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.", labels=labels)
        running.add_metric(values, stats.get("num_running", 0))
        yield running
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=labels)
        waiting.add_metric(values, stats.get("num_waiting", 0) + stats.get("num_waiting_for_remote_kvs", 0))
        yield waiting
        num_blocks = stats.get("num_blocks", 0)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels)
        usage.add_metric(values, stats.get("num_used_blocks", 0) / num_blocks if num_blocks else 0.0)
        yield usage
        info = {
            "block_size": str(stats.get("block_size", "")),
            "num_gpu_blocks": str(num_blocks),
            "enable_prefix_caching": str(bool(stats.get("enable_prefix_caching", False))),
            "prefix_caching_hash_algo": str(stats.get("kv_events", {}).get("prefix_caching_hash_algo", "sha256")),
            "engine": ENGINE_INDEX,
        }
        config = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info))
        config.add_metric(list(info.values()), 1)
        yield config
