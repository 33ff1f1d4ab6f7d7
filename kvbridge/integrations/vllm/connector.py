"""`KVBridgeConnector`: any kvbridge connector, loaded into an unmodified vLLM (0.25 on CUDA, 0.32 on CPU) as a V1 KV connector.

vLLM's defaults work: 0.25's V2 model runner (each layer's KV allocated alone) as well as its V1 runner.

    vllm ... --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"connector": "NixlConnector"}}'

vLLM builds one instance per role, like kvbridge's own engine: the scheduler instance wraps a
`SchedulerSide` (bookkeeping, `scheduler_side.py`), the worker instance a `WorkerSide` (bytes,
`worker_side.py`); this class only routes vLLM's calls to the half it is. The halves meet twice
outside vLLM's per-step metadata: at start-up, when vLLM hands the worker's handshake metadata
(kvbridge's engine incarnation, the side-channel port) to the scheduler, and before a prefix-cache
reset, when the scheduler drains the worker (`drain_before_reset`). docs/vllm.md has the mapping
between vLLM's and kvbridge's concepts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvbridge import env
from kvbridge.integrations.vllm.config import AdapterConfig
from kvbridge.integrations.vllm.identity import vllm_extra_keys_fn
from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.metadata import KVBridgeHandshake, KVBridgeMetadata
from kvbridge.integrations.vllm.scheduler_side import SchedulerSide
from kvbridge.integrations.vllm.stats import KVBridgePromMetrics, KVBridgeStats
from kvbridge.integrations.vllm.worker_side import WorkerSide, local_worker

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """kvbridge's log records go where vLLM's go (vLLM configures only its own logger)."""
    ours, theirs = logging.getLogger("kvbridge"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(env.log_level_override() or theirs.level or logging.INFO)
        ours.propagate = False


class KVBridgeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        self.setup = AdapterConfig.from_vllm(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._is_cpu = str(vllm_config.device_config.device).startswith("cpu")
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.setup, vllm_extra_keys_fn())
        else:
            device = str(vllm_config.device_config.device)
            if device == "cuda":
                import torch

                device = f"cuda:{torch.cuda.current_device()}"
            self._worker = WorkerSide(self.setup, vllm_config, kv_cache_config, device)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """On CUDA, NHD: its cross-layer allocation (V1 model runner) is kvbridge's block-major layout (HND's
        interleaves layers inside a page and is refused); per-layer allocations (V2 model runner) are read in
        either layout. vLLM's own override (VLLM_KV_CACHE_LAYOUT) still wins."""
        return None if str(vllm_config.device_config.device).startswith("cpu") else "NHD"

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """Ask vLLM for one allocation holding every layer, blocks outermost (kvbridge's block-major layout:
        one descriptor per run of blocks). vLLM 0.25's V1 model runner honours it on CUDA; its V2 runner (the
        default) allocates each layer alone, which the adapter registers as one region per layer (one
        descriptor per run of blocks per layer)."""
        return not self._is_cpu

    # ------------------------------------------------------------------ worker side

    @property
    def worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on KVBridgeConnector's scheduler instance")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
        self.worker.register_cross_layers_kv_cache(kv_cache, attn_backend)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind(connector_metadata if isinstance(connector_metadata, KVBridgeMetadata) else None)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker.clear()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self.worker.worker_meta()

    def get_handshake_metadata(self) -> KVBridgeHandshake | None:
        return self._worker.handshake() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ------------------------------------------------------------------ scheduler side

    @property
    def scheduler(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on KVBridgeConnector's worker instance")
        return self._scheduler

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._scheduler is None:
            return
        tp_size = self.setup.tp_size
        ours = {rank: m for rank, m in metadata.items() if isinstance(m, KVBridgeHandshake)}
        if sorted(ours) != list(range(tp_size)):
            raise ConfigError(
                "KVBridgeConnector: expected start-up metadata from one kvbridge worker per tensor-parallel rank, "
                f"ranks 0..{tp_size - 1}, got ranks {sorted(ours)} of {len(metadata)} "
                f"({sorted(type(m).__name__ for m in metadata.values())}); the scheduler half cannot grant leases or "
                "size its tiers without it"
            )
        incarnations = {m.incarnation for m in ours.values()}
        if len(incarnations) != 1:  # the workers adopt rank 0's at start-up (tp_ranks.py)
            raise ConfigError(f"KVBridgeConnector: vLLM's workers named {len(incarnations)} engine incarnations, not one")
        # Rank 0 speaks for the node: its side channel, its leases (its layout is its own heads' shard).
        self._scheduler.start(ours[0].incarnation, ours[0].step_stats, ours[0].layout)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        reset = kv_cache_manager.reset_prefix_cache

        def reset_after_drain() -> bool:
            self.drain_before_reset(kv_cache_manager)
            return reset()

        # vLLM resets its block pool only when no block is in use; blocks held for a transfer in
        # flight (an offload store, a prefill's lease) would make it refuse until some later step.
        kv_cache_manager.reset_prefix_cache = reset_after_drain

    def drain_before_reset(self, kv_cache_manager: Any) -> None:
        """Finish this engine's transfers in flight, by the flush deadline, and free the blocks they held.

        Needs the worker in this process (single-process executors, e.g. every CPU engine); with
        workers elsewhere vLLM's own behaviour stays: the reset waits for a later step.
        """
        worker = local_worker(self.setup.transfer.engine_id)
        held = self.scheduler.held_requests()
        if worker is None or not (held or self.scheduler.has_pending_transfers()):
            return
        metadata = KVBridgeMetadata(self.scheduler.plan_drain())
        sent = worker.drain(metadata, set(held), self.setup.transfer.flush_timeout_s)
        for req_id in self.scheduler.apply_drained(sent):
            kv_cache_manager.free(held[req_id])  # vLLM's own free of it, next step, finds nothing left

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeMetadata:
        return KVBridgeMetadata(self.scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------ statistics (either side)

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        if self._worker is not None:
            return self._worker.stats()
        return self.scheduler.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVBridgePromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
