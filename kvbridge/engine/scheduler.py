"""Continuous batching: which requests compute how many tokens in the next step.

Pure bookkeeping (no torch). `EngineCore.step()` calls, on the engine thread:

    output = scheduler.schedule()                        # running first, then admissions
    output.kv_connector_metadata = scheduler.build_connector_meta(output)
    runner_output = model_runner.execute(output)
    updates = scheduler.update_from_output(output, runner_output)

Policy (first come, first served):
* Running requests go first, in admission order: decodes take one token, unfinished (chunked)
  prefills take what the token budget leaves. When a running request needs a block and none is
  free, the most recently admitted running request is preempted by recompute: its blocks are
  freed, its progress reset, and it goes back to the front of the waiting queue; its output tokens
  are kept and recomputed as part of its sequence.
* Waiting requests are admitted while the budget, `max_num_seqs` and the blocks allow and nothing
  was preempted this step. Admission takes the local prefix-cache hit, then asks the connector
  for external tokens (`kvbridge/engine/transfer_bookkeeping.py` decides that side; the scheduler
  applies what it decides).
* A parked request whose load landed but is not confirmed yet (`KVConnectorOutput.landed_recving`)
  runs its first step early, between the running and the waiting requests, on the loaded KV:
  what that step samples is held back until the load is confirmed, and dropped if it is not
  (`kvbridge/engine/unconfirmed_loads.py`). Only requests whose sampling draws on no seeded
  generator (greedy, or unseeded) compute early: a dropped sample must not shift a seeded stream.
* A request whose admission raises (a connector hook failed for it) or whose sampling failed
  (`ModelRunnerOutput.request_errors`) finishes with FINISHED_ERROR and the reason; the others
  are not affected. See engine/faults.py for what ends the engine instead.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import NamedTuple

from kvbridge.config import SchedulerConfig
from kvbridge.connectors.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from kvbridge.engine.kv_cache_manager import KVCacheManager
from kvbridge.engine.outputs import ModelRunnerOutput
from kvbridge.engine.request import Request, RequestStatus
from kvbridge.engine.scheduler_stats import SchedulerStats
from kvbridge.engine.transfer_bookkeeping import TransferActions, TransferBookkeeping
from kvbridge.engine.unconfirmed_loads import HeldToken, UnconfirmedLoads

logger = logging.getLogger(__name__)


class RequestUpdate(NamedTuple):
    """A request that progressed (a new token) or finished in a step. `kv_transfer_params` comes
    from the connector's `request_finished`."""

    request: Request
    kv_transfer_params: dict | None = None


