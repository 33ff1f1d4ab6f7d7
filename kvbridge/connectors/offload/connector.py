"""OffloadingConnector: keeps KV blocks evicted from the GPU in host memory (and optionally on
disk) and loads them back on a prefix hit instead of recomputing them.

    LLM(..., kv_transfer_config={"connector": "OffloadingConnector",
                                 "extra": {"host_num_blocks": 4096, "eviction_policy": "arc"}})

The scheduler-side instance (`OffloadScheduler`, pure bookkeeping) owns the tier indexes and plans
every copy; the worker-side instance (`OffloadWorker`) owns the host pool, the copy engine and the
disk files and executes the plan. They talk only through `OffloadMetadata` and the step's
`KVConnectorOutput`. Options: see `config.py`; design and numbers: docs/offload.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbridge.connectors.offload.config import OffloadConfig, block_nbytes_of
from kvbridge.connectors.offload.metadata import OffloadMetadata
from kvbridge.connectors.offload.scheduler import OffloadScheduler
from kvbridge.connectors.split import SplitConnector

if TYPE_CHECKING:
    from kvbridge.config import KVTransferConfig
    from kvbridge.connectors.base import ConnectorContext, KVConnectorRole
    from kvbridge.connectors.offload.worker import OffloadWorker


class OffloadingConnector(SplitConnector):
    metadata_type = OffloadMetadata
    REQUIRED_MODULES = ("xxhash",)  # digests of the blocks each tier holds

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext) -> None:
        self.offload_config = OffloadConfig.from_extra(config.extra)
        super().__init__(config, role, context)

    @classmethod
    def binds_side_channel(cls, config: KVTransferConfig) -> bool:
        return False  # host and disk tiers are local

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        OffloadConfig.from_extra(config.extra)
        super().check_config(config)

    def make_scheduler_half(self) -> OffloadScheduler:
        layout = getattr(self.context, "layout", None)
        return OffloadScheduler(self.offload_config, self.context.block_size, block_nbytes_of(layout))

    def make_worker_half(self) -> OffloadWorker:
        from kvbridge.connectors.offload.worker import OffloadWorker  # imports torch

        return OffloadWorker(
            self.offload_config, self.context.model_id, self.config.flush_timeout_s, wake=self.context.wakeup.ring
        )
