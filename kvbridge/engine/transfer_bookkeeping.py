"""The scheduler's transfer bookkeeping: the scheduler-side connector half and the requests and
blocks its transfers hold (see `connectors/base.py`).

Pure bookkeeping (no torch), on the engine thread. Without a connector every method degrades to
"no external tokens, nothing in flight".

What it keeps:
* parked requests (`WAITING_FOR_REMOTE_KVS`): blocks allocated, an async load in flight; they
  resume when the worker names them in `finished_recving`, with the loaded tokens counted as
  computed; a load the worker names in `landed_recving` first (bytes in, not yet vouched for) is
  handed to the scheduler to compute early (`engine/unconfirmed_loads.py`) and stays parked;
* held blocks of finished requests: until `finished_sending` names them (`delay_free_blocks`), and,
  for a request aborted while its load was in flight, until `finished_recving` names it (nothing
  may be reused while a transfer still writes into it);
* load errors: blocks the worker failed to load are never served from the prefix cache; their
  requests roll back to the first bad block (`recompute`) or finish with an error (`fail`).

It decides and never acts on the scheduler: each report of the worker comes back as
`TransferActions`, which the `Scheduler` applies to its queues, block tables and stats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from kvbridge.connectors.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput, SchedulerOutput
from kvbridge.engine.request import Request, RequestStatus
from kvbridge.errors import KVLoadError
from kvbridge.repeated_log import RepeatedWarnings

if TYPE_CHECKING:
    from collections.abc import Container, Mapping, Sequence

logger = logging.getLogger(__name__)


@dataclass
class TransferActions:
    """What the scheduler must do after a worker report, in field order."""

    uncache_blocks: set[int] = field(default_factory=set)  # their load failed: never serve them from the cache
    # Live requests holding such a block -> index of the first one: their blocks from there lose their hashes.
    first_bad_block: dict[str, int] = field(default_factory=dict)
    fail: dict[str, str] = field(default_factory=dict)  # request id -> error (load_failure_policy "fail")
    roll_back: dict[str, int] = field(default_factory=dict)  # request id -> tokens still good ("recompute")
    load_errors: dict[str, str] = field(default_factory=dict)  # request id -> why its load failed, as the connector said
    free: list[str] = field(default_factory=list)  # finished requests no transfer holds any more
    resume: list[tuple[Request, int]] = field(default_factory=list)  # async load done: (request, tokens loaded)
    landed: list[tuple[Request, int]] = field(default_factory=list)  # bytes in, unconfirmed: (parked request, tokens loading)


class BlockRelease(NamedTuple):
    """What the bookkeeping decided for the blocks of a request that finished."""

    kv_transfer_params: dict[str, Any] | None  # the connector's, for the client
    free_blocks: bool  # False: a transfer still holds them; a later `TransferActions.free` names the request


class TransferBookkeeping:
    """Connector calls and transfer-related request state, on behalf of one `Scheduler`."""

    def __init__(self, connector: KVConnectorBase | None, block_size: int, load_failure_policy: str) -> None:
        self.connector = connector
        self.block_size = block_size
        self.load_failure_policy = load_failure_policy
        self._parked: dict[str, Request] = {}
        self._parked_tokens: dict[str, int] = {}  # tokens being loaded (local hit included)
        self._failed_loads: dict[str, int] = {}  # parked request -> index of its first bad block
        self._send_hold: set[str] = set()  # finished; blocks wait for finished_sending
        self._recv_hold: set[str] = set()  # finished while loading; blocks wait for finished_recving
        self._early_sent: set[str] = set()  # finished_sending seen before the request finished
        self._warnings = RepeatedWarnings(logger)  # a dead or misconfigured peer fails every request's load

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
        if num_external:
            request.kv_external_source = self.connector.external_source(request.request_id)
        elif (refusal := self.connector.take_refusal(request.request_id)) is not None:
            request.kv_load_error = refusal  # the answer says why the params it was sent were not used
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

    def receive_report(self, kv_output: KVConnectorOutput, tables: Mapping[str, Sequence[int]]) -> TransferActions:
        """Hand the worker's report to the connector and decide about its load errors. `tables` are the
        live requests' block tables; a request named in `first_bad_block` used bad KV: its progress
        this step is void (rolled back, or failed)."""
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)
        invalid = kv_output.invalid_block_ids
        actions = TransferActions(uncache_blocks=set(invalid))
        if not invalid:
            return actions
        for request_id, table in tables.items():
            first_bad = next((i for i, b in enumerate(table) if b in invalid), None)
            if first_bad is None:
                continue
            actions.first_bad_block[request_id] = first_bad
            actions.load_errors[request_id] = kv_output.load_errors.get(request_id) or "the connector gave no reason"
            if self.load_failure_policy == "fail":
                actions.fail[request_id] = str(self._load_error(request_id, table, invalid, first_bad))
            else:
                num_good_tokens = first_bad * self.block_size
                self._warnings.warning(
                    "load_failed", "request %s: KV load failed from token %d on; recomputing (the connector's log "
                    "says why)", request_id, num_good_tokens,
                )  # fmt: skip
                if request_id in self._parked:
                    self._failed_loads[request_id] = first_bad
                actions.roll_back[request_id] = num_good_tokens
        return actions

    def _load_error(self, request_id: str, table: Sequence[int], invalid: set[int], first_bad: int) -> KVLoadError:
        bad = [b for b in table if b in invalid]
        name = type(self.connector).__name__ if self.connector else "connector"
        return KVLoadError(
            f"request {request_id}: {name} failed to load KV into {len(bad)} block(s) "
            f"(from token {first_bad * self.block_size} on) and load_failure_policy is 'fail'; "
            "retry the request, or set KVTransferConfig.load_failure_policy='recompute' to recompute such blocks locally"
        )

    def finished_transfers(self, kv_output: KVConnectorOutput, live_req_ids: Container[str]) -> TransferActions:
        """Requests whose loads finished resume; blocks whose transfers finished are freed.
        `live_req_ids`: the requests that have not finished (a send may end before its request)."""
        actions = TransferActions()
        for request_id in kv_output.finished_recving:
            if request_id in self._recv_hold:
                self._recv_hold.discard(request_id)
                if self._is_released(request_id):
                    actions.free.append(request_id)
            elif request_id in self._parked:
                actions.resume.append(self._resume(self._parked.pop(request_id)))
        for request_id in kv_output.finished_sending:
            if request_id in self._send_hold:
                self._send_hold.discard(request_id)
                if self._is_released(request_id):
                    actions.free.append(request_id)
            elif request_id in live_req_ids:
                self._early_sent.add(request_id)
        for request_id in kv_output.landed_recving:  # still parked: resumed (or rolled back) at finished_recving
            if request_id in self._parked and request_id not in self._failed_loads:
                actions.landed.append((self._parked[request_id], self._parked_tokens[request_id]))
        return actions

    def _resume(self, request: Request) -> tuple[Request, int]:
        num_loaded = self._parked_tokens.pop(request.request_id)
        first_bad = self._failed_loads.pop(request.request_id, None)
        if first_bad is not None:
            num_loaded = min(num_loaded, first_bad * self.block_size)
        return request, num_loaded

    # ------------------------------------------------------------------ finishing

    def request_finished(self, request: Request, block_ids: list[int]) -> BlockRelease:
        """A request finished: ask the connector, then decide whether its blocks are free now or held
        for a transfer."""
        request_id = request.request_id
        delay, params = False, None
        if self.connector is not None:
            try:
                delay, params = self.connector.request_finished(request, list(block_ids))
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
        return BlockRelease(params, self._is_released(request_id))

    def _is_released(self, request_id: str) -> bool:
        return request_id not in self._send_hold and request_id not in self._recv_hold
