"""`FileTierConnector`: KV blocks as files, one per block, named by the block's chained hash.

Scheduler half: knows which hashes are on disk (the directory listed once, at construction, plus
every store it planned since), offers a waiting request the run of its blocks found there, and
plans loads and stores. Worker half: reads and writes the files on `io_threads` threads, in the
order they were planned per thread, and reports what finished. A file that cannot be read whole
is a load error: the engine recomputes those blocks.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
import torch

from kvbridge.connectors.base import (
    CompletedTransfers,
    FlushReport,
    KVConnectorMetadata,
    KVHandoff,
    MatchResult,
    RequestStatus,
)
from kvbridge.connectors.options import options_from_extra
from kvbridge.connectors.split import SplitConnector
from kvbridge.errors import ConfigError


@dataclass(frozen=True)
class FileTierOptions:
    dir: str | None = None
    io_threads: int = 1
    debug_fail_loads: bool = False  # test hook: every load reports its first block failed

    def __post_init__(self) -> None:
        if not self.dir:
            raise ConfigError('FileTierConnector needs extra.dir, the directory of its files, e.g. {"dir": "/tmp/kv"}')
        if not isinstance(self.io_threads, int) or self.io_threads < 1:
            raise ConfigError(f"FileTierConnector: extra.io_threads must be a positive integer, got {self.io_threads!r}")


@dataclass
class FileJob:
    request_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class FilePlan(KVConnectorMetadata):
    loads: list[FileJob] = field(default_factory=list)
    stores: list[FileJob] = field(default_factory=list)


def _path(directory: str, block_hash: bytes) -> str:
    return os.path.join(directory, block_hash.hex() + ".kv")


class FileScheduler:
    def __init__(self, options: FileTierOptions, block_size: int) -> None:
        self.block_size = block_size
        os.makedirs(options.dir, exist_ok=True)
        self.on_disk = {bytes.fromhex(n[:-3]) for n in os.listdir(options.dir) if n.endswith(".kv")}
        self.matched: dict[str, int] = {}
        self.plan = FilePlan()
        self.in_flight: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # the last prompt token is always computed
        hits = 0
        while first + hits < last and request.block_hashes[first + hits] in self.on_disk:
            hits += 1
        self.matched[request.request_id] = first
        return MatchResult(hits * self.block_size, True)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        first = self.matched.pop(request.request_id, 0)
        if num_external_tokens:
            n = num_external_tokens // self.block_size
            self.plan.loads.append(FileJob(request.request_id, block_ids[first:first + n],
                                           list(request.block_hashes[first:first + n])))  # fmt: skip
            self.in_flight.add(request.request_id)

    def build_connector_meta(self, scheduler_output):
        plan, self.plan = self.plan, FilePlan()
        return plan

    def update_connector_output(self, output):
        self.in_flight -= output.finished_sending | output.finished_recving

    def request_finished(self, request, block_ids):
        if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return KVHandoff(False, None)  # aborted or failed: its KV may be incomplete
        n = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        todo = [i for i in range(n) if request.block_hashes[i] not in self.on_disk]
        if not todo:
            return KVHandoff(False, None)
        job = FileJob(request.request_id, [block_ids[i] for i in todo], [request.block_hashes[i] for i in todo])
        self.on_disk.update(job.hashes)  # loads planned from now on queue behind this store
        self.plan.stores.append(job)
        self.in_flight.add(request.request_id)
        return KVHandoff(True, None)  # the blocks stay ours until the files are written

    def has_pending_transfers(self):
        return bool(self.in_flight)

    def get_stats(self):
        return {"blocks_on_disk": len(self.on_disk)}


class FileWorker:
    def __init__(self, options: FileTierOptions) -> None:
        self.options = options
        self.kv: torch.Tensor | None = None
        # One queue per thread; a block's store and its later loads go to the same one, in order.
        self.pools: list[ThreadPoolExecutor] = []
        self.futures: dict[Future, str] = {}
        self.lock = threading.Lock()
        self.sent: set[str] = set()
        self.received: set[str] = set()
        self.errors: set[int] = set()
        self.stats = {"blocks_loaded": 0, "blocks_stored": 0, "load_errors": 0}

    def register_kv_caches(self, kv_cache, layout):
        self.kv = kv_cache
        self.pools = [ThreadPoolExecutor(1, thread_name_prefix="file-tier") for _ in range(self.options.io_threads)]

    def _submit(self, fn, job: FileJob) -> None:
        pool = self.pools[int.from_bytes(job.hashes[0][:4], "little") % len(self.pools)]
        self.futures[pool.submit(fn, job)] = job.request_id

    def start_load_kv(self, metadata):
        for job in metadata.loads if metadata else ():
            self._submit(self._load, job)

    def wait_for_save(self, metadata):
        for job in metadata.stores if metadata else ():
            self._submit(self._store, job)

    def _store(self, job: FileJob) -> None:
        for block_id, block_hash in zip(job.block_ids, job.hashes):
            data = self.kv[block_id].contiguous().cpu().numpy().tobytes()
            path = _path(self.options.dir, block_hash)
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)  # a reader sees the whole file or none
        with self.lock:
            self.stats["blocks_stored"] += len(job.block_ids)
            self.sent.add(job.request_id)

    def _load(self, job: FileJob) -> None:
        failed: set[int] = set()
        for i, (block_id, block_hash) in enumerate(zip(job.block_ids, job.hashes)):
            block = self.kv[block_id]
            try:
                if self.options.debug_fail_loads and i == 0:
                    raise OSError("debug_fail_loads")
                data = np.fromfile(_path(self.options.dir, block_hash), dtype=np.uint8)
                if data.size != block.numel() * block.element_size():
                    raise OSError(f"{data.size} bytes, expected {block.numel() * block.element_size()}")
                block.copy_(torch.from_numpy(data).view(block.dtype).view(block.shape))
            except OSError:
                failed.add(block_id)
        with self.lock:
            self.errors |= failed
            self.stats["load_errors"] += len(failed)
            self.stats["blocks_loaded"] += len(job.block_ids) - len(failed)
            self.received.add(job.request_id)  # also when a block failed: nothing writes into them any more

    def get_finished(self, finished_req_ids):
        self.futures = {f: r for f, r in self.futures.items() if not f.done()}
        with self.lock:
            sent, self.sent = self.sent, set()
            received, self.received = self.received, set()
        return CompletedTransfers(sent, received)

    def get_block_ids_with_load_errors(self):
        with self.lock:
            errors, self.errors = self.errors, set()
        return errors

    def flush(self, timeout_s):
        wait(list(self.futures), timeout=timeout_s)
        pending = frozenset(r for f, r in self.futures.items() if not f.done())
        return FlushReport(not pending, pending)

    def shutdown(self):
        for pool in self.pools:
            pool.shutdown(wait=True)
        self.pools, self.futures, self.kv = [], {}, None

    def get_stats(self):
        with self.lock:
            return dict(self.stats)


class FileTierConnector(SplitConnector):
    metadata_type = FilePlan

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        options_from_extra(FileTierOptions, config.extra, "FileTierConnector")

    def make_scheduler_half(self):
        return FileScheduler(options_from_extra(FileTierOptions, self.config.extra, "FileTierConnector"),
                             self.context.block_size)  # fmt: skip

    def make_worker_half(self):
        return FileWorker(options_from_extra(FileTierOptions, self.config.extra, "FileTierConnector"))
