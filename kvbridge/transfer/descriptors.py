"""Block ids -> byte ranges for NIXL, with coalescing. Pure numpy; no torch, no nixl.

Descriptor count is what limits transfer speed (see docs/transfer.md), so:
- `coalesce_blocks` turns a (local block ids, remote block ids) pairing into byte ranges, merging
  units adjacent on BOTH sides into one range and splitting ranges longer than `max_nbytes`.
  All arithmetic is vectorized; byte offsets come from `KVCacheLayout`, runs from `block_runs.py`.
- A unit is what both layouts keep as one byte range: a whole block when each block is
  contiguous on both sides (`Unit.BLOCK`: runs of blocks merge in block-major caches), else one
  page (`Unit.PAGE`, layer by layer: a layer's pages of a run merge where its blocks' pages are
  adjacent on both sides, e.g. between two layer-outermost caches).
- `range_descs` / `block_descs` turn offsets into NIXL's [N, 3] (addr, nbytes, device_id) arrays;
  `unit_indices` names a transfer's entries of a `block_descs` list.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

from kvbridge.block_runs import run_lengths, run_starts
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


class Unit(enum.Enum):
    """What one entry of a transfer covers before merging."""

    BLOCK = "block"  # every page of one block: one byte range on both sides
    PAGE = "page"  # one layer's page of one block


def transfer_unit(local_layout: KVCacheLayout, remote_layout: KVCacheLayout) -> Unit:
    """BLOCK when every block is one byte range in both layouts, else PAGE."""
    return Unit.BLOCK if local_layout.is_block_contiguous and remote_layout.is_block_contiguous else Unit.PAGE


def _unit_nbytes(layout: KVCacheLayout, unit: Unit) -> int:
    return layout.block_nbytes if unit is Unit.BLOCK else layout.page_nbytes


def unit_offsets(layout: KVCacheLayout, block_ids, unit: Unit) -> np.ndarray:
    """Byte offsets of the units of `block_ids`, in transfer order. BLOCK: [n], one per block.
    PAGE: [num_layers * n], layer by layer and in block order within a layer, so that pages of
    consecutive blocks of one layer follow each other. Raises IndexError for an id outside the layout."""
    if unit is Unit.BLOCK:
        return layout.block_offsets(block_ids)
    return layout.page_offsets(block_ids).T.reshape(-1)  # [n, L] -> [L * n]


def unit_indices(layout: KVCacheLayout, block_ids, unit: Unit) -> np.ndarray:
    """Indices into `block_descs(layout, ..., unit)` of the units of `block_ids`, in `unit_offsets` order."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if unit is Unit.BLOCK:
        return ids
    layers = np.arange(layout.num_layers, dtype=np.int64)[:, None]  # [L, 1]
    return (layers * layout.num_blocks + ids).reshape(-1)  # [L * n]: page (l, b) is entry l * num_blocks + b


def _check_same_pages(local_layout: KVCacheLayout, remote_layout: KVCacheLayout) -> None:
    """ValueError unless blocks and pages have the same sizes on both sides."""
    if local_layout.block_nbytes != remote_layout.block_nbytes:
        raise ValueError(
            f"block sizes differ: local {local_layout.block_nbytes} B, remote {remote_layout.block_nbytes} B"
        )
    if local_layout.page_nbytes != remote_layout.page_nbytes:
        raise ValueError(f"page sizes differ: local {local_layout.page_nbytes} B, remote {remote_layout.page_nbytes} B")


