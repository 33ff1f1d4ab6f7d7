"""The adapter's scheduler half: vLLM's scheduler calls -> a kvbridge connector's scheduler half.

Pure bookkeeping, on vLLM's engine-core thread. Besides translating objects (`requests.py`), it
keeps the two promises vLLM makes its connectors keep and kvbridge's own engine does not ask for:

* a request is reported in `finished_sending` only after `request_finished` delayed its blocks
  (vLLM frees a request's blocks, even a running one's, on the first report). A kvbridge
  connector that finishes a send before the request finishes has its report held back and
  delivered once `request_finished` delayed the request's free;
* `finished_recving` names only requests this half started an async load for, and never a
  finished request whose free waits for a send (vLLM would free it twice).
"""

from __future__ import annotations

import logging
from typing import Any

from kvbridge.connectors.base import (
    ConnectorContext,
    KVConnectorBase,
    KVConnectorOutput,
    KVConnectorRole,
    SchedulerOutput,
)
from kvbridge.connectors.factory import create_connector
from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.config import AdapterConfig
from kvbridge.integrations.vllm.identity import ExtraKeysFn, UnidentifiableRequest
from kvbridge.integrations.vllm.requests import BlockTables, RequestViews, first_group, step_output
from kvbridge.integrations.vllm.stats import KVBridgeStats, StatsSnapshots, StepTimer
from kvbridge.layout import KVCacheLayout

