"""`SplitConnector`: a connector whose two halves are two plain objects.

Most connectors keep their scheduler half (bookkeeping) and worker half (bytes) in separate
classes that share nothing. This base builds the one `role` asks for and routes the connector
API to it, so a connector is its two halves plus two factory methods:

    class MyConnector(SplitConnector):
        metadata_type = MyMetadata
        def make_scheduler_half(self): return MyScheduler(self.config, self.context)
        def make_worker_half(self): return MyWorker(self.config, self.context)

The scheduler half is a `SchedulerHalf`, the worker half a `WorkerHalf` (both declared in
`base.py`, with the contract). The worker half gets this step's plan as an argument of
`start_load_kv(metadata)` / `wait_for_save(metadata)`: None when the step carried none of
`metadata_type`. Calling a method of the half this instance is not is a RuntimeError.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from kvbridge.connectors.base import (
    CompletedTransfers,
    ConnectorContext,
    ConnectorRequest,
    FlushReport,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVHandoff,
    MatchResult,
    SchedulerHalf,
    SchedulerOutput,
    WorkerHalf,
)

if TYPE_CHECKING:
    import torch

    from kvbridge.config import KVTransferConfig
    from kvbridge.layout import KVCacheLayout


class SplitConnector(KVConnectorBase):
    metadata_type: ClassVar[type[KVConnectorMetadata]] = KVConnectorMetadata

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, context: ConnectorContext) -> None:
        super().__init__(config, role, context)
        self._scheduler_half: SchedulerHalf | None = None
        self._worker_half: WorkerHalf | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler_half = self.make_scheduler_half()
        else:
            self._worker_half = self.make_worker_half()

    @abstractmethod
    def make_scheduler_half(self) -> SchedulerHalf:
        """Build the scheduler half (no torch, no I/O). Called once, for role SCHEDULER."""

    @abstractmethod
    def make_worker_half(self) -> WorkerHalf:
        """Build the worker half. Called once, for role WORKER."""

    @property
    def scheduler(self) -> SchedulerHalf:
        if self._scheduler_half is None:
            raise RuntimeError(f"a scheduler-side method was called on {type(self).__name__}'s worker half")
        return self._scheduler_half

    @property
    def worker(self) -> WorkerHalf:
        if self._worker_half is None:
            raise RuntimeError(f"a worker-side method was called on {type(self).__name__}'s scheduler half")
        return self._worker_half

    @property
    def half(self) -> SchedulerHalf | WorkerHalf:
        """Whichever half this instance is."""
        return self._scheduler_half if self._scheduler_half is not None else self._worker_half

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> MatchResult:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def external_source(self, request_id: str) -> str:
        source = getattr(self.scheduler, "external_source", None)  # optional for a scheduler half
        return source(request_id) if source is not None else super().external_source(request_id)

    def take_refusal(self, request_id: str) -> str | None:
        take = getattr(self.scheduler, "take_refusal", None)  # optional for a scheduler half
        return take(request_id) if take is not None else None

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(output)

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> KVHandoff:
        return self.scheduler.request_finished(request, block_ids)

    def has_pending_transfers(self) -> bool:
        return self._scheduler_half is not None and self._scheduler_half.has_pending_transfers()

    # ------------------------------------------------------------------ worker side

    def _step_metadata(self) -> KVConnectorMetadata | None:
        meta = self.get_connector_metadata()
        return meta if isinstance(meta, self.metadata_type) else None

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        self.worker.register_kv_caches(kv_cache, layout)

    def start_load_kv(self) -> None:
        self.worker.start_load_kv(self._step_metadata())

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._step_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> CompletedTransfers:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_landed_recving(self) -> set[str]:
        get = getattr(self.worker, "get_landed_recving", None)  # optional for a worker half
        return get() if get is not None else set()

    def get_load_errors(self) -> dict[str, str]:
        get = getattr(self.worker, "get_load_errors", None)  # optional for a worker half
        return get() if get is not None else {}

    def get_step_stats(self) -> dict[str, Any]:
        step_stats = getattr(self.worker, "get_step_stats", None)  # optional for worker halves
        return step_stats() if step_stats is not None else {}

    def encode_metadata(self, metadata: KVConnectorMetadata) -> bytes:
        return msgspec.msgpack.encode(metadata)

    def decode_metadata(self, data: bytes) -> KVConnectorMetadata:
        return msgspec.msgpack.decode(data, type=self.metadata_type)

    def tp_rank_info(self) -> bytes:
        info = getattr(self.worker, "tp_rank_info", None)  # the TP hooks are optional for a worker half
        return info() if info is not None else b""

    def set_tp_rank_infos(self, infos: list[bytes]) -> None:
        if (apply := getattr(self.worker, "set_tp_rank_infos", None)) is not None:
            apply(infos)

    def tp_step_report(self) -> bytes:
        report = getattr(self.worker, "tp_step_report", None)
        return report() if report is not None else b""

    def apply_tp_step_reports(self, reports: list[bytes]) -> None:
        if (apply := getattr(self.worker, "apply_tp_step_reports", None)) is not None:
            apply(reports)

    def flush(self, timeout_s: float) -> FlushReport:
        return self._worker_half.flush(timeout_s) if self._worker_half is not None else FlushReport(True)

    def shutdown(self) -> None:
        if self._worker_half is not None:
            self._worker_half.shutdown()
        elif (close := getattr(self._scheduler_half, "shutdown", None)) is not None:  # optional: a half with sockets
            close()

    # ------------------------------------------------------------------ either side

    def get_stats(self) -> dict[str, Any]:
        return self.half.get_stats()

    def check_integrity(self) -> None:
        check = getattr(self.half, "check_integrity", None)  # optional for either half
        if check is not None:
            check()
