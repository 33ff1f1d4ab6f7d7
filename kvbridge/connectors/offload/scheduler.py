"""Scheduler side of the OffloadingConnector: pure bookkeeping, no torch, no I/O per step.

It owns the tiers' indexes (which hash is in which host slot, which hashes are on disk), their
capacity and eviction, and plans every copy; the worker side only moves bytes between the GPU
block ids and host slots it is told.

How the two halves stay consistent, using only the channels of the connector API:

* stores: every full block a request computes is planned once as a store into a freshly
  allocated slot (state STORING, invisible). A request that had any job is delay-freed when it
  finishes; the worker reports it in `finished_sending` once all its copies completed, and that
  report makes its stored blocks READY (visible) and, with a disk tier, known to be on disk.
* loads: a lookup finds the run of READY host blocks (or on-disk blocks) after the GPU prefix
  hit; the request parks (`load_async=True`), the blocks are pinned, and `finished_recving`
  unpins them. `invalid_block_ids` name the GPU blocks whose load failed: their tier entries go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbridge.block_hash import BlockHash
from kvbridge.connectors.base import ConnectorRequest, KVConnectorOutput, KVHandoff, MatchResult, SchedulerOutput
from kvbridge.connectors.offload.config import OffloadConfig
from kvbridge.connectors.offload.disk_index import DiskTierIndex, scan_block_files
from kvbridge.connectors.offload.host_index import HostTierIndex, SlotState
from kvbridge.connectors.offload.metadata import LoadJob, OffloadMetadata, StoreJob


@dataclass
class _RequestState:
    num_scanned_blocks: int = 0  # full blocks already considered for a store
    storing: list[BlockHash] = field(default_factory=list)  # stores planned, not yet confirmed
    load: LoadJob | None = None  # planned or in flight
    is_load_emitted: bool = False
    has_jobs: bool = False  # the worker saw a job for it: finishing must wait for its report
    is_finished: bool = False


class OffloadScheduler:
    """Plans stores and loads of the host (and disk) tier for one engine's scheduler."""

    def __init__(self, config: OffloadConfig, block_size: int, block_nbytes: int | None) -> None:
        self.config = config
        self.block_size = block_size
        self.host = HostTierIndex(config.num_host_blocks(block_nbytes), config.eviction_policy)
        self.disk: DiskTierIndex | None = None
        if config.has_disk:
            self.disk = DiskTierIndex(config.num_disk_blocks(block_nbytes), scan_block_files(config.disk_dir))
        self._reqs: dict[str, _RequestState] = {}
        self._matches: dict[str, tuple[int, int, bool]] = {}  # req id -> (first block, number of blocks, any on disk only)
        self._lookups: dict[str, tuple[int, int]] = {}  # req id -> (blocks looked up, blocks hit), latest
        self._failed_blocks: set[int] = set()
        self._stats = dict.fromkeys(
            ("lookup_blocks", "hit_blocks", "disk_hit_blocks", "stores_planned_blocks", "stores_skipped_full_blocks",
             "loads_planned_blocks", "load_failed_blocks"), 0,
        )  # fmt: skip

    # ------------------------------------------------------------------ lookups and loads

    def _is_available(self, block_hash: BlockHash) -> bool:
        if block_hash in self.host:
            return self.host.is_ready(block_hash)
        return self.disk is not None and block_hash in self.disk

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> MatchResult:
        first = num_computed_tokens // self.block_size
        # Every full block, the last one too: the engine still computes the last token (it caps a
        # request's progress at num_tokens - 1) and rewrites that one slot, rather than the whole
        # last block (16 tokens, whose attention reads the context once per token in a graph step).
        # The prompt's last block alone is not worth a load: computed here, it costs no wait.
        last = min(len(request.block_hashes), request.num_tokens // self.block_size)
        num_hit, from_disk = 0, False
        for block_hash in request.block_hashes[first:last]:
            if not self._is_available(block_hash):
                break
            num_hit += 1
            from_disk = from_disk or not self.host.is_ready(block_hash)
        if num_hit == 1 and first + 1 == last and request.num_tokens % self.block_size == 0:
            num_hit = 0  # only the block whose last token is computed anyway
        self._lookups[request.request_id] = (max(0, last - first), num_hit)  # counted at admission
        if num_hit == 0:
            self._matches.pop(request.request_id, None)
            return MatchResult(0, False)
        self._matches[request.request_id] = (first, num_hit, from_disk)
        return MatchResult(num_hit * self.block_size, True)

    def external_source(self, request_id: str) -> str:
        match = self._matches.get(request_id)
        return "disk_tier" if match is not None and match[2] else "host_tier"

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self._count_lookup(request.request_id)
        match = self._matches.pop(request.request_id, None)
        if match is None or num_external_tokens <= 0:
            return
        first, num_hit = match[0], min(match[1], num_external_tokens // self.block_size)
        job = LoadJob(request.request_id, [], [], [], [])
        for i in range(first, first + num_hit):
            block_hash, gpu_block = request.block_hashes[i], block_ids[i]
            slot, from_disk = self._pin_for_load(block_hash)
            if slot is None:
                job.failed_gpu_block_ids.append(gpu_block)
                continue
            job.gpu_block_ids.append(gpu_block)
            job.slots.append(slot)
            job.hashes.append(block_hash)
            job.from_disk.append(from_disk)
        state = self._reqs.setdefault(request.request_id, _RequestState())
        state.load, state.is_load_emitted = job, False
        self._stats["loads_planned_blocks"] += job.num_blocks
        self._stats["disk_hit_blocks"] += sum(job.from_disk)

    def _count_lookup(self, req_id: str) -> None:
        num_lookup, num_hit = self._lookups.pop(req_id, (0, 0))
        self._stats["lookup_blocks"] += num_lookup
        self._stats["hit_blocks"] += num_hit

    def _pin_for_load(self, block_hash: BlockHash) -> tuple[int | None, bool]:
        if self.host.is_ready(block_hash):
            return self.host.pin(block_hash), False
        if self.disk is not None and block_hash in self.disk and block_hash not in self.host:
            slot = self.host.allocate(block_hash, SlotState.LOADING)
            if slot is not None:
                self.disk.pin(block_hash)
            return slot, True
        return None, False

    def _release_load(self, job: LoadJob, failed_gpu_blocks: set[int]) -> None:
        """A load ended: unpin its blocks; drop the tier entries whose bytes proved bad."""
        for gpu_block, block_hash, from_disk in zip(job.gpu_block_ids, job.hashes, job.from_disk):
            is_failed = gpu_block in failed_gpu_blocks
            if from_disk:
                self.disk.unpin(block_hash)
                if is_failed:
                    self.host.discard(block_hash)
                    self.disk.discard(block_hash)  # stale, foreign or corrupt file
                else:
                    self.host.mark_ready(block_hash)  # promoted from disk to host
            else:
                self.host.unpin(block_hash)
                if is_failed:
                    self.host.discard(block_hash)
            self._stats["load_failed_blocks"] += is_failed
        self._stats["load_failed_blocks"] += len(job.failed_gpu_block_ids)

    def _cancel_load(self, job: LoadJob) -> None:
        """A planned load that never reached the worker: give back its pins and slots."""
        for block_hash, from_disk in zip(job.hashes, job.from_disk):
            if from_disk:
                self.disk.unpin(block_hash)
                self.host.discard(block_hash)  # the LOADING slot was never written
            else:
                self.host.unpin(block_hash)

    # ------------------------------------------------------------------ per-step plan

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        meta = OffloadMetadata()
        for req_id, state in self._reqs.items():
            if state.load is not None and not state.is_load_emitted:
                state.is_load_emitted, state.has_jobs = True, True
                meta.loads.append(state.load)
        for req_id in scheduler_output.preempted_req_ids:
            state = self._reqs.get(req_id)
            if state is not None:
                state.num_scanned_blocks = 0  # it recomputes; blocks already in the tier are skipped
                if state.storing:
                    meta.wait_for_req_ids.add(req_id)
        for scheduled in scheduler_output.scheduled:
            job = self._plan_store(scheduled.request, scheduled.start + scheduled.num_new_tokens, scheduled.block_ids)
            if job is not None:
                meta.stores.append(job)
        if self.disk is not None:
            meta.disk_deletes = self.disk.take_deletes()
        return meta

    def _plan_store(self, request: ConnectorRequest, num_computed: int, block_ids: list[int]) -> StoreJob | None:
        state = self._reqs.setdefault(request.request_id, _RequestState())
        num_full = min(num_computed // self.block_size, len(request.block_hashes), len(block_ids))
        job = StoreJob(request.request_id, [], [], [], [])
        for i in range(state.num_scanned_blocks, num_full):
            block_hash = request.block_hashes[i]
            if block_hash in self.host:
                continue
            slot = self.host.allocate(block_hash, SlotState.STORING)
            if slot is None:  # every slot is pinned or in flight: this block is not offloaded
                self._stats["stores_skipped_full_blocks"] += 1
                continue
            job.gpu_block_ids.append(block_ids[i])
            job.slots.append(slot)
            job.hashes.append(block_hash)
            job.write_to_disk.append(self.disk is not None and block_hash not in self.disk)
        state.num_scanned_blocks = max(state.num_scanned_blocks, num_full)
        if not job.slots:
            return None
        state.storing.extend(job.hashes)
        state.has_jobs = True
        self._stats["stores_planned_blocks"] += len(job.slots)
        return job

    # ------------------------------------------------------------------ worker reports

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._failed_blocks |= output.invalid_block_ids
        for req_id in output.finished_recving:
            self._finish_load(req_id)
        for req_id in output.finished_sending:
            state = self._reqs.get(req_id)
            if state is None or not state.is_finished:
                continue
            self._finish_load(req_id)  # aborted while loading
            for block_hash in state.storing:
                self.host.mark_ready(block_hash)
                if self.disk is not None:
                    self.disk.add(block_hash)  # written through by the worker
            del self._reqs[req_id]

    def _finish_load(self, req_id: str) -> None:
        state = self._reqs.get(req_id)
        if state is None or state.load is None or not state.is_load_emitted:
            return
        job, state.load = state.load, None
        self._release_load(job, self._failed_blocks)
        self._failed_blocks -= set(job.gpu_block_ids) | set(job.failed_gpu_block_ids)

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> KVHandoff:
        req_id = request.request_id
        self._matches.pop(req_id, None)
        self._lookups.pop(req_id, None)  # never admitted
        state = self._reqs.get(req_id)
        if state is None:
            return KVHandoff(False, None)
        if state.load is not None and not state.is_load_emitted:  # never reached the worker
            self._cancel_load(state.load)
            state.load = None
        if not state.has_jobs:
            del self._reqs[req_id]
            return KVHandoff(False, None)
        state.is_finished = True
        return KVHandoff(True, None)

    def has_pending_transfers(self) -> bool:
        return any(s.has_jobs and (s.storing or s.load is not None or s.is_finished) for s in self._reqs.values())

    # ------------------------------------------------------------------ introspection

    def get_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = dict(self._stats)
        stats["hit_rate"] = stats["hit_blocks"] / stats["lookup_blocks"] if stats["lookup_blocks"] else 0.0
        stats["host_capacity_blocks"] = self.host.num_slots
        stats["host_used_blocks"] = len(self.host)
        stats["host_evictions"] = self.host.num_evictions
        if self.disk is not None:
            stats["disk_blocks"] = len(self.disk)
            stats["disk_evictions"] = self.disk.num_evictions
        return stats

    def check_integrity(self) -> None:
        self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()
        storing = [h for s in self._reqs.values() for h in s.storing]
        if len(storing) != len(set(storing)):
            raise AssertionError("offload scheduler: a block is being stored by two requests")
        if set(storing) != self.host.hashes_in(SlotState.STORING):
            raise AssertionError("offload scheduler: STORING entries and the requests' planned stores differ")
        pins: dict[BlockHash, int] = {}
        for state in self._reqs.values():
            if state.load is not None:
                for block_hash, from_disk in zip(state.load.hashes, state.load.from_disk):
                    if not from_disk:
                        pins[block_hash] = pins.get(block_hash, 0) + 1
        if pins != self.host.pin_counts():
            raise AssertionError("offload scheduler: host pins do not match the loads in flight")
