"""Connectors for the conformance kit's own tests: `QueueTierConnector`, which keeps the contract,
and subclasses that each break one rule of it, the way the bugs that cost vLLM users most did.

`QueueTierConnector` stores finished requests' full blocks in a process-wide dict (block hash ->
block) and loads them back asynchronously; every copy runs on one worker thread, in order, after
`extra["delay_s"]`. Options (`extra`): `delay_s` (default 0.05), `fail_loads` (every load fills its
first block with garbage and reports it failed), `store` (the name of the dict it stores into; tests
give each run its own, so that one run's late copies never touch another's).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from kvbridge.connectors.base import (
    CompletedTransfers,
    FlushReport,
    KVConnectorBase,
    KVConnectorMetadata,
    KVHandoff,
    MatchResult,
    RequestStatus,
)
from kvbridge.errors import ConfigError

STORES: dict[str, dict[bytes, torch.Tensor]] = {}  # name -> block hash -> one block [layers, 2, block_size, heads, dim]
LEAKED: list[torch.Tensor] = []  # LeakyConnector's buffers, never given back
OPTIONS = {"delay_s", "fail_loads", "store"}


@dataclass
class Job:
    request_id: str
    blocks: list[tuple[int, bytes]]  # (block id, block hash)
    is_last: bool = True  # a store reports its request finished only with its last job


@dataclass
class Plan(KVConnectorMetadata):
    loads: list[Job] = field(default_factory=list)
    saves: list[Job] = field(default_factory=list)


class QueueTierConnector(KVConnectorBase):
    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if unknown := sorted(set(config.extra) - OPTIONS):
            raise ConfigError(f"{cls.__name__}: unknown extra option(s) {unknown}; known: {sorted(OPTIONS)}")

    def __init__(self, config, role, context) -> None:
        super().__init__(config, role, context)
        self.bs = context.block_size
        self.delay_s = float(config.extra.get("delay_s", 0.05))
        self.fail_loads = bool(config.extra.get("fail_loads", False))
        self.store = STORES.setdefault(str(config.extra.get("store", "default")), {})
        # scheduler half
        self.planned: set[bytes] = set()  # hashes stored or being stored (the one worker thread keeps order)
        self.matched: dict[str, int] = {}
        self.plan = Plan()
        self.in_flight: set[str] = set()
        # worker half
        self.kv: torch.Tensor | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.futures: dict[Future, str] = {}
        self.lock = threading.Lock()
        self.done_send: set[str] = set()
        self.done_recv: set[str] = set()
        self.errors: set[int] = set()

    # ---------------------------------------------------------------- scheduler half
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        first = num_computed_tokens // self.bs
        last = (request.num_tokens - 1) // self.bs  # leave the last prompt token to compute
        hits = 0
        while first + hits < last and request.block_hashes[first + hits] in self.planned:
            hits += 1
        self.matched[request.request_id] = num_computed_tokens
        return MatchResult(hits * self.bs, True)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        first = self.matched.pop(request.request_id, 0) // self.bs
        if num_external_tokens:
            blocks = [(block_ids[i], request.block_hashes[i]) for i in range(first, first + num_external_tokens // self.bs)]
            self.plan.loads.append(Job(request.request_id, blocks))
            self.in_flight.add(request.request_id)

    def build_connector_meta(self, scheduler_output):
        plan, self.plan = self.plan, Plan()
        return plan

    def update_connector_output(self, output):
        self.in_flight -= output.finished_sending | output.finished_recving

    def request_finished(self, request, block_ids):
        if request.status is RequestStatus.FINISHED_ABORTED:
            return KVHandoff(False, None)
        n = min(request.num_computed_tokens // self.bs, len(request.block_hashes))
        blocks = [(block_ids[i], request.block_hashes[i]) for i in range(n) if request.block_hashes[i] not in self.planned]
        if not blocks:
            return KVHandoff(False, None)
        self.planned.update(h for _, h in blocks)
        self.plan.saves.append(Job(request.request_id, blocks))
        self.in_flight.add(request.request_id)
        return KVHandoff(True, None)

    def has_pending_transfers(self):
        return bool(self.in_flight)

    # ---------------------------------------------------------------- worker half
    def register_kv_caches(self, kv_cache, layout):
        self.kv = kv_cache
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="queue-tier")

    def submit(self, fn, job: Job) -> Future:
        future = self.executor.submit(fn, job)
        self.futures[future] = job.request_id
        return future

    def start_load_kv(self):
        plan = self.get_connector_metadata()
        for job in plan.loads if isinstance(plan, Plan) else ():
            self.submit(self.load, job)

    def wait_for_save(self):
        plan = self.get_connector_metadata()
        for job in plan.saves if isinstance(plan, Plan) else ():
            self.submit(self.save, job)

    def load(self, job: Job) -> None:
        time.sleep(self.delay_s)
        for i, (block_id, block_hash) in enumerate(job.blocks):
            if self.fail_loads and i == 0:
                self.kv[block_id].fill_(float("nan"))  # what a torn transfer leaves
                with self.lock:
                    self.errors.add(block_id)
                continue
            self.kv[block_id].copy_(self.store[block_hash])
        self.report_recv(job.request_id)

    def report_recv(self, request_id: str) -> None:
        with self.lock:
            self.done_recv.add(request_id)

    def save(self, job: Job) -> None:
        time.sleep(self.delay_s)
        for block_id, block_hash in job.blocks:
            self.store[block_hash] = self.kv[block_id].clone()
        if job.is_last:
            self.report_send(job.request_id)

    def report_send(self, request_id: str) -> None:
        with self.lock:
            self.done_send.add(request_id)

    def get_finished(self, finished_req_ids):
        with self.lock:
            sending, self.done_send = self.done_send, set()
            recving, self.done_recv = self.done_recv, set()
        return CompletedTransfers(sending, recving)

    def get_block_ids_with_load_errors(self):
        with self.lock:
            errors, self.errors = self.errors, set()
        return errors

    def flush(self, timeout_s):
        wait(list(self.futures), timeout=timeout_s)
        self.futures = {f: r for f, r in self.futures.items() if not f.done()}
        return FlushReport(not self.futures, frozenset(self.futures.values()))

    def shutdown(self):
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
        self.futures.clear()
        self.kv = None


class EarlyFinishConnector(QueueTierConnector):
    """Reports a load finished as soon as it is started; its bytes land later."""

    def start_load_kv(self):
        plan = self.get_connector_metadata()
        for job in plan.loads if isinstance(plan, Plan) else ():
            QueueTierConnector.report_recv(self, job.request_id)
            self.submit(self.load, job)

    def report_recv(self, request_id: str) -> None:
        pass


class LateSyncLoadConnector(QueueTierConnector):
    """Loads synchronously (inside the admission step), but copies the bytes only after the forward pass."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return MatchResult(super().get_num_new_matched_tokens(request, num_computed_tokens).num_external_tokens, False)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        self.in_flight.discard(request.request_id)  # a sync load reports nothing

    def start_load_kv(self):
        pass

    def wait_for_save(self):
        plan = self.get_connector_metadata()
        for job in plan.loads if isinstance(plan, Plan) else ():
            for block_id, block_hash in job.blocks:
                self.kv[block_id].copy_(self.store[block_hash])
        super().wait_for_save()


