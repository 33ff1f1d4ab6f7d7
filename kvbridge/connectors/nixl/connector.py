"""NixlConnector: P/D disaggregation, decode pulls the prompt's KV from prefill over NIXL.

Configure with `KVTransferConfig(connector="NixlConnector", role="kv_producer" | "kv_consumer" |
"kv_both", side_channel_host=..., side_channel_port=..., extra={...NixlOptions...})`. The halves
live in scheduler.py (bookkeeping) and worker.py (bytes). NIXL picks the transport through UCX
(NVLink/cuda_ipc, RDMA, shared memory, TCP); on ROCm the `nixl` package brings RIXL (nixl_rocm)
and the same code path runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbridge.connectors.nixl.metadata import NixlConnectorMetadata
from kvbridge.connectors.nixl.options import NixlOptions
from kvbridge.connectors.nixl.scheduler import NixlScheduler
from kvbridge.connectors.nixl.worker import NixlWorker
from kvbridge.connectors.split import SplitConnector
from kvbridge.transfer.auth import check_exposure
from kvbridge.transfer.host_secret import side_channel_secret
from kvbridge.transfer.offers import OfferInbox, OfferOutbox

if TYPE_CHECKING:
    from kvbridge.config import KVTransferConfig
    from kvbridge.connectors.base import ConnectorContext, KVConnectorRole


class NixlConnector(SplitConnector):
    metadata_type = NixlConnectorMetadata
    supports_tensor_parallel = True  # every rank reads / digests its own heads; rank 0 holds the node's leases
    REQUIRED_MODULES = ("zmq", "msgspec", "xxhash")  # side channel, wire structs, host-memory digests

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext) -> None:
        self.options = NixlOptions.from_extra(config.extra)
        super().__init__(config, role, context)

    @classmethod
    def binds_side_channel(cls, config: KVTransferConfig) -> bool:
        return config.is_producer  # a decode node (kv_consumer) connects to its peers' side channels

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        NixlOptions.from_extra(config.extra)
        super().check_config(config)

    def has_tp_step_report(self, metadata: NixlConnectorMetadata | None) -> bool:
        """Only a step granting leases has news for rank 0 (each rank's digests of its heads, worker.py)."""
        return metadata is not None and bool(metadata.leases)

    def make_scheduler_half(self) -> NixlScheduler:
        opts, config = self.options, self.config
        secret = side_channel_secret(opts.insecure_side_channel)  # the worker's endpoint resolves the same one
        inbox = outbox = None
        if config.is_consumer and opts.handoff_inbox:
            check_exposure(config.side_channel_host, secret, opts.insecure_side_channel)
            inbox = OfferInbox(
                config.side_channel_host, opts.handoff_inbox_port, config.engine_id, self.context.incarnation, secret,
                keep_s=opts.handoff_wait_s,
            )
        if config.is_producer:
            outbox = OfferOutbox(secret)
        return NixlScheduler(
            config, self.context.block_size, opts.lease_s, self.context.incarnation, opts.peer_policy, secret,
            unreachable_cooldown_s=opts.unreachable_peer_cooldown_s, sync_ipc_reads=opts.sync_ipc_reads,
            inbox=inbox, outbox=outbox, handoff_wait_s=opts.handoff_wait_s, idle_step_wait_s=opts.idle_step_wait_s,
        )

    def make_worker_half(self) -> NixlWorker:
        return NixlWorker(self.config, self.context, self.options)
