"""Block ids -> byte ranges for NIXL, with coalescing. Pure numpy; no torch, no nixl.

Descriptor count is what limits transfer speed (see docs/transfer.md), so:
- `coalesce_blocks` turns a (local block ids, remote block ids) pairing into byte ranges, merging
  runs that are adjacent on BOTH sides into one range and splitting ranges longer than
  `max_nbytes`. All arithmetic is vectorized; byte offsets come from `KVCacheLayout`.
- `take_contiguous` is for allocators: it picks block ids from a free set so that they form as
  few runs as possible (ideally one), which is what makes coalescing pay off.
- `range_descs` / `block_descs` turn offsets into NIXL's [N, 3] (addr, nbytes, device_id) arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvbridge.layout import KVCacheLayout


class BlockRanges(NamedTuple):
    """Byte ranges to copy: range i moves nbytes[i] bytes between the two offsets (from each base)."""

    local_offsets: np.ndarray  # [N] int64
    remote_offsets: np.ndarray  # [N] int64
    nbytes: np.ndarray  # [N] int64

    @property
    def num_descriptors(self) -> int:
        return len(self.nbytes)

    @property
    def total_nbytes(self) -> int:
        return int(self.nbytes.sum())


def run_starts(local_ids: np.ndarray, remote_ids: np.ndarray) -> np.ndarray:
    """Indices where a run adjacent on both sides begins. [num_runs] int64; empty input -> empty."""
    if len(local_ids) == 0:
        return np.zeros(0, dtype=np.int64)
    breaks = (np.diff(local_ids) != 1) | (np.diff(remote_ids) != 1)
    return np.flatnonzero(np.concatenate(([True], breaks)))


def coalesce_blocks(
    local_ids,
    remote_ids,
    local_layout: KVCacheLayout,
    remote_layout: KVCacheLayout | None = None,
    max_nbytes: int | None = None,
) -> BlockRanges:
    """Byte ranges that copy remote block remote_ids[i] <-> local block local_ids[i], for every i.

    Consecutive pairs whose ids both grow by one merge into one range; a range never exceeds
    `max_nbytes` (rounded down to whole blocks, at least one block). Raises IndexError for an id
    outside a layout and ValueError for mismatched inputs.
    """
    remote_layout = remote_layout or local_layout
    if local_layout.block_nbytes != remote_layout.block_nbytes:
        raise ValueError(
            f"block sizes differ: local {local_layout.block_nbytes} B, remote {remote_layout.block_nbytes} B"
        )
    local = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    remote = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    if local.shape != remote.shape:
        raise ValueError(f"{len(local)} local block ids but {len(remote)} remote block ids")
    block_nbytes = local_layout.block_nbytes
    starts = run_starts(local, remote)  # [R]
    lengths = np.diff(np.append(starts, len(local)))  # [R] blocks per run
    max_blocks = len(local) + 1 if max_nbytes is None else max(1, max_nbytes // block_nbytes)
    pieces = -(-lengths // max_blocks)  # [R] ranges per run after splitting
    run_of = np.repeat(np.arange(len(starts)), pieces)  # [P] run index of each range
    nth = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # [P] piece within run
    first = starts[run_of] + nth * max_blocks  # [P] index into the id arrays
    num_blocks = np.minimum(max_blocks, lengths[run_of] - nth * max_blocks)  # [P]
    return BlockRanges(
        local_layout.block_offsets(local[first]),
        remote_layout.block_offsets(remote[first]),
        num_blocks * block_nbytes,
    )


def range_descs(offsets: np.ndarray, nbytes: np.ndarray, base_addr: int, device_id: int) -> np.ndarray:
    """NIXL descriptors [N, 3] uint64 = (base_addr + offset, nbytes, device_id)."""
    out = np.empty((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = np.asarray(offsets, dtype=np.uint64) + np.uint64(base_addr)
    out[:, 1] = nbytes
    out[:, 2] = device_id
    return out


def block_descs(layout: KVCacheLayout, base_addr: int, device_id: int) -> np.ndarray:
    """One NIXL descriptor per block of a region: [num_blocks, 3] uint64 (for cached, indexed lists)."""
    offsets = layout.block_offsets(np.arange(layout.num_blocks))
    return range_descs(offsets, np.full(layout.num_blocks, layout.block_nbytes), base_addr, device_id)


def contiguous_runs(sorted_ids) -> tuple[np.ndarray, np.ndarray]:
    """(first id, length) of each run of consecutive ids in a sorted, duplicate-free array."""
    ids = np.asarray(sorted_ids, dtype=np.int64).reshape(-1)
    if len(ids) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    starts = np.flatnonzero(np.concatenate(([True], np.diff(ids) != 1)))
    return ids[starts], np.diff(np.append(starts, len(ids)))


def take_contiguous(free_ids, n: int) -> np.ndarray:
    """Pick `n` ids from `free_ids` in as few runs as possible, returned in ascending run order.

    The smallest run that holds all `n` is used when one exists (best fit, one descriptor);
    otherwise the longest runs are taken first. Raises ValueError when fewer than `n` are free.
    """
    ids = np.unique(np.asarray(free_ids, dtype=np.int64))
    if n > len(ids):
        raise ValueError(f"asked for {n} blocks, only {len(ids)} free")
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    firsts, lengths = contiguous_runs(ids)
    fits = np.flatnonzero(lengths >= n)
    if len(fits):
        best = fits[np.argmin(lengths[fits])]
        return np.arange(firsts[best], firsts[best] + n)
    order = np.argsort(-lengths, kind="stable")
    taken = np.minimum(lengths[order], np.maximum(0, n - (np.cumsum(lengths[order]) - lengths[order])))
    keep = taken > 0
    chosen = sorted(zip(firsts[order][keep], taken[keep]))
    return np.concatenate([np.arange(f, f + k) for f, k in chosen])