logger = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, setup: AdapterConfig, extra_keys: ExtraKeysFn | None = None) -> None:
        self.setup = setup
        self.layout: KVCacheLayout | None = None  # the worker's, from its handshake metadata
        self.views = RequestViews(setup.block_size, setup.model_id, extra_keys)
        self._local: set[str] = set()  # requests kvbridge cannot identify: vLLM computes them, nothing is shared
        self.tables = BlockTables()  # vLLM 0.25 hands connectors block-table deltas only
        self._inner: KVConnectorBase | None = None
        self._delayed: dict[str, Any] = {}  # finished, blocks held for a send: req id -> vLLM request
        self._matched_async: dict[str, bool] = {}  # last match answer: an async load?
        self._loading: set[str] = set()  # async loads started
        self._sent_early: set[str] = set()  # sends reported before the request finished
        self._redeliver: set[str] = set()  # early sends to report in the next step
        self._drained: set[str] = set()  # sends a drain applied already; vLLM hears of them in the next step
        self.timer = StepTimer()  # build_connector_meta + update_connector_output, per step
        self._snapshots = StatsSnapshots("scheduler")
        self._has_ended = False  # a request or a transfer ended since the last stats snapshot

    # ------------------------------------------------------------------ building

    def start(self, incarnation: str, step_stats: dict[str, Any], layout: dict[str, Any]) -> None:
        """Build the kvbridge half with the worker's incarnation and KV layout (from vLLM's handshake metadata)."""
        if self._inner is not None:
            raise RuntimeError("KVBridgeConnector: start-up metadata delivered twice")
        self.layout = KVCacheLayout(**layout) if layout else None
        context = ConnectorContext(
            model_id=self.setup.model_id,
            block_size=self.setup.block_size,
            device="cpu",  # the scheduler half touches no device
            hash_namespace=self.setup.model_id,
            layout=self.layout,
            incarnation=incarnation,
        )
        self._inner = create_connector(self.setup.transfer, KVConnectorRole.SCHEDULER, context)
        if step_stats:
            self._inner.update_connector_output(KVConnectorOutput(stats=dict(step_stats)))

    def shutdown(self) -> None:
        """Close what the kvbridge half holds (its sockets: a decode's hand-off inbox). Idempotent."""
        if self._inner is not None:
            self._inner.shutdown()

    @property
    def inner(self) -> KVConnectorBase:
        if self._inner is None:
            raise ConfigError(
                "KVBridgeConnector: vLLM delivered no start-up metadata from the worker (set_xfer_handshake_metadata "
                "was never called), so the scheduler half has no engine incarnation to grant leases under; this vLLM "
                "version or executor does not collect connector handshake metadata, which KVBridgeConnector needs"
            )
        return self._inner

    # ------------------------------------------------------------------ admission

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.request_id in self._local or not self._is_identifiable(request):
            return 0, False
        view = self.views.of(request)
        num_external, load_async = self.inner.get_num_new_matched_tokens(view, num_computed_tokens)
        if num_external is None:
            return None, False
        num_external = max(0, min(num_external, request.num_tokens - num_computed_tokens))
        is_async = bool(load_async and num_external)
        self._matched_async[request.request_id] = is_async
        return num_external, is_async

    def _is_identifiable(self, request: Any) -> bool:
        """Whether the request's block hashes can be computed; if not, it is kept local from now on."""
        view = self.views.of(request)
        try:
            view.block_hashes
        except UnidentifiableRequest as exc:
            self.views.drop(request.request_id)
            self._local.add(request.request_id)
            logger.warning(
                "KVBridgeConnector: request %s is computed locally and shares no KV: its extra keys (cache salt, LoRA, "
                "multimodal inputs, prompt embeddings) cannot be identified (%s)", request.request_id, exc,
            )  # fmt: skip
            return False
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if request.request_id in self._local:
            return
        view = self.views.of(request)
        self.inner.update_state_after_alloc(view, first_group(blocks.get_block_ids()), num_external_tokens)
        if self._matched_async.pop(request.request_id, False) and num_external_tokens:
            self._loading.add(request.request_id)  # vLLM parks it until finished_recving names it

    def build_connector_meta(self, vllm_output: Any):
        with self.timer.timing():
            return self.inner.build_connector_meta(step_output(vllm_output, self.views, self.tables))

    # ------------------------------------------------------------------ worker reports

    def update_connector_output(self, vllm_output: Any) -> None:
        with self.timer.timing():
            self._update(vllm_output)
        self.timer.step()

    def _update(self, vllm_output: Any) -> None:
        sending = set(vllm_output.finished_sending or ())
        recving = set(vllm_output.finished_recving or ()) & self._loading
        self._loading -= recving
        self._sent_early |= {r for r in sending - self._delayed.keys() - self._drained if self.views.get(r) is not None}
        to_vllm = (sending & (self._delayed.keys() | self._drained)) | self._redeliver
        to_inner = to_vllm - self._drained
        self._drained -= to_vllm
        self._redeliver = set()
        # A finished request whose free a connector delayed is freed by vLLM on its send report; its
        # load's end must not free it first (vLLM would then assert on the send for a request it
        # no longer knows).
        recving_to_vllm = recving - self._delayed.keys() - to_vllm
        self._release(to_vllm)
        worker_meta = getattr(vllm_output, "kv_connector_worker_meta", None)
        self.inner.update_connector_output(
            KVConnectorOutput(
                finished_sending=to_inner,
                finished_recving=recving,
                invalid_block_ids=set(vllm_output.invalid_block_ids or ()),
                stats=dict(getattr(worker_meta, "stats", None) or {}),
            )
        )
        vllm_output.finished_sending = to_vllm or None
        vllm_output.finished_recving = recving_to_vllm or None
        self._has_ended |= bool(sending or recving or vllm_output.invalid_block_ids)

    def apply_drained(self, sent: set[str]) -> set[str]:
        """Sends a drain finished outside a step: the kvbridge half learns of them now (so a prompt
        stored to a tier is found by the next request), vLLM in the next step. Returns the held ones."""
        held = sent & self._delayed.keys()
        if held:
            self.inner.update_connector_output(KVConnectorOutput(finished_sending=set(held)))
            self._drained |= held
            self._release(held)
        return held

    def _release(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._delayed.pop(req_id, None)
            self._loading.discard(req_id)  # a load that outlived its request may end in finished_sending only
            self.views.drop(req_id)

    # ------------------------------------------------------------------ finishing

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        if req_id in self._local:
            self._local.discard(req_id)
            return False, None
        view = self.views.of(request)
        delay, params = self.inner.request_finished(view, list(block_ids))
        self._has_ended = True
        self._matched_async.pop(req_id, None)  # a load in flight stays in _loading: vLLM frees its blocks on the report
        if delay and req_id in self._sent_early:
            self._redeliver.add(req_id)  # the kvbridge half learns it was sent; vLLM frees the blocks then
            self._delayed[req_id] = request
        elif delay:
            self._delayed[req_id] = request
        else:
            self.views.drop(req_id)
        self._sent_early.discard(req_id)
        return delay, params

    def plan_drain(self):
        """The kvbridge half's plan for a connector-only step before a reset: what it planned since the
        last step (e.g. the leases of requests that just finished) and the finished requests held."""
        return self.inner.build_connector_meta(SchedulerOutput(finished_req_ids=set(self._delayed)))

    def held_requests(self) -> dict[str, Any]:
        """Finished requests whose blocks wait for a send, by id (vLLM's request objects)."""
        return dict(self._delayed)

    def has_pending_transfers(self) -> bool:
        return bool(self._delayed or self._loading) or self.inner.has_pending_transfers()

    def stats(self) -> KVBridgeStats | None:
        """This half's stats for vLLM: rate-limited, but taken in any step where something ended."""
        force, self._has_ended = self._has_ended, False
        return self._snapshots.take(self.get_stats, force=force)

    def get_stats(self) -> dict[str, Any]:
        stats = dict(self.inner.get_stats())
        stats["adapter"] = {
            "held_requests": len(self._delayed),  # finished, blocks kept for a transfer
            "loading_requests": len(self._loading),
            "tracked_requests": len(self.views),
            **self.timer.summary(),
        }
        return stats
