"""What crosses vLLM's process boundaries for the adapter: kvbridge's objects in vLLM's types.

* `KVBridgeMetadata`: the kvbridge connector's per-step plan, scheduler -> worker.
* `KVBridgeWorkerMeta`: what the worker half tells its scheduler half each step (kvbridge's
  `get_step_stats`, e.g. the side-channel port it bound), worker -> scheduler.
* `KVBridgeHandshake`: sent once at start-up, worker -> scheduler, through vLLM's handshake
  metadata: the worker's engine incarnation (kvbridge's halves must agree on it: it names every
  lease the scheduler grants and every handshake the worker answers), its first step stats and
  the KV layout it read from vLLM's tensors (only the worker sees them).

vLLM moves these between its own processes (in one process on CPU); nothing here is read from
the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvbridge.connectors.base import KVConnectorMetadata as KVBridgeConnectorMetadata


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    inner: KVBridgeConnectorMetadata | None


@dataclass
class KVBridgeWorkerMeta(KVConnectorWorkerMetadata):
    stats: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.stats)
        merged.update(getattr(other, "stats", {}))
        return KVBridgeWorkerMeta(merged)


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    incarnation: str
    step_stats: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)  # the worker's KVCacheLayout fields, as it read them from vLLM