class Scheduler:
    """Owns every live request, the waiting queue, the running list and the block tables."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        *,
        enable_prefix_caching: bool = True,
        eos_token_ids: tuple[int, ...] = (),
        connector: KVConnectorBase | None = None,
        load_failure_policy: str = "recompute",
    ) -> None:
        self.config = config
        self.block_size = block_size
        # A request alone must always fit: KV exists for at most max_model_len - 1 tokens.
        self.max_model_len = min(max_model_len, num_blocks * block_size + 1)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.stats = SchedulerStats()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.transfers = TransferBookkeeping(connector, block_size, load_failure_policy)
        self.unconfirmed = UnconfirmedLoads()  # parked requests computing early on landed, unconfirmed KV
        self._finished_req_ids: set[str] = set()  # since the last schedule()
        self._failed: list[RequestUpdate] = []  # failed at admission; reported by update_from_output
        self.has_new_work = False  # the last update made a parked request schedulable (resumed, or landed)

    # ------------------------------------------------------------------ requests in / out

    def add_request(self, request: Request) -> None:
        """Queue a new request (validated by the caller: unique id, 0 < prompt < max_model_len)."""
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> RequestUpdate | None:
        """Finish a live request as aborted; unknown or finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        return self.finish_request(request, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request: Request, status: RequestStatus, error: str | None = None) -> RequestUpdate:
        """Mark finished, leave the queues, let the connector decide about the blocks, free or park them."""
        request.status = status
        request.error = error
        self.unconfirmed.discard(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)
        self.stats.num_finished_requests += 1
        finished = self.transfers.request_finished(request, self.kv.block_ids(request.request_id))
        if finished.free_blocks:
            self.kv.free(request.request_id)
        return RequestUpdate(request, finished.kv_transfer_params)

    def take_failed(self) -> list[RequestUpdate]:
        """Requests that failed at admission since the last call (update_from_output reports them)."""
        failed, self._failed = self._failed, []
        return failed

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_transfers(self) -> bool:
        return self.transfers.has_pending_transfers()

    def pending_transfer_req_ids(self) -> frozenset[str]:
        """Requests a transfer is still in flight for (parked loads, finished requests' held blocks)."""
        return self.transfers.pending_req_ids()

    def parked_requests(self) -> list[Request]:
        """Requests waiting for an async KV load, in the order they were parked."""
        return self.transfers.parked_requests()

    def is_request_id_in_use(self, request_id: str) -> bool:
        """A live request, or a finished one whose blocks a transfer still holds, has this id."""
        return request_id in self.requests or request_id in self.transfers.block_owners()

    def detach_connector(self) -> None:
        """Forget the connector (it was shut down); the scheduler then runs as without one."""
        self.transfers.connector = None

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch. Advances nothing: progress is recorded in `update_from_output`."""
        output = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        self.has_new_work = False
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(output, budget)
        if not output.preempted_req_ids:
            budget = self._schedule_unconfirmed(output, budget)
            self._schedule_waiting(output, budget)
        self.stats.num_steps += 1
        return output

    def schedule_after(self, previous: SchedulerOutput) -> SchedulerOutput | None:
        """The step after `previous`, scheduled before `previous`'s tokens are known (asynchronous
        scheduling): each of its requests decodes the token `previous` is sampling for it, in the
        same order, except those that this token ends by length (max_tokens, max_model_len). None
        unless that is all the next step would do: `previous` sampled for every running request and
        only for them (none finished, was aborted or preempted since, no chunk is left), nothing
        waits or failed, no request needs its token history to sample (penalties, min_tokens), no
        connector, and the blocks for the tokens in flight are free.

        A request that `previous` stops (EOS, a stop token) still has its row here: update_from_output
        skips it, and its blocks, freed then, never register that slot as a cached prefix (its KV is
        past the request's computed tokens).
        """
        requests = [s.request for s in previous.scheduled]
        if (
            requests != self.running or self.waiting or self._failed or self.transfers.connector is not None
            or len(requests) > self.config.max_num_batched_tokens
            or any(s.start + s.num_new_tokens != s.request.num_tokens for s in previous.scheduled)
            or any(r.sampling_params.needs_token_history for r in requests)
        ):  # fmt: skip
            return None
        requests = [r for r in requests if not self._is_last_by_length(r)]
        if not requests:
            return None
        for request in requests:
            # Blocks taken before a refusal are the ones the next schedule() takes for the request anyway.
            if not self.kv.allocate_slots(request, request.num_tokens + 1):
                return None
        output = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        for request in requests:
            self._add_scheduled(output, request, 1, start=request.num_tokens)
        self.stats.num_steps += 1
        self.stats.num_async_steps += 1
        return output

    def _is_last_by_length(self, request: Request) -> bool:
        """The request's next token ends it by length (as `_stop_status` decides once it is appended)."""
        num_output = request.num_output_tokens + 1
        return num_output >= request.sampling_params.max_tokens or request.num_tokens + 1 >= self.max_model_len

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (cannot happen while the runner samples as agreed)
                i += 1
                continue
            while not self.kv.allocate_slots(request, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim, output)
                if victim is request:
                    break
            else:
                self._add_scheduled(output, request, num_new)
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing further fits
        return budget

    def _schedule_unconfirmed(self, output: SchedulerOutput, budget: int) -> int:
        """Loads that landed unconfirmed: the rest of each request's prompt is computed now, whole, on
        the loaded KV, if the budget and free blocks allow (never by preempting); its sampled token is
        held back in `update_from_output`."""
        for request in self.unconfirmed.to_schedule():
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget or not self.kv.allocate_slots(request, request.num_computed_tokens + num_new):
                continue  # asked again next step; or it runs as usual once confirmed
            self.unconfirmed.mark_scheduled(request.request_id)
            self._add_scheduled(output, request, num_new)
            budget -= num_new
        return budget

    def _num_seqs(self) -> int:
        """Requests counted against max_num_seqs: the running ones and the ones computing early."""
        return len(self.running) + len(self.unconfirmed)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        skipped: deque[Request] = deque()
        while self.waiting and budget > 0 and self._num_seqs() < self.config.max_num_seqs:
            request = self.waiting.popleft()
            try:
                num_new = self._admit(request, budget)
            except Exception as exc:  # noqa: BLE001 - a connector hook failed for this request: it alone ends
                self._fail_admission(request, exc)
                continue
            if num_new is None:  # not now: connector undecided, or parked for an async load
                if request.status == RequestStatus.WAITING:
                    skipped.append(request)
                continue
            if num_new == 0:  # no blocks
                skipped.append(request)
                if self.running or output.scheduled:
                    break
                continue  # nothing runs: let a later request that already holds blocks go first
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(output, request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        if not self.running and not output.scheduled and self.waiting:
            self._unblock_waiting(output)

    def _admit(self, request: Request, budget: int) -> int | None:
        """Take blocks for a waiting request. Returns the tokens to compute this step, 0 when the blocks
        are missing, or None when the request cannot run this step for another reason."""
        if self.kv.holds_blocks(request.request_id):  # back from an async load: progress is known
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._fits_unchunked(request, num_new):
                return 0
            ok = self.kv.allocate_slots(request, request.num_computed_tokens + num_new)
            return num_new if ok else 0
        hits = self.kv.get_computed_blocks(request)
        num_local = len(hits) * self.block_size
        match = self.transfers.match(request, num_local)
        if match is None:
            return None
        num_external, load_async = match
        num_ready = min(num_local + num_external, request.num_tokens - 1)
        num_new = 0 if load_async else min(request.num_tokens - num_ready, budget)
        if not load_async and not self._fits_unchunked(request, num_ready + num_new):
            return 0
        if not self.kv.allocate_slots(request, max(num_local + num_external, num_ready + num_new), hits):
            return 0
        self.stats.record_admission(num_local, num_external)
        request.num_cached_tokens = num_local
        request.num_external_tokens = num_external
        request.num_computed_tokens = num_local if load_async else num_ready
        self.transfers.after_alloc(request, self.kv.block_ids(request.request_id), num_external)
        if load_async:
            self.transfers.park(request, num_local + num_external)
            return None
        return num_new

    def _fail_admission(self, request: Request, exc: Exception) -> None:
        """End a request whose admission raised. Its blocks may have been half taken: if the books no
        longer balance after releasing them, check_integrity's AssertionError ends the engine."""
        logger.warning("request %s failed at admission", request.request_id, exc_info=exc)
        reason = f"request {request.request_id} failed at admission: {type(exc).__name__}: {exc}"
        self._failed.append(self.finish_request(request, RequestStatus.FINISHED_ERROR, reason))
        self.check_integrity()

    def _fits_unchunked(self, request: Request, num_tokens_after: int) -> bool:
        """With chunked prefill off, a request is computed whole, unless it could never fit the budget
        (a preempted request whose outputs made it longer than the budget)."""
        return (
            self.config.enable_chunked_prefill
            or num_tokens_after >= request.num_tokens
            or request.num_tokens > self.config.max_num_batched_tokens
        )

    def _unblock_waiting(self, output: SchedulerOutput) -> None:
        """Nothing runs and no waiting request got blocks: requests back from async loads hold blocks
        while each needs more. Give up the newest one's blocks (its loaded prefix stays cached)."""
        holders = [r for r in self.waiting if self.kv.holds_blocks(r.request_id)]
        if holders and self.kv.pool.num_free_blocks < self.kv.pool.num_blocks:
            self._preempt(holders[-1], output, requeue=False)

    def _preempt(self, request: Request, output: SchedulerOutput, requeue: bool = True) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        output.preempted_req_ids.add(request.request_id)
        output.scheduled = [s for s in output.scheduled if s.request is not request]
        if requeue:
            request.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(request)
        logger.debug("preempted %s", request.request_id)

    def _add_scheduled(self, output: SchedulerOutput, request: Request, num_new: int, start: int | None = None) -> None:
        block_ids = list(self.kv.block_ids(request.request_id))
        start = request.num_computed_tokens if start is None else start
        output.scheduled.append(ScheduledRequest(request, start, num_new, block_ids))

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata | None:
        return self.transfers.build_meta(output)

    def empty_output(self) -> SchedulerOutput:
        """A step that computes nothing (lets the worker report transfers, e.g. after a flush)."""
        output = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        return output

    # ------------------------------------------------------------------ update

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Record what the step computed and sampled; finish requests; apply the connector's report."""
        kv_output = runner_output.kv_connector_output
        updates = self.take_failed()
        self.stats.num_computed_tokens += output.num_scheduled_tokens
        spoiled = self._receive_report(kv_output, updates)  # rolled back, or failed into updates
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.is_finished or request.request_id in spoiled:
                continue
            if request.request_id in self.unconfirmed:
                self._hold(scheduled, runner_output)
                continue
            request.num_computed_tokens = scheduled.start + scheduled.num_new_tokens
            self.kv.cache_blocks(request, request.num_computed_tokens)
            error = runner_output.request_errors.get(request.request_id)
            if error is not None:
                updates.append(self.finish_request(request, RequestStatus.FINISHED_ERROR, error))
                continue
            token_id = runner_output.sampled_token_ids.get(request.request_id)
            if token_id is None:
                continue
            updates.append(self._append_token(request, token_id, runner_output.logprobs.get(request.request_id)))
        # Finished receives resume (releasing tokens computed early), finished sends free blocks.
        self._apply(self.transfers.finished_transfers(kv_output, self.requests), updates)
        return updates

    def _append_token(self, request: Request, token_id: int, logprobs) -> RequestUpdate:
        request.append_output_token(token_id, logprobs)
        self.stats.num_generated_tokens += 1
        status = self._stop_status(request, token_id)
        return self.finish_request(request, status) if status else RequestUpdate(request)

    def _hold(self, scheduled: ScheduledRequest, runner_output: ModelRunnerOutput) -> None:
        """An early step on unconfirmed KV: its token is held, and no block of it is hashed."""
        request = scheduled.request
        token_id = runner_output.sampled_token_ids.get(request.request_id)
        if token_id is None or request.request_id in runner_output.request_errors:
            return  # nothing held: once confirmed, the request computes this step again, as usual
        request.num_computed_tokens = scheduled.start + scheduled.num_new_tokens
        self.unconfirmed.hold(request.request_id, HeldToken(token_id, runner_output.logprobs.get(request.request_id)))

    def _receive_report(self, kv_output: KVConnectorOutput, updates: list[RequestUpdate]) -> set[str]:
        """Hand the worker's report to the connector and apply its load errors. Returns the requests
        whose step used bad KV: their progress this step is void."""
        tables = {}
        if kv_output.invalid_block_ids:
            tables = {request_id: self.kv.block_ids(request_id) for request_id in self.requests}
        actions = self.transfers.receive_report(kv_output, tables)
        self._apply(actions, updates)
        return set(actions.first_bad_block)

    def _apply(self, actions: TransferActions, updates: list[RequestUpdate]) -> None:
        """Carry out what the transfer bookkeeping decided; failed requests' updates go to `updates`."""
        self.stats.num_failed_load_blocks += len(actions.uncache_blocks)
        for block_id in actions.uncache_blocks:
            self.kv.pool.uncache_block(block_id)
        for request_id, first_bad in actions.first_bad_block.items():
            request = self.requests[request_id]
            self.unconfirmed.discard(request_id)  # what it computed early on that KV is dropped
            request.num_failed_load_blocks += max(1, len(self.kv.block_ids(request_id)) - first_bad)
            request.kv_load_error = actions.load_errors.get(request_id)
            self.kv.uncache_from(request_id, first_bad)
            if request_id in actions.fail:
                self.stats.num_load_failures += 1
                updates.append(self.finish_request(request, RequestStatus.FINISHED_ERROR, actions.fail[request_id]))
            else:
                self.stats.num_load_recomputes += 1
                self._roll_back(request, actions.roll_back[request_id])
        for request_id in actions.free:
            self.kv.free(request_id)
        for request, num_loaded in actions.resume:
            held = self.unconfirmed.release(request.request_id)
            if held is None:
                self._resume(request, num_loaded)
            else:
                updates.append(self._release(request, held))
        for request, num_loaded in actions.landed:
            self._compute_early(request, num_loaded)
        self.has_new_work |= bool(actions.resume) or bool(actions.landed)

    def _compute_early(self, request: Request, num_loaded: int) -> None:
        """A parked request's load landed, unconfirmed: let its first step run early (unconfirmed_loads.py)."""
        params = request.sampling_params
        if not (params.seed is None or params.is_greedy) or self._num_seqs() >= self.config.max_num_seqs:
            return  # it waits for the confirmation, as every load did before
        request.num_computed_tokens = min(num_loaded, request.num_tokens - 1)
        self.unconfirmed.add(request)

    def _release(self, request: Request, held: HeldToken) -> RequestUpdate:
        """Its load was confirmed after its early step: that step's KV and token become the request's."""
        self.kv.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return self._append_token(request, held.token_id, held.logprobs)

    def _roll_back(self, request: Request, num_good_tokens: int) -> None:
        # A parked request's progress is set when its load ends (the bookkeeping caps it there).
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            request.num_computed_tokens = min(request.num_computed_tokens, num_good_tokens)
        request.num_external_tokens = max(0, min(request.num_external_tokens, num_good_tokens - request.num_cached_tokens))

    def _resume(self, request: Request, num_loaded: int) -> None:
        """An async load ended: its full blocks join the prefix cache and the request waits in front."""
        self.kv.cache_blocks(request, num_loaded)
        # At least one token is computed: it yields the logits of the next token.
        request.num_computed_tokens = min(num_loaded, request.num_tokens - 1)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------ maintenance

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def get_stats(self) -> dict:
        pool = self.kv.pool
        return self.stats.as_dict() | self.unconfirmed.get_stats() | {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_waiting_for_remote_kvs": self.transfers.num_parked,
            "num_blocks": pool.num_blocks,
            "block_size": self.block_size,
            "enable_prefix_caching": pool.enable_prefix_caching,
            "num_free_blocks": pool.num_free_blocks,
            "num_used_blocks": pool.num_used_blocks,
            "num_cached_blocks": pool.num_cached_blocks,
            "num_evictions": pool.num_evictions,
        }

    def check_integrity(self) -> None:
        """Block invariants, plus: every block table belongs to a live request or a parked release."""
        self.kv.check_integrity()
        owners = set(self.requests) | self.transfers.block_owners()
        for request_id in self.kv._tables:
            if request_id not in owners:
                raise AssertionError(f"Scheduler integrity: blocks held for unknown request {request_id}")
        for request in self.running:
            if request.status != RequestStatus.RUNNING or not self.kv.holds_blocks(request.request_id):
                raise AssertionError(f"Scheduler integrity: running {request} is not RUNNING with blocks")
        if self._num_seqs() > self.config.max_num_seqs:
            raise AssertionError("Scheduler integrity: more running (or early computing) requests than max_num_seqs")
        self._check_unconfirmed()

    def _check_unconfirmed(self) -> None:
        """A request computing on unconfirmed KV is parked, in no queue, and none of its blocks past
        its local prefix hit is in the prefix cache (no other request can be served them)."""
        self.unconfirmed.check_integrity()
        parked = {r.request_id for r in self.transfers.parked_requests()}
        for request in self.unconfirmed.requests():
            rid = request.request_id
            if rid not in parked or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                raise AssertionError(f"Scheduler integrity: {request} computes early but is not parked on its load")
            if request in self.running or request in self.waiting:
                raise AssertionError(f"Scheduler integrity: {request} computes early but is queued")
            table = self.kv.block_ids(rid)
            if any(self.kv.pool.block_hash(b) is not None for b in table[request.num_cached_tokens // self.block_size :]):
                raise AssertionError(f"Scheduler integrity: a block of {request} holding unconfirmed KV is in the prefix cache")
