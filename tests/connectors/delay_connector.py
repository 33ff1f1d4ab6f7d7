"""A test connector whose transfers finish after a delay, on threads.

It saves finished requests' full blocks into an in-process "remote" store (host tensors keyed by
block hash) and loads them back for later requests whose prefix is in the store. Options
(`KVTransferConfig.extra`):

    store: str            name of the shared store (tests use one per test)
    delay_s: float        how long each load / save takes (default 0.05)
    load_async: bool      async loads (WAITING_FOR_REMOTE_KVS) or sync loads inside the step (default True)
    save: bool            save finished requests' blocks, delaying their free (default True)
    fail_loads: int       the first N loads report their first block as failed (default 0)
    never_finish: bool    transfers never finish until shutdown (flush timeouts)
    full_prompt: bool     offer every prompt block, even when that covers the whole prompt
    fail_scheduler_init: bool   the scheduler half's constructor raises ConfigError
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from kvbridge.connectors.base import (
    CompletedTransfers,
    FlushReport,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVHandoff,
    MatchResult,
)
from kvbridge.errors import ConfigError

STORES: dict[str, dict[bytes, torch.Tensor]] = {}  # store name -> block hash -> one block [L, 2, bs, H, D]
SHUTDOWNS: list[tuple[str, KVConnectorRole]] = []  # (store name, role) of every shutdown() call


@dataclass
class Job:
    request_id: str
    blocks: list[tuple[int, bytes]]  # (block id, block hash)


@dataclass
class DelayMeta(KVConnectorMetadata):
    loads: list[Job] = field(default_factory=list)
    saves: list[Job] = field(default_factory=list)
    load_async: bool = True


class DelayConnector(KVConnectorBase):
    def __init__(self, config, role, context) -> None:
        super().__init__(config, role, context)
        extra = config.extra
        if extra.get("fail_scheduler_init") and role is KVConnectorRole.SCHEDULER:
            raise ConfigError("DelayConnector: fail_scheduler_init is set")
        self.store_name = extra.get("store", "default")
        self.store = STORES.setdefault(self.store_name, {})
        self.delay_s = float(extra.get("delay_s", 0.05))
        self.load_async = bool(extra.get("load_async", True))
        self.save = bool(extra.get("save", True))
        self.fail_loads = int(extra.get("fail_loads", 0))
        self.never_finish = bool(extra.get("never_finish", False))
        self.full_prompt = bool(extra.get("full_prompt", False))
        self.bs = context.block_size
        # scheduler side
        self._matched: dict[str, int] = {}  # request id -> local hit it was matched at
        self._meta = DelayMeta(load_async=self.load_async)
        self._in_flight: set[str] = set()
        self.finished_params: dict[str, dict] = {}
        # worker side
        self._kv: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._done_send: set[str] = set()
        self._done_recv: set[str] = set()
        self._errors: set[int] = set()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._pending: set[str] = set()
        self.num_flushes = 0
        self.num_shutdowns = 0

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        first = num_computed_tokens // self.bs
        hits = 0
        for block_hash in request.block_hashes[first:]:
            if block_hash not in self.store:
                break
            hits += 1
        num_external = hits * self.bs
        if not self.full_prompt and num_computed_tokens + num_external >= request.num_tokens and hits:
            num_external -= self.bs  # leave the last block to compute
        self._matched[request.request_id] = num_computed_tokens
        return MatchResult(num_external, self.load_async)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens == 0:
            return
        first = self._matched[request.request_id] // self.bs
        n = num_external_tokens // self.bs
        blocks = [(block_ids[i], request.block_hashes[i]) for i in range(first, first + n)]
        self._meta.loads.append(Job(request.request_id, blocks))
        if self.load_async:  # sync loads end inside the step; nothing is reported for them
            self._in_flight.add(request.request_id)

    def build_connector_meta(self, scheduler_output):
        meta, self._meta = self._meta, DelayMeta(load_async=self.load_async)
        return meta

    def update_connector_output(self, output):
        self._in_flight -= output.finished_sending | output.finished_recving

    def request_finished(self, request, block_ids):
        if not self.save:
            return KVHandoff(False, None)
        n = min(request.num_computed_tokens // self.bs, len(request.block_hashes), len(block_ids))
        blocks = [(block_ids[i], request.block_hashes[i]) for i in range(n) if request.block_hashes[i] not in self.store]
        if not blocks:
            return KVHandoff(False, {"saved_blocks": 0})
        self._meta.saves.append(Job(request.request_id, blocks))
        self._in_flight.add(request.request_id)
        return KVHandoff(True, {"saved_blocks": len(blocks)})

    def has_pending_transfers(self):
        return bool(self._in_flight)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_cache, layout):
        self._kv = kv_cache

    def start_load_kv(self):
        meta = self.get_connector_metadata()
        if meta is None:
            return
        for job in meta.loads:
            fail = self.fail_loads > 0
            self.fail_loads -= int(fail)
            if meta.load_async:
                self._spawn(job, self._load, fail, recv=True)
            else:
                self._load(job, fail, recv=False)

    def wait_for_save(self):
        meta = self.get_connector_metadata()
        for job in meta.saves if meta else ():
            self._spawn(job, self._save, False, recv=False)

    def _spawn(self, job: Job, fn, fail: bool, recv: bool) -> None:
        with self._lock:
            self._pending.add(job.request_id)

        def run() -> None:
            if self.never_finish:
                self._stop.wait()
                return
            time.sleep(self.delay_s)
            fn(job, fail, recv)

        thread = threading.Thread(target=run, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _load(self, job: Job, fail: bool, recv: bool) -> None:
        kv = self._kv
        for i, (block_id, block_hash) in enumerate(job.blocks):
            if fail and i == 0:
                kv[block_id].fill_(float("nan"))  # what a torn transfer leaves behind
                continue
            kv[block_id].copy_(self.store[block_hash])
        with self._lock:
            if fail:
                self._errors.add(job.blocks[0][0])
            if recv:
                self._done_recv.add(job.request_id)
                self._pending.discard(job.request_id)

    def _save(self, job: Job, fail: bool, recv: bool) -> None:
        for block_id, block_hash in job.blocks:
            self.store[block_hash] = self._kv[block_id].clone()
        with self._lock:
            self._done_send.add(job.request_id)
            self._pending.discard(job.request_id)

    def get_finished(self, finished_req_ids):
        with self._lock:
            sending, self._done_send = self._done_send, set()
            recving, self._done_recv = self._done_recv, set()
        return CompletedTransfers(sending, recving)

    def get_block_ids_with_load_errors(self):
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def flush(self, timeout_s):
        self.num_flushes += 1
        deadline = time.monotonic() + timeout_s
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            pending = frozenset(self._pending)
        return FlushReport(not pending, pending)

    def shutdown(self):
        self.num_shutdowns += 1
        SHUTDOWNS.append((self.store_name, self.role))
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=1.0)
        self._threads.clear()
        self._kv = None

    def get_stats(self):
        return {"num_flushes": self.num_flushes, "store_blocks": len(self.store)}
