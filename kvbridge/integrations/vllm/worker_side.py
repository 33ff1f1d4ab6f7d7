"""The adapter's worker half: vLLM's model-runner calls -> a kvbridge connector's worker half.

Lives next to vLLM's KV cache, on vLLM's worker thread. `register_kv_caches` hands the kvbridge
connector one strided view over vLLM's own KV buffer (`kv_layout.py`): nothing is copied, NIXL
registers vLLM's memory. The other calls map one to one; layer names become layer indices.

A worker registers itself by engine id in this process (`local_worker`), so the scheduler half
can drain it before vLLM resets its prefix cache: on CPU (and with any single-process executor)
vLLM's scheduler and its only worker share a process and a thread.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from kvbridge.connectors.base import CompletedTransfers, ConnectorContext, KVConnectorRole
from kvbridge.connectors.factory import create_connector
from kvbridge.integrations.vllm.affinity import run_unpinned
from kvbridge.integrations.vllm.config import AdapterConfig
from kvbridge.integrations.vllm.kv_layout import layout_of, strided_view
from kvbridge.integrations.vllm.metadata import KVBridgeHandshake, KVBridgeMetadata, KVBridgeWorkerMeta
from kvbridge.integrations.vllm.stats import StatsSnapshots, StepTimer

logger = logging.getLogger(__name__)

_LOCAL_WORKERS: weakref.WeakValueDictionary[str, WorkerSide] = weakref.WeakValueDictionary()


def local_worker(engine_id: str) -> WorkerSide | None:
    """The live worker half of engine `engine_id` in this process, if there is one."""
    return _LOCAL_WORKERS.get(engine_id)


class WorkerSide:
    @run_unpinned
    def __init__(self, setup: AdapterConfig, kv_cache_config: Any, page_format: str, device: str) -> None:
        self.setup = setup
        self.layout, self.layer_names = layout_of(kv_cache_config, page_format)
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self.context = ConnectorContext(
            model_id=setup.model_id,
            block_size=setup.block_size,
            device=device,
            hash_namespace=setup.model_id,
            layout=self.layout,
        )
        self.inner = create_connector(setup.transfer, KVConnectorRole.WORKER, self.context)
        self._carry = CompletedTransfers(set(), set())  # collected by a drain, reported by the next step
        self._snapshots = StatsSnapshots("worker")
        self._has_ended = False  # a request or a transfer ended this step: snapshot the stats
        self.timer = StepTimer()  # start_load_kv + wait_for_save + get_finished + load errors, per step
        self._is_shut_down = False
        _LOCAL_WORKERS[setup.transfer.engine_id] = self

    @run_unpinned
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        view = strided_view(kv_caches, self.layer_names, self.layout)
        self.inner.register_kv_caches(view, self.layout)
        logger.info(
            "KVBridgeConnector: %s registered %d layers x %d blocks of vLLM's KV cache (%s, page %d B, %s)",
            self.setup.transfer.connector, self.layout.num_layers, self.layout.num_blocks, self.layout.page_format,
            self.layout.page_nbytes, "blocks outermost" if self.layout.is_block_contiguous else "layers outermost",
        )  # fmt: skip

    def handshake(self) -> KVBridgeHandshake:
        return KVBridgeHandshake(incarnation=self.context.incarnation, step_stats=self.inner.get_step_stats())

    # ------------------------------------------------------------------ per step

    def bind(self, metadata: KVBridgeMetadata | None) -> None:
        if metadata is not None and metadata.inner is not None:
            self.inner.bind_connector_metadata(metadata.inner)

    def clear(self) -> None:
        self.inner.clear_connector_metadata()

    @run_unpinned
    def start_load_kv(self) -> None:
        with self.timer.timing():
            self.inner.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:
            self.inner.wait_for_layer_load(index)

    def save_kv_layer(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:
            self.inner.save_kv_layer(index)

    @run_unpinned
    def wait_for_save(self) -> None:
        with self.timer.timing():
            self.inner.wait_for_save()

    @run_unpinned
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self.timer.timing():
            done = self.inner.get_finished(set(finished_req_ids))
        sending = done.finished_sending | self._carry.finished_sending
        recving = done.finished_recving | self._carry.finished_recving
        self._carry = CompletedTransfers(set(), set())
        self._has_ended = bool(finished_req_ids or sending or recving)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self.timer.timing():
            errors = set(self.inner.get_block_ids_with_load_errors())
        self.timer.step()  # vLLM's last per-step call into the worker half
        self._has_ended |= bool(errors)
        return errors

    def worker_meta(self) -> KVBridgeWorkerMeta | None:
        stats = self.inner.get_step_stats()
        return KVBridgeWorkerMeta(dict(stats)) if stats else None

    def stats(self):
        force, self._has_ended = self._has_ended, False
        return self._snapshots.take(lambda: {**self.inner.get_stats(), "adapter": self.timer.summary()}, force=force)

    # ------------------------------------------------------------------ drain and shutdown

    @run_unpinned
    def drain(self, metadata: KVBridgeMetadata, finished_req_ids: set[str], timeout_s: float) -> set[str]:
        """Run one connector-only step with `metadata` (what the scheduler half planned since the last
        step: leases to grant, finished requests' plans), then finish in-flight transfers by `timeout_s`.
        Returns the requests whose sends finished; they and any receives are reported again by the
        next `get_finished`, so vLLM's scheduler sees them as usual."""
        self.bind(metadata)
        try:
            self.inner.start_load_kv()
            self.inner.wait_for_save()
        finally:
            self.clear()
        self._flush(timeout_s)
        done = self.inner.get_finished(set(finished_req_ids))
        self._carry = CompletedTransfers(
            self._carry.finished_sending | done.finished_sending, self._carry.finished_recving | done.finished_recving
        )
        return set(self._carry.finished_sending)

    def _flush(self, timeout_s: float) -> None:
        result = self.inner.flush(timeout_s)
        if not result.is_complete:
            logger.warning(
                "KVBridgeConnector: %d transfer(s) still in flight after %.1f s: %s",
                len(result.pending_req_ids), timeout_s, sorted(result.pending_req_ids)[:8],
            )  # fmt: skip

    @run_unpinned
    def shutdown(self) -> None:
        if self._is_shut_down:
            return
        self._is_shut_down = True
        try:
            self._flush(self.setup.transfer.flush_timeout_s)
        finally:
            self.inner.shutdown()
            _LOCAL_WORKERS.pop(self.setup.transfer.engine_id, None)