def coalesce_blocks(
    local_ids,
    remote_ids,
    local_layout: KVCacheLayout,
    remote_layout: KVCacheLayout | None = None,
    max_nbytes: int | None = None,
) -> BlockRanges:
    """Byte ranges that copy remote block remote_ids[i] <-> local block local_ids[i], for every i.

    The pairs become units (see `transfer_unit`); consecutive units adjacent on both sides merge
    into one range, and a range never exceeds `max_nbytes` (rounded down to whole units, at least
    one unit). Block-major on both sides: one range per run of blocks adjacent on both sides.
    Raises IndexError for an id outside a layout and ValueError for mismatched inputs.
    """
    remote_layout = remote_layout or local_layout
    _check_same_pages(local_layout, remote_layout)
    local = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    remote = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    if local.shape != remote.shape:
        raise ValueError(f"{len(local)} local block ids but {len(remote)} remote block ids")
    unit = transfer_unit(local_layout, remote_layout)
    nbytes = _unit_nbytes(local_layout, unit)
    local_offsets = unit_offsets(local_layout, local, unit)  # [M]
    remote_offsets = unit_offsets(remote_layout, remote, unit)  # [M]
    starts = run_starts(local_offsets, remote_offsets, nbytes)  # [R]
    lengths = run_lengths(starts, len(local_offsets))  # [R] units per run
    max_units = len(local_offsets) + 1 if max_nbytes is None else max(1, max_nbytes // nbytes)
    pieces = -(-lengths // max_units)  # [R] ranges per run after splitting
    run_of = np.repeat(np.arange(len(starts)), pieces)  # [P] run index of each range
    nth = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # [P] piece within run
    first = starts[run_of] + nth * max_units  # [P] index into the unit arrays
    num_units = np.minimum(max_units, lengths[run_of] - nth * max_units)  # [P]
    return BlockRanges(local_offsets[first], remote_offsets[first], num_units * nbytes)


def num_merged_ranges(local_ids: np.ndarray, remote_ids: np.ndarray, local_layout: KVCacheLayout,
                      remote_layout: KVCacheLayout) -> int:
    """How many ranges `coalesce_blocks` gives without a size limit: what NIXL merges a post of
    `unit_indices` into. Ids are not range-checked here."""
    if local_layout.is_contiguous and remote_layout.is_contiguous:
        return len(run_starts(local_ids, remote_ids))  # ids adjacent <=> bytes adjacent: skip the offsets
    unit = transfer_unit(local_layout, remote_layout)
    local = unit_offsets(local_layout, local_ids, unit)
    return len(run_starts(local, unit_offsets(remote_layout, remote_ids, unit), _unit_nbytes(local_layout, unit)))


def region_addresses(offsets, base_addr: int, layer_addrs=(), layer_stride: int = 0) -> np.ndarray:
    """Addresses [N] uint64 of layout byte offsets in a registered region: `base_addr + offset`, or,
    for KV held one layer per allocation (`KVCacheLayout.per_layer`, `KVRegion.layer_addrs`), the
    address in the offset's layer region, `layer_addrs[offset // layer_stride] + offset % layer_stride`.
    A range never spans two layers there: the layout keeps a gap between them."""
    off = np.asarray(offsets, dtype=np.int64)
    if not len(layer_addrs):
        return off.astype(np.uint64) + np.uint64(base_addr)
    bases = np.asarray(layer_addrs, dtype=np.uint64)
    return bases[off // layer_stride] + (off % layer_stride).astype(np.uint64)


def range_descs(offsets: np.ndarray, nbytes: np.ndarray, base_addr: int, device_id: int,
                layer_addrs=(), layer_stride: int = 0) -> np.ndarray:  # fmt: skip
    """NIXL descriptors [N, 3] uint64 = (address of offset, nbytes, device_id); see `region_addresses`."""
    out = np.empty((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = region_addresses(offsets, base_addr, layer_addrs, layer_stride)
    out[:, 1] = nbytes
    out[:, 2] = device_id
    return out


def region_descs(offsets: np.ndarray, nbytes: np.ndarray, region) -> np.ndarray:
    """`range_descs` in a `messages.KVRegion` (one region, or one per layer)."""
    return range_descs(offsets, nbytes, region.base_addr, region.device_id, region.layer_addrs, region.layer_stride)


def block_descs(layout: KVCacheLayout, base_addr: int, device_id: int, unit: Unit = Unit.BLOCK,
                layer_addrs=()) -> np.ndarray:  # fmt: skip
    """One NIXL descriptor per unit of a whole region, for cached lists posted by `unit_indices`:
    BLOCK: [num_blocks, 3], entry b = block b; PAGE: [num_layers * num_blocks, 3], entry
    l * num_blocks + b = page (l, b). `layer_addrs`: one region per layer (`region_addresses`)."""
    offsets = unit_offsets(layout, np.arange(layout.num_blocks), unit)
    nbytes = np.full(len(offsets), _unit_nbytes(layout, unit))
    return range_descs(offsets, nbytes, base_addr, device_id, layer_addrs, layout.layer_stride_bytes)