class HangingFlushConnector(QueueTierConnector):
    """`flush(timeout_s)` waits for every transfer, however long past its deadline."""

    def flush(self, timeout_s):
        return super().flush(None)


class LeakyConnector(QueueTierConnector):
    """Allocates a staging buffer next to the KV cache and never gives it back."""

    def register_kv_caches(self, kv_cache, layout):
        super().register_kv_caches(kv_cache, layout)
        LEAKED.append(torch.empty_like(kv_cache[:4]))


class EarlyStoreReleaseConnector(QueueTierConnector):
    """Reports a store finished (its blocks free) when it starts; the copy reads them later."""

    def wait_for_save(self):
        plan = self.get_connector_metadata()
        for job in plan.saves if isinstance(plan, Plan) else ():
            QueueTierConnector.report_send(self, job.request_id)
            self.submit(self.save, job)

    def report_send(self, request_id: str) -> None:
        pass


class AbortReleaseConnector(QueueTierConnector):
    """Reports an aborted request's load finished at once, while its copy still writes into the blocks."""

    def __init__(self, config, role, context) -> None:
        super().__init__(config, role, context)
        self.loading: dict[str, Future] = {}  # request id -> its load's copy
        self.reported_early: set[str] = set()

    def start_load_kv(self):
        plan = self.get_connector_metadata()
        for job in plan.loads if isinstance(plan, Plan) else ():
            self.loading[job.request_id] = self.submit(self.load, job)

    def get_finished(self, finished_req_ids):
        aborted = {r for r, f in self.loading.items() if r in finished_req_ids and not f.done()}
        sending, recving = super().get_finished(finished_req_ids)
        late = recving & self.reported_early  # reported once already, at the abort
        self.reported_early = (self.reported_early | aborted) - late
        return CompletedTransfers(sending, (recving - late) | aborted)


