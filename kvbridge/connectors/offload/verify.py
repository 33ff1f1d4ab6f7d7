"""The offload tiers verify what they load: a block comes back into the KV cache only with the bytes
it was stored with.

    store completes --record(job, handle)--> each slot keeps the digest of the block it now holds
    disk read       --the file's digest-->   the slot keeps the digest the file carries
    load completes  --check(job, handle)-->  the KV blocks whose bytes differ: load errors

The digests are transfer/digest.py's, with the algorithm of the device that holds the KV cache
(XXH3-64 on CPU, wsum64 on CUDA), computed by the copier as part of each copy (`digest_fn`): of the
blocks a store read, and of the blocks a load wrote, so what is checked is exactly what the engine
will use. A mismatch (a bit flipped in host memory, a file that rotted on disk) is counted per tier
(`host_digest_mismatches`, `disk_digest_mismatches`), named in the log at most once per 30 s and
tier, and returned as a load error: the engine recomputes those tokens and the scheduler side drops
the block from the tiers.

Engine thread only (the disk thread writes a slot's digest through `HostTier.digests` before the
load that reads the slot starts its copy).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
import torch

from kvbridge.connectors.offload.copy_base import CopyHandle, DigestFn
from kvbridge.connectors.offload.host_tier import HostTier
from kvbridge.connectors.offload.metadata import LoadJob, StoreJob
from kvbridge.layout import KVCacheLayout
from kvbridge.repeated_log import RepeatedWarnings
from kvbridge.transfer.digest import (
    BlockDigest,
    BlockDigester,
    DigestError,
    algorithm_for,
    block_digests,
    region_bytes,
)

logger = logging.getLogger(__name__)


class LoadVerifier:
    """Digests of the host tier's slots, and the check of every completed load against them."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVCacheLayout, host: HostTier,
                 file_of: Callable[[bytes], str] | None = None) -> None:  # fmt: skip
        """`file_of`: a block hash's disk file, named in the log."""
        self.alg = algorithm_for(kv_cache)
        self._region = region_bytes(kv_cache, layout)  # [region_nbytes] uint8
        self._layout, self._host, self._file_of = layout, host, file_of
        self._warnings = RepeatedWarnings(logger)
        self._num_mismatches = {"host": 0, "disk": 0}  # blocks refused, by the tier they came from

    @property
    def digest_fn(self) -> DigestFn:
        """What the copier digests the KV-cache side of each copy with."""
        return BlockDigester(self._region, self._layout, self.alg)

    def record(self, job: StoreJob, handle: CopyHandle) -> None:
        """A store completed: each slot keeps the digest of the block it now holds."""
        digests = handle.digests()  # gpu block -> digest of the bytes the store read
        for gpu_block, slot in zip(job.gpu_block_ids, job.slots):
            self._host.digests[slot] = BlockDigest(self.alg, digests[gpu_block])

    def check(self, job: LoadJob, handle: CopyHandle) -> set[int]:
        """The GPU blocks of a completed load whose bytes differ from their slot's digest: counted per
        tier, named in the log, returned as load errors (never used as KV)."""
        digests = handle.digests()  # gpu block -> digest of the bytes the load wrote into it
        bad: dict[str, list[tuple[int, bytes]]] = {"host": [], "disk": []}
        for gpu_block, slot, block_hash, from_disk in zip(job.gpu_block_ids, job.slots, job.hashes, job.from_disk):
            if gpu_block not in digests:
                continue  # not copied (its slot was poisoned): a load error already
            expected = self._host.digests.get(slot)
            if expected is None or self._digest_of(gpu_block, expected.alg, digests) != expected.value:
                bad["disk" if from_disk else "host"].append((gpu_block, block_hash))
        for tier, blocks in bad.items():
            if blocks:
                self._report(tier, blocks, job)
        return {gpu_block for blocks in bad.values() for gpu_block, _ in blocks}

    def _digest_of(self, gpu_block: int, alg: str, digests: dict[int, int]) -> int | None:
        """The digest with `alg` of a KV block a load wrote: the copy's own, or (a file that an engine
        on another kind of device wrote) computed now."""
        if alg == self.alg:
            return digests[gpu_block]
        try:
            return block_digests(self._region, self._layout, [gpu_block], alg).values[0]
        except DigestError:
            return None

    def _report(self, tier: str, blocks: list[tuple[int, bytes]], job: LoadJob) -> None:
        self._num_mismatches[tier] += len(blocks)
        gpu_block, block_hash = blocks[0]
        where = f"file {self._file_of(block_hash)}" if tier == "disk" and self._file_of else f"block {block_hash.hex()}"
        self._warnings.warning(
            tier, "OFFLOAD DIGEST MISMATCH: %d of %d blocks loaded from the %s tier (request %s) do not hold the "
            "bytes that were stored (first: %s -> KV block %d, %s); recomputed instead and dropped from the tier",
            len(blocks), len(job.gpu_block_ids), tier, job.req_id, where, gpu_block, self.alg,
        )  # fmt: skip

    def get_stats(self) -> dict[str, int]:
        """On /metrics from the start, at 0 (kvbridge_engine_connector_worker_host_digest_mismatches)."""
        return {f"{tier}_digest_mismatches": n for tier, n in self._num_mismatches.items()}
