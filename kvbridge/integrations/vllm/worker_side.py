"""The adapter's worker half: vLLM's model-runner calls -> a kvbridge connector's worker half.

Lives next to vLLM's KV cache, on vLLM's worker thread. The kvbridge connector is built when vLLM
registers its KV cache, since only then is the layout known: `register_kv_caches` (per-layer
tensors; on CPU laid out by vLLM 0.32's `KVCacheTensor`, `kv_layout.py`; on CUDA read from the
tensors' shapes and strides, `backend_layout.py`) or `register_cross_layers_kv_cache` (vLLM 0.25's
one tensor for every layer, V1 model runner). Layers in one buffer give the connector one strided
view over it; layers allocated one by one (vLLM 0.25's V2 model runner, its default) a
`LayerTensors`, one NIXL region per layer. Nothing is copied: NIXL registers vLLM's memory. The
other calls map one to one; layer names become layer indices.

Under tensor parallelism each vLLM worker process holds one of these over its own KV heads, as a
kvbridge rank (`tp_ranks.py`): rank 0's incarnation names the whole engine, rank 0 learns the
other ranks' shards at start-up (its side channel answers for all of them) and their per-step
reports in `get_finished`; vLLM merges the ranks' finished sets.

A worker registers itself by engine id in this process (`local_worker`), so the scheduler half
can drain it before vLLM resets its prefix cache: on CPU (and with any single-process executor)
vLLM's scheduler and its only worker share a process and a thread.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import weakref
from typing import Any

from kvbridge.connectors.base import CompletedTransfers, ConnectorContext, KVConnectorBase, KVConnectorRole
from kvbridge.connectors.factory import create_connector
from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.affinity import run_unpinned
from kvbridge.integrations.vllm.backend_layout import cross_layer_views, layer_views, layout_of_tensors
from kvbridge.integrations.vllm.config import AdapterConfig
from kvbridge.integrations.vllm.kv_layout import (
    attention_backend_name,
    cpu_page_format,
    geometry,
    layer_names_in_order,
    layout_of,
    strided_view,
)
from kvbridge.integrations.vllm.load_failures import LoadFailureLog
from kvbridge.integrations.vllm.metadata import KVBridgeHandshake, KVBridgeMetadata, KVBridgeWorkerMeta
from kvbridge.integrations.vllm.stats import StatsSnapshots, StepTimer
from kvbridge.integrations.vllm.tp_ranks import TPRank, all_gather_bytes
from kvbridge.layer_tensors import LayerTensors
from kvbridge.layout import KVCacheLayout

logger = logging.getLogger(__name__)

_LOCAL_WORKERS: weakref.WeakValueDictionary[str, WorkerSide] = weakref.WeakValueDictionary()


def local_worker(engine_id: str) -> WorkerSide | None:
    """The live worker half of engine `engine_id` in this process, if there is one."""
    return _LOCAL_WORKERS.get(engine_id)


class WorkerSide:
    @run_unpinned
    def __init__(self, setup: AdapterConfig, vllm_config: Any, kv_cache_config: Any, device: str) -> None:
        self.setup = setup
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._device = device
        self.layout: KVCacheLayout | None = None
        self.layer_names: list[str] = []
        self._layer_index: dict[str, int] = {}
        self.context: ConnectorContext | None = None
        self._inner: KVConnectorBase | None = None
        self._carry = CompletedTransfers(set(), set())  # collected by a drain, reported by the next step
        self.tp = TPRank.of_worker(vllm_config)
        self._exchanges = False  # this step's metadata makes the TP ranks exchange reports in get_finished
        # rank 0 speaks for the node (its leases, its side channel): its gauges keep the TP 1 names
        self._snapshots = StatsSnapshots(f"worker_tp{self.tp.rank}" if self.tp.rank else "worker")
        self._has_ended = False  # a request or a transfer ended this step: snapshot the stats
        self.timer = StepTimer()  # start_load_kv + wait_for_save + get_finished + load errors, per step
        self._is_shut_down = False
        self._load_failures = LoadFailureLog()  # each failed load's reason, in vLLM's log
        _LOCAL_WORKERS[setup.transfer.engine_id] = self

    @property
    def inner(self) -> KVConnectorBase:
        if self._inner is None:
            raise RuntimeError("KVBridgeConnector: vLLM called the worker half before registering its KV cache")
        return self._inner

    @run_unpinned
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """vLLM's per-layer KV tensors: one buffer of pages on CPU (vLLM 0.32's KVCacheTensor strides) or,
        on CUDA, what their shapes and strides say (`backend_layout.py`): one buffer, or one allocation each."""
        if self._device.startswith("cpu"):
            layout, names = layout_of(self._kv_cache_config, cpu_page_format(self._vllm_config, self._kv_cache_config))
            self._start(layout, names, strided_view(kv_caches, names, layout), "CPU_ATTN")
            return
        names = layer_names_in_order(self._kv_cache_config)
        missing = [name for name in names if name not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV tensor for layers {missing[:3]}")
        self._start_from_tensors([kv_caches[name] for name in names], names, attention_backend_name(self._vllm_config, names))

    @run_unpinned
    def register_cross_layers_kv_cache(self, kv_cache: Any, backend: Any) -> None:
        """vLLM's cross-layer KV tensor (one allocation for every layer, asked for by `prefer_cross_layer_blocks`)."""
        names, geo = layer_names_in_order(self._kv_cache_config), geometry(self._kv_cache_config)
        tensors = cross_layer_views(kv_cache, len(names), geo, backend.get_name())
        self._start_from_tensors(tensors, names, f"{backend.get_name()}, cross-layer")

    def _start_from_tensors(self, tensors: list[Any], names: list[str], backend_name: str) -> None:
        """Read the layout from vLLM's per-layer tensors (`backend_layout.py`) and start over them: one
        strided view where the layers share a buffer, else the tensors themselves, one NIXL region each."""
        layout, is_per_layer = layout_of_tensors(tensors, geometry(self._kv_cache_config), backend_name)
        views = layer_views(tensors, layout)
        if is_per_layer:
            self._start(layout, names, LayerTensors(views, layout), f"{backend_name}, one allocation per layer")
        else:
            self._start(layout, names, _view(views[0], layout), backend_name)

    def _start(self, layout: KVCacheLayout, layer_names: list[str], view: Any, backend_name: str) -> None:
        if self._inner is not None:
            raise RuntimeError("KVBridgeConnector: vLLM registered its KV cache twice")
        self.layout, self.layer_names = layout, list(layer_names)
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        tp = self.tp
        self.context = ConnectorContext(
            model_id=self.setup.model_id,
            block_size=self.setup.block_size,
            device=self._device,
            hash_namespace=self.setup.model_id,
            layout=layout,
            tp_rank=tp.rank,
            tp_size=tp.size,
            kv_head_start=tp.kv_head_start,
            num_total_kv_heads=tp.num_total_kv_heads if tp.is_parallel else None,
            **({"incarnation": _rank0_incarnation()} if tp.is_parallel else {}),
        )
        self._inner = create_connector(self.setup.transfer, KVConnectorRole.WORKER, self.context)
        self._inner.register_kv_caches(view, layout)
        if tp.is_parallel:  # rank 0's handshake answers describe every rank's shard
            infos = all_gather_bytes(self._inner.tp_rank_info())
            if tp.rank == 0:
                self._inner.set_tp_rank_infos(infos[1:])
        logger.info(
            "KVBridgeConnector: %s registered %d layers x %d blocks of vLLM's KV cache (%s; page %s, %d B; %s; "
            "tensor-parallel rank %d of %d, KV heads [%d, %d) of %d)",
            self.setup.transfer.connector, layout.num_layers, layout.num_blocks, backend_name, layout.page_format,
            layout.page_nbytes, "blocks outermost" if layout.is_block_contiguous else (
                "one region per layer" if isinstance(view, LayerTensors) else "layers outermost"),
            tp.rank, tp.size, tp.kv_head_start, tp.kv_head_start + layout.num_kv_heads, tp.num_total_kv_heads,
        )  # fmt: skip

    def handshake(self) -> KVBridgeHandshake:
        if self.context is None or self.layout is None:
            raise RuntimeError("KVBridgeConnector: vLLM asked for handshake metadata before registering its KV cache")
        return KVBridgeHandshake(
            incarnation=self.context.incarnation,
            step_stats=self.inner.get_step_stats(),
            layout=dataclasses.asdict(self.layout),
        )

    # ------------------------------------------------------------------ per step

    def bind(self, metadata: KVBridgeMetadata | None) -> None:
        inner = metadata.inner if metadata is not None else None
        if inner is not None and self._inner is not None:
            self.inner.bind_connector_metadata(inner)
        # every worker binds the same metadata, so all of them exchange this step or none does
        self._exchanges = self.tp.is_parallel and self._inner is not None and self._inner.has_tp_step_report(inner)

    def clear(self) -> None:
        if self._inner is not None:
            self._inner.clear_connector_metadata()

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
            if self._exchanges:  # after wait_for_save, before get_finished (connectors/base.py)
                reports = all_gather_bytes(self.inner.tp_step_report())
                if self.tp.rank == 0:
                    self.inner.apply_tp_step_reports(reports[1:])
            done = self.inner.get_finished(set(finished_req_ids))
        sending = done.finished_sending | self._carry.finished_sending
        recving = done.finished_recving | self._carry.finished_recving
        self._carry = CompletedTransfers(set(), set())
        self._has_ended = bool(finished_req_ids or sending or recving)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self.timer.timing():
            errors = set(self.inner.get_block_ids_with_load_errors())
            reasons = self.inner.get_load_errors()  # vLLM asks only for the blocks: the reasons are logged
        self.timer.step()  # vLLM's last per-step call into the worker half
        self._has_ended |= bool(errors)
        self._load_failures.report(errors, reasons)
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
        if self._inner is None:  # vLLM never registered a KV cache: nothing was started
            _LOCAL_WORKERS.pop(self.setup.transfer.engine_id, None)
            return
        try:
            self._flush(self.setup.transfer.flush_timeout_s)
        finally:
            self._inner.shutdown()
            _LOCAL_WORKERS.pop(self.setup.transfer.engine_id, None)


def _rank0_incarnation() -> str:
    """Every TP rank: rank 0's fresh incarnation. One engine, one name: readers check it in rank 0's
    handshake answer, and the leases rank 0 grants carry it."""
    return all_gather_bytes(secrets.token_hex(16).encode())[0].decode()


def _view(first: Any, layout: KVCacheLayout) -> Any:
    """`[num_blocks, num_layers, *page_shape]` over the buffer that holds layer 0's tensor `first`."""
    import torch

    return torch.as_strided(first, layout.shape, layout.strides, first.storage_offset())