class ResetAtOnceConnector(QueueTierConnector):
    """Keeps no block for its stores and tells nobody about them: reset_prefix_cache returns at once
    while a store still reads blocks."""

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        self.in_flight.discard(request.request_id)
        return KVHandoff(False, None)

    def report_send(self, request_id: str) -> None:
        pass

    def has_pending_transfers(self):
        return False

    def flush(self, timeout_s):
        return FlushReport(True)


class SilentLoadErrorConnector(QueueTierConnector):
    """With `fail_loads`, leaves garbage in a block and reports no load error."""

    def get_block_ids_with_load_errors(self):
        super().get_block_ids_with_load_errors()
        return set()


class LockInMetadataConnector(QueueTierConnector):
    """Hands its worker half a lock inside the metadata: the halves could not live in two processes."""

    def build_connector_meta(self, scheduler_output):
        plan = super().build_connector_meta(scheduler_output)
        return LockPlan(plan.loads, plan.saves, threading.Lock())


@dataclass
class LockPlan(Plan):
    lock: object = None


class LaxConfigConnector(QueueTierConnector):
    """Ignores options it does not know."""

    @classmethod
    def check_config(cls, config) -> None:
        KVConnectorBase.check_config(config)


@dataclass
class StreamPlan(Plan):
    preempted: list[str] = field(default_factory=list)


class StreamingTierConnector(QueueTierConnector):
    """Stores each full block while its request runs (as the offload tier does), so that a store can
    be in flight when the request is preempted; `start_load_kv` finishes a preempted request's stores
    first, as the contract asks. A finished request's free waits for its last store."""

    def __init__(self, config, role, context) -> None:
        super().__init__(config, role, context)
        self.streamed: set[str] = set()  # scheduler half: requests with a store planned while running

    def build_connector_meta(self, scheduler_output):
        plan = super().build_connector_meta(scheduler_output)
        plan = StreamPlan(plan.loads, plan.saves, sorted(scheduler_output.preempted_req_ids))
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            n = min((scheduled.start + scheduled.num_new_tokens) // self.bs, len(request.block_hashes))
            blocks = [(scheduled.block_ids[i], request.block_hashes[i]) for i in range(n)
                      if request.block_hashes[i] not in self.planned]  # fmt: skip
            if blocks:
                self.planned.update(h for _, h in blocks)
                plan.saves.append(Job(request.request_id, blocks, is_last=False))
                self.streamed.add(request.request_id)
        return plan

    def request_finished(self, request, block_ids):
        handoff = super().request_finished(request, block_ids)
        if handoff.delay_free_blocks or request.request_id not in self.streamed:
            self.streamed.discard(request.request_id)
            return handoff
        # Its blocks may still be read by a store: free them once a last (empty) store behind it ran.
        self.streamed.discard(request.request_id)
        self.plan.saves.append(Job(request.request_id, []))
        self.in_flight.add(request.request_id)
        return KVHandoff(True, None)

    def start_load_kv(self):
        plan = self.get_connector_metadata()
        if isinstance(plan, StreamPlan):
            self.finish_stores_of(plan.preempted)
        super().start_load_kv()

    def finish_stores_of(self, request_ids: list[str]) -> None:
        wait([f for f, r in self.futures.items() if r in request_ids])


class PreemptReleaseConnector(StreamingTierConnector):
    """Lets a preempted request's stores run on while the step that preempted it reuses its blocks."""

    def finish_stores_of(self, request_ids: list[str]) -> None:
        pass
