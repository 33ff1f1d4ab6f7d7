"""NixlConnector: P/D disaggregation, decode pulls the prompt's KV from prefill over NIXL.

Configure with `KVTransferConfig(connector="NixlConnector", role="kv_producer" | "kv_consumer" |
"kv_both", side_channel_host=..., side_channel_port=..., extra={...NixlOptions...})`. The halves
live in scheduler.py (bookkeeping) and worker.py (bytes); this class routes the connector API to
the half that `role` built. NIXL picks the transport through UCX (NVLink/cuda_ipc, RDMA, shared
memory, TCP); on ROCm the `nixl` package brings RIXL (nixl_rocm) and the same code path runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
from kvbridge.connectors.nixl.options import NixlOptions
from kvbridge.connectors.nixl.scheduler import NixlScheduler
from kvbridge.connectors.nixl.worker import NixlWorker

if TYPE_CHECKING:
    import torch

    from kvbridge.config import KVTransferConfig
    from kvbridge.engine.outputs import KVConnectorOutput, SchedulerOutput
    from kvbridge.engine.request import Request
    from kvbridge.layout import KVCacheLayout


class NixlConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext) -> None:
        super().__init__(config, role, context)
        self.options = NixlOptions.from_extra(config.extra)
        self._scheduler: NixlScheduler | None = None
        self._worker: NixlWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = NixlScheduler(config, context.block_size, self.options.lease_s)
        else:
            self._worker = NixlWorker(config, context, self.options)

    @property
    def scheduler(self) -> NixlScheduler:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on the NixlConnector's worker half")
        return self._scheduler

    @property
    def worker(self) -> NixlWorker:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on the NixlConnector's scheduler half")
        return self._worker

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
        return self.scheduler.has_pending_transfers()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        self.worker.register_kv_caches(kv_cache, layout)

    def start_load_kv(self) -> None:
        self.worker.start_load_kv(self.get_connector_metadata())

    def wait_for_save(self) -> None:
        pass  # prefill never writes: the decode side reads the blocks while they are leased

    def get_finished(self, finished_req_ids: set[str]) -> FinishedTransfers:
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def flush(self, timeout_s: float) -> FlushResult:
        return self.worker.flush(timeout_s) if self._worker is not None else FlushResult(True)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def get_stats(self) -> dict[str, Any]:
        return self._worker.get_stats() if self._worker is not None else self.scheduler.get_stats()
