"""The scheduler's dealings with the scheduler-side connector half (see `connectors/base.py`).

Pure bookkeeping (no torch), on the engine thread. Without a connector every method degrades to
"no external tokens, nothing in flight".

What it keeps:
* parked requests (`WAITING_FOR_REMOTE_KVS`): blocks allocated, an async load in flight; they go
  back to the front of the waiting queue when the worker names them in `finished_recving`, with
  the loaded tokens counted as computed (at least one token left to compute) and the loaded full
  blocks registered in the prefix cache;
* held blocks of finished requests: until `finished_sending` names them (`delay_free_blocks`), and,
  for a request aborted while its load was in flight, until `finished_recving` names it (nothing
  may be reused while a transfer still writes into it);
* load errors: blocks the worker failed to load are never served from the prefix cache; their
  requests roll back to the first bad block (`recompute`) or finish with an error (`fail`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvbridge.connectors.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, SchedulerOutput
from kvbridge.engine.request import Request, RequestStatus
from kvbridge.errors import KVLoadError

if TYPE_CHECKING:
    from kvbridge.engine.scheduler import RequestUpdate, Scheduler

logger = logging.getLogger(__name__)


class ConnectorState:
    """Connector calls and transfer-related request state, on behalf of one `Scheduler`."""

    def __init__(self, connector: KVConnectorBase | None, scheduler: Scheduler, load_failure_policy: str) -> None:
        self.connector = connector
        self._sched = scheduler
        self.load_failure_policy = load_failure_policy
        self._parked: dict[str, Request] = {}
        self._parked_tokens: dict[str, int] = {}  # tokens being loaded (local hit included)
        self._failed_loads: dict[str, int] = {}  # parked request -> index of its first bad block
        self._send_hold: set[str] = set()  # finished; blocks wait for finished_sending
        self._recv_hold: set[str] = set()  # finished while loading; blocks wait for finished_recving
        self._early_sent: set[str] = set()  # finished_sending seen before the request finished

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def has_pending_transfers(self) -> bool:
        busy = self.connector is not None and self.connector.has_pending_transfers()
        return busy or bool(self._parked or self._send_hold or self._recv_hold)

    def pending_req_ids(self) -> frozenset[str]:
        """Requests this scheduler waits on a transfer for (parked loads, held blocks)."""
        return frozenset(self._parked) | self._send_hold | self._recv_hold

    def parked_requests(self) -> list[Request]:
        """Requests waiting for an async KV load, in the order they were parked."""
        return list(self._parked.values())

    def block_owners(self) -> set[str]:
        """Finished requests whose blocks are still held for a transfer."""
        return self._send_hold | self._recv_hold

    # ------------------------------------------------------------------ admission

    def match(self, request: Request, num_local: int) -> tuple[int, bool] | None:
        """(external tokens, load async) for a waiting request, or None: ask again next step."""
        if self.connector is None:
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        if num_external is None:
            return None
        num_external = max(0, min(num_external, request.num_tokens - num_local))
        return num_external, bool(load_async and num_external > 0)

    def after_alloc(self, request: Request, block_ids: list[int], num_external: int) -> None:
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, list(block_ids), num_external)

    def park(self, request: Request, num_tokens_loading: int) -> None:
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._parked[request.request_id] = request
        self._parked_tokens[request.request_id] = num_tokens_loading

    def build_meta(self, output: SchedulerOutput) -> KVConnectorMetadata | None:
        return None if self.connector is None else self.connector.build_connector_meta(output)

    # ------------------------------------------------------------------ after the step

    def begin_update(self, kv_output: KVConnectorOutput, updates: list[RequestUpdate]) -> set[str]:
        """Hand the worker's report to the connector and apply load errors. Returns the requests whose
        step used bad KV: their progress this step is void (rolled back, or failed into `updates`)."""
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)
        invalid = kv_output.invalid_block_ids
        if not invalid:
            return set()
        kv, stats = self._sched.kv, self._sched.stats
        stats.num_failed_load_blocks += len(invalid)
        for block_id in invalid:
            kv.pool.uncache_block(block_id)
        spoiled: set[str] = set()
        for request in list(self._sched.requests.values()):
            table = kv.block_ids(request.request_id)
            first_bad = next((i for i, b in enumerate(table) if b in invalid), None)
            if first_bad is None:
                continue
            kv.uncache_from(request.request_id, first_bad)
            spoiled.add(request.request_id)
            if self.load_failure_policy == "fail":
                stats.num_load_failures += 1
                error = self._load_error(request, table, invalid, first_bad)
                updates.append(self._sched.finish_request(request, RequestStatus.FINISHED_ERROR, str(error)))
            else:
                stats.num_load_recomputes += 1
                self._roll_back(request, first_bad * kv.block_size)
        return spoiled

    def _roll_back(self, request: Request, num_good_tokens: int) -> None:
        logger.warning("request %s: KV load failed from token %d on; recomputing", request.request_id, num_good_tokens)
        if request.request_id in self._parked:
            self._failed_loads[request.request_id] = num_good_tokens // self._sched.block_size
        else:
            request.num_computed_tokens = min(request.num_computed_tokens, num_good_tokens)
        request.num_external_tokens = max(0, min(request.num_external_tokens, num_good_tokens - request.num_cached_tokens))

    def _load_error(self, request: Request, table: list[int], invalid: set[int], first_bad: int) -> KVLoadError:
        bad = [b for b in table if b in invalid]
        name = type(self.connector).__name__ if self.connector else "connector"
        return KVLoadError(
            f"request {request.request_id}: {name} failed to load KV into {len(bad)} block(s) "
            f"(from token {first_bad * self._sched.block_size} on) and load_failure_policy is 'fail'; "
            "retry the request, or set KVTransferConfig.load_failure_policy='recompute' to recompute such blocks locally"
        )

    def end_update(self, kv_output: KVConnectorOutput) -> None:
        """Resume requests whose loads finished; free blocks whose transfers finished."""
        for request_id in kv_output.finished_recving:
            if request_id in self._recv_hold:
                self._recv_hold.discard(request_id)
                self._free_if_released(request_id)
            elif request_id in self._parked:
                self._resume(self._parked.pop(request_id))
        for request_id in kv_output.finished_sending:
            if request_id in self._send_hold:
                self._send_hold.discard(request_id)
                self._free_if_released(request_id)
            elif request_id in self._sched.requests:
                self._early_sent.add(request_id)

    def _resume(self, request: Request) -> None:
        kv = self._sched.kv
        num_loaded = self._parked_tokens.pop(request.request_id)
        first_bad = self._failed_loads.pop(request.request_id, None)
        if first_bad is not None:
            num_loaded = min(num_loaded, first_bad * kv.block_size)
        kv.cache_blocks(request, num_loaded)
        # At least one token is computed: it yields the logits of the next token.
        request.num_computed_tokens = min(num_loaded, request.num_tokens - 1)
        request.status = RequestStatus.WAITING
        self._sched.waiting.appendleft(request)

    # ------------------------------------------------------------------ finishing

    def release_blocks(self, request: Request) -> dict | None:
        """A request finished: ask the connector, then free its blocks now or hold them for a transfer.
        Returns the connector's kv_transfer_params for the client."""
        request_id = request.request_id
        delay, params = False, None
        if self.connector is not None:
            try:
                delay, params = self.connector.request_finished(request, list(self._sched.kv.block_ids(request_id)))
            except Exception as exc:  # noqa: BLE001 - this request ends in error; its blocks are freed as usual
                logger.warning("request_finished failed for %s", request_id, exc_info=exc)
                request.status = RequestStatus.FINISHED_ERROR
                raised = f"{type(exc).__name__}: {exc}"
                request.error = f"request {request_id} failed: the connector's request_finished raised {raised}"
        if self._parked.pop(request_id, None) is not None:
            self._parked_tokens.pop(request_id, None)
            self._failed_loads.pop(request_id, None)
            self._recv_hold.add(request_id)
        if delay and request_id not in self._early_sent:
            self._send_hold.add(request_id)
        self._early_sent.discard(request_id)
        self._free_if_released(request_id)
        return params

    def _free_if_released(self, request_id: str) -> None:
        if request_id not in self._send_hold and request_id not in self._recv_hold:
            self._sched.kv.free(request_id)
