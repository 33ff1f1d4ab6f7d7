"""Worker side of the OffloadingConnector: executes the scheduler side's copy plan asynchronously.

Per step (see `connectors/base.py`): `start_load_kv` starts the planned loads (disk -> host slot
-> GPU block), `wait_for_save` starts the planned stores (GPU block -> host slot, then written
through to disk) after the forward pass was issued, and `get_finished` polls completions without
blocking:

* a request is in `finished_recving` once all its loads ended; failed blocks are reported by
  `get_block_ids_with_load_errors` (the scheduler recomputes them);
* a finished request that had any job is in `finished_sending` once none of its copies is in
  flight any more (the scheduler side delayed freeing its blocks until then).

A host slot is never rewritten while the disk thread still reads it for a write-through: the
copy that overwrites it first waits for that write (a barrier per slot).

Integrity (`verify_kv_digest`, on by default): every block a load brings back is checked against
the digest taken when it was stored (`verify.py`); a block whose bytes differ is a load error.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvbridge import env
from kvbridge.connectors.base import CompletedTransfers, FlushReport
from kvbridge.connectors.latency import LatencyStats
from kvbridge.connectors.offload.config import OffloadConfig
from kvbridge.connectors.offload.copier import make_copier
from kvbridge.connectors.offload.copy_base import BlockCopier, CopyHandle
from kvbridge.connectors.offload.disk_tier import DiskTier
from kvbridge.connectors.offload.host_tier import HostTier
from kvbridge.connectors.offload.metadata import LoadJob, OffloadMetadata, StoreJob
from kvbridge.connectors.offload.verify import LoadVerifier
from kvbridge.errors import TransferTimeoutError
from kvbridge.layout import KVCacheLayout


@dataclass
class _InFlight:
    job: StoreJob | LoadJob
    handle: CopyHandle
    start: float

    @property
    def is_store(self) -> bool:
        return isinstance(self.job, StoreJob)


class OffloadWorker:
    def __init__(
        self, config: OffloadConfig, model_id: str, flush_timeout_s: float, wake: Callable[[], object] = lambda: None
    ) -> None:
        self.config = config
        self._wake = wake  # rung when a copy ends on a copier thread: the engine sees it at once
        self.model_id = model_id
        self.flush_timeout_s = flush_timeout_s
        self.host: HostTier | None = None
        self.copier: BlockCopier | None = None
        self.disk: DiskTier | None = None
        self.block_nbytes = 0
        self._in_flight: list[_InFlight] = []
        self._pending = Counter()  # req id -> copies in flight
        self._seen: set[str] = set()  # requests that had a job (the scheduler delays their free)
        self._finished: set[str] = set()  # finished requests not yet reported in finished_sending
        self._loads_left = Counter()  # req id -> load jobs in flight
        self._recving_done: set[str] = set()
        self._load_errors: set[int] = set()
        self._load_reasons: dict[str, str] = {}  # request id -> why its load failed, until get_load_errors
        self._slot_barriers: dict[int, Future] = {}  # slot -> disk write reading it
        self._stats = Counter()
        self._verifier: LoadVerifier | None = None  # verify_kv_digest
        self._fault_flip_host_bit = env.fault_flip_host_block_bit()
        self._store_latency, self._load_latency = LatencyStats(), LatencyStats()
        # the copies' own time on the device (CUDA: from the end of the work they wait for, as vLLM's
        # OffloadingConnector times its transfers); the latencies above are wall time from the hand-over
        # to the copier, which with CUDA graphs includes the rest of the step's forward pass
        self._store_device, self._load_device = LatencyStats(), LatencyStats()

    # ------------------------------------------------------------------ set-up

    def register_kv_caches(self, kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
        num_slots = self.config.num_host_blocks(layout.block_nbytes)
        pin = self.config.pin_memory if self.config.pin_memory is not None else kv_cache.is_cuda
        self.block_nbytes = layout.block_nbytes
        self.host = HostTier(layout, num_slots, pin_memory=pin)
        if self.config.has_disk:
            self.disk = DiskTier(self.config.disk_dir, layout.compat_hash(self.model_id), layout.block_nbytes,
                                 fault=env.fault_corrupt_disk_file())  # fmt: skip
        if self.config.verify_kv_digest:
            file_of = self.disk.path if self.disk is not None else None
            self._verifier = LoadVerifier(kv_cache, layout, self.host, file_of)
        digest = self._verifier.digest_fn if self._verifier is not None else None
        self.copier = make_copier(
            kv_cache, self.host.pool, self.config.staging_blocks, self.config.copy_threads, digest=digest
        )

    # ------------------------------------------------------------------ per step

    def start_load_kv(self, meta: OffloadMetadata | None) -> None:
        if meta is None or self.copier is None:
            return
        for req_id in meta.wait_for_req_ids:  # preempted: its GPU blocks may be reused by this step
            self._wait_for_request(req_id)
        if self.disk is not None:
            for block_hash in meta.disk_deletes:
                self.disk.submit_delete(block_hash)
        for job in meta.loads:
            self._start_load(job)

    def wait_for_save(self, meta: OffloadMetadata | None) -> None:
        if meta is None or self.copier is None:
            return
        for job in meta.stores:
            self._seen.add(job.req_id)
            self._pending[job.req_id] += 1
            before = self._before_write(job.slots, self.config.debug_store_delay_s)
            start = time.monotonic()  # before the copy is handed over: its threads may finish it at once
            handle = self.copier.store(job.gpu_block_ids, job.slots, None if before is _noop else before)
            handle.on_done(self._wake)
            self._in_flight.append(_InFlight(job, handle, start))
            self._stats["store_jobs"] += 1

    def _start_load(self, job: LoadJob) -> None:
        self._seen.add(job.req_id)
        self._loads_left[job.req_id] += 1
        self._stats["load_jobs"] += 1
        # A slot whose last store failed holds garbage: fail those blocks instead of copying them.
        poisoned = {g for g, s, d in zip(job.gpu_block_ids, job.slots, job.from_disk)
                    if not d and s in self.host.poisoned_slots}  # fmt: skip
        self._load_errors |= set(job.failed_gpu_block_ids) | poisoned
        if job.failed_gpu_block_ids:
            self._fail_load(job.req_id, f"{len(job.failed_gpu_block_ids)} block(s) had no free host slot to load through")
        if poisoned:
            self._fail_load(job.req_id, f"{len(poisoned)} block(s) sit in host slots whose last store failed")
        blocks = [(g, s, h, d) for g, s, h, d in zip(job.gpu_block_ids, job.slots, job.hashes, job.from_disk)
                  if g not in poisoned]  # fmt: skip
        if not blocks:
            self._end_load(job.req_id)
            return
        disk_reads = [(h, s) for _, s, h, d in blocks if d]
        barrier = self._before_write([s for _, s in disk_reads], self.config.debug_load_delay_s)
        disk, host = self.disk, self.host
        # verified here, after the copy into the KV cache, or else by the disk thread as it reads
        check_payload = self._verifier is None

        def before() -> None:
            barrier()
            # FIFO after the writes queued before
            futures = [disk.submit_read(h, host.slot_bytes(s), check_payload) for h, s in disk_reads]
            for (_, slot), future in zip(disk_reads, futures):
                host.digests[slot] = future.result()  # DiskBlockError fails the whole job; its blocks are recomputed

        self._pending[job.req_id] += 1
        gpu_ids, slots = [b[0] for b in blocks], [b[1] for b in blocks]
        start = time.monotonic()
        handle = self.copier.load(slots, gpu_ids, before if disk_reads or barrier is not _noop else None)
        handle.on_done(self._wake)
        self._in_flight.append(_InFlight(job, handle, start))

    def _before_write(self, slots: list[int], delay_s: float):
        """What a copy into `slots` must wait for first: disk writes still reading them, a test delay."""
        barriers = [f for f in (self._slot_barriers.pop(s, None) for s in slots) if f is not None]
        if not barriers and not delay_s:
            return _noop

        def before() -> None:
            for future in barriers:
                future.exception()  # waits; a failed write-through does not fail this copy
            if delay_s:
                time.sleep(delay_s)

        return before

    def _end_load(self, req_id: str) -> None:
        self._loads_left[req_id] -= 1
        if self._loads_left[req_id] <= 0:
            del self._loads_left[req_id]
            self._recving_done.add(req_id)

    # ------------------------------------------------------------------ completion

    def _poll(self) -> int:
        """Retire finished copies; returns how many failed."""
        num_failed, still = 0, []
        for op in self._in_flight:
            if not op.handle.is_done():
                still.append(op)
                continue
            num_failed += op.handle.error is not None
            self._retire(op)
        self._in_flight = still
        return num_failed

    def _retire(self, op: _InFlight) -> None:
        job, failed, elapsed = op.job, op.handle.error is not None, time.monotonic() - op.start
        self._pending[job.req_id] -= 1
        if self._pending[job.req_id] <= 0:
            del self._pending[job.req_id]
        nbytes = len(job.gpu_block_ids) * self.block_nbytes
        if op.is_store:
            if failed:
                self._stats["store_failures"] += 1
                self.host.poisoned_slots.update(job.slots)
                for slot in job.slots:
                    self.host.digests.pop(slot, None)
                return
            self.host.poisoned_slots.difference_update(job.slots)
            if self._verifier is not None:
                self._verifier.record(job, op.handle)
            if self._fault_flip_host_bit:  # fault injection (tests): host memory rots after the store
                self.host.slot_bytes(job.slots[0])[self.block_nbytes // 2] ^= 0x10
            self._stats["bytes_stored"] += nbytes
            self._stats["blocks_stored"] += len(job.slots)
            self._store_latency.add(elapsed)
            if (device_s := op.handle.device_seconds()) is not None:
                self._store_device.add(device_s)
            if self.disk is not None:
                for block_hash, slot, write in zip(job.hashes, job.slots, job.write_to_disk):
                    if write:
                        self._slot_barriers[slot] = self.disk.submit_write(
                            block_hash, self.host.slot_bytes(slot), self.host.digests.get(slot)
                        )
        else:
            if failed:
                self._stats["load_failures"] += 1
                self._load_errors.update(job.gpu_block_ids)
                self._fail_load(job.req_id, f"the copy from the host tier failed: {op.handle.error}")
            else:
                self.host.poisoned_slots.difference_update(s for s, d in zip(job.slots, job.from_disk) if d)
                if self._verifier is not None and (bad := self._verifier.check(job, op.handle)):
                    self._load_errors |= bad
                    self._fail_load(job.req_id, f"{len(bad)} block(s) differ from the digest taken when they were stored")
                self._stats["bytes_loaded"] += nbytes
                self._stats["blocks_loaded"] += len(job.gpu_block_ids)
                self._load_latency.add(elapsed)
                if (device_s := op.handle.device_seconds()) is not None:
                    self._load_device.add(device_s)
            self._end_load(job.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> CompletedTransfers:
        self._finished |= finished_req_ids & self._seen
        self._poll()
        # A request aborted while loading is named here too: the engine holds its blocks until its
        # load ends (finished_recving), apart from any store that delays their free (finished_sending).
        recving, self._recving_done = self._recving_done, set()
        sending = {r for r in self._finished if r not in self._pending and r not in self._loads_left}
        self._finished -= sending
        self._seen -= sending
        return CompletedTransfers(sending, recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_load_errors(self) -> dict[str, str]:
        reasons, self._load_reasons = self._load_reasons, {}
        return reasons

    def _fail_load(self, req_id: str, reason: str) -> None:
        known = self._load_reasons.get(req_id)
        self._load_reasons[req_id] = f"{known}; {reason}" if known else f"offload tier load: {reason}"

    def _wait_for_request(self, req_id: str) -> None:
        deadline = time.monotonic() + self.flush_timeout_s
        for op in [op for op in self._in_flight if op.job.req_id == req_id and op.is_store]:
            if not op.handle.wait(deadline - time.monotonic()):
                raise TransferTimeoutError(
                    f"offload stores of preempted request {req_id!r} still run after {self.flush_timeout_s}s; "
                    "the host or disk tier is stuck (raise KVTransferConfig.flush_timeout_s or check the disk)"
                )
        self._poll()

    def flush(self, timeout_s: float) -> FlushReport:
        deadline = time.monotonic() + timeout_s
        for op in list(self._in_flight):  # blocks on each copy in turn, no polling
            op.handle.wait(deadline - time.monotonic())
        num_failed = self._poll()
        if not self._in_flight and self.disk is not None:  # write-through done too: a restart finds it
            if not self.disk.drain(max(0.0, deadline - time.monotonic())):
                return FlushReport(False, frozenset(), num_failed)
            self._slot_barriers.clear()
        if self._in_flight:
            return FlushReport(False, frozenset(op.job.req_id for op in self._in_flight), num_failed)
        return FlushReport(True, frozenset(), num_failed)

    def shutdown(self) -> None:
        if self.copier is None:
            return
        result = self.flush(self.flush_timeout_s)
        if result.is_complete:
            self.copier.close()
        if self.disk is not None:
            self.disk.close()
        self.copier = None
        self.host.free()  # after the copies that touch it finished (or were abandoned at the deadline)

    def get_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = dict(self._stats)
        stats["store_latency"] = self._store_latency.summary()
        stats["load_latency"] = self._load_latency.summary()
        for way, device in (("store", self._store_device), ("load", self._load_device)):
            if device.count:
                stats[f"{way}_device_latency"] = device.summary()
        stats["in_flight_copies"] = len(self._in_flight)
        if self.host is not None:
            stats["host_pool_bytes"] = self.host.nbytes if self.host.pool is not None else 0
            stats["host_pool_pinned"] = self.host.is_pinned
        if self.disk is not None:
            stats.update(self.disk.get_stats())
        if self._verifier is not None:
            stats.update(self._verifier.get_stats())
        return stats

    def check_integrity(self) -> None:
        if self.host is not None:
            self.host.check_integrity()
        if any(n <= 0 for n in self._pending.values()):
            raise AssertionError("offload worker: a non-positive in-flight count")
        if sum(self._pending.values()) != len(self._in_flight):
            raise AssertionError("offload worker: in-flight counts differ from the copies in flight")


def _noop() -> None:
    pass
