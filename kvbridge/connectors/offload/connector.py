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

from typing import TYPE_CHECKING, Any

from kvbridge.config import KVTransferConfig
from kvbridge.connectors.base import (
    ConnectorContext,
    FinishedTransfers,
    FinishResult,
    FlushResult,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    MatchResult,
)
from kvbridge.connectors.offload.config import OffloadConfig, block_nbytes_of
from kvbridge.connectors.offload.metadata import OffloadMetadata
from kvbridge.connectors.offload.scheduler import OffloadScheduler

if TYPE_CHECKING:
    import torch

    from kvbridge.connectors.offload.worker import OffloadWorker
    from kvbridge.engine.outputs import KVConnectorOutput, SchedulerOutput
    from kvbridge.engine.request import Request
    from kvbridge.layout import KVCacheLayout


class OffloadingConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext) -> None:
        super().__init__(config, role, context)
        self.offload_config = OffloadConfig.from_extra(config.extra)
        self.scheduler: OffloadScheduler | None = None
        self.worker: OffloadWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            layout = getattr(context, "layout", None)
            self.scheduler = OffloadScheduler(self.offload_config, context.block_size, block_nbytes_of(layout))
        else:
            from kvbridge.connectors.offload.worker import OffloadWorker  # imports torch

            self.worker = OffloadWorker(self.offload_config, context.model_id, config.flush_timeout_s)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: list[int]) -> FinishResult:
        return self.scheduler.request_finished(request, block_ids)

    def has_pending_transfers(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_transfers()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        self.worker.register_kv_caches(kv_cache, layout)

    def _meta(self) -> OffloadMetadata | None:
        meta = self.get_connector_metadata()
        return meta if isinstance(meta, OffloadMetadata) else None

    def start_load_kv(self) -> None:
        self.worker.start_load_kv(self._meta())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> FinishedTransfers:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def flush(self, timeout_s: float) -> FlushResult:
        return self.worker.flush(timeout_s) if self.worker is not None else FlushResult(True)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # ------------------------------------------------------------------ either side

    def get_stats(self) -> dict[str, Any]:
        half = self.scheduler if self.scheduler is not None else self.worker
        return half.get_stats()

    def check_integrity(self) -> None:
        """Tier invariants (free + used == capacity, pins, visibility); raises AssertionError."""
        (self.scheduler if self.scheduler is not None else self.worker).check_integrity()
