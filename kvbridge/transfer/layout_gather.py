"""The staged half of a `layout_plan.ReadPlan`: one gather pass on the reader's device.

After a STAGED plan's reads land in the staging buffer, `apply_gather` moves every atom into the
destination pages with one indexed copy (`index_copy_` of rows), on whichever device holds the
buffers: no Python loop over blocks, layers or heads. When the staging buffer holds exactly the
needed rows in order (`Gather.is_dense`: no gap was read), the pass reads it as is; else the
needed rows are selected first.

`GatherIndex` keeps the plan's index arrays on the device, so a plan executed more than once
(a benchmark, a retried read) pays the host -> device copy of its indices once.

`rebuild_blocks` runs a plan the other way, inside one process: the prefill's blocks rebuilt from
the decode's pages, so that the decode can digest them as the prefill did (the integrity check of
a translated read covers the bytes where they landed).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.kv_shard import KVShard
from kvbridge.transfer.layout_plan import Gather, copy_gather

# widest element that divides a row: fewer, larger elements make the indexed copy cheaper
_ROW_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


class GatherIndex(NamedTuple):
    """A `Gather` on a device."""

    row_nbytes: int
    staging_rows: torch.Tensor | None  # [M] int64; None when dense
    dst_rows: torch.Tensor  # [M] int64

    @classmethod
    def of(cls, gather: Gather, device: torch.device | str) -> GatherIndex:
        staging = None if gather.is_dense else torch.from_numpy(gather.staging_rows).to(device)
        return cls(gather.row_nbytes, staging, torch.from_numpy(gather.dst_rows).to(device))


def _rows(buffer: torch.Tensor, row_nbytes: int) -> torch.Tensor:
    """`buffer` ([n] uint8) as [n // row_nbytes, row] of the widest dtype that divides the row and
    fits the buffer's alignment (trailing bytes short of a row are left out: no atom lies there)."""
    usable = buffer[: buffer.numel() // row_nbytes * row_nbytes]
    for dtype in _ROW_DTYPES:
        size = torch.empty((), dtype=dtype).element_size()
        if row_nbytes % size == 0 and usable.data_ptr() % size == 0:
            return usable.view(dtype).view(-1, row_nbytes // size)
    raise AssertionError("unreachable: uint8 always fits")


def apply_gather(gather: Gather | GatherIndex, staging: torch.Tensor, dst_region: torch.Tensor) -> None:
    """Copy each staged row into its destination row. `staging`: [staging_nbytes] uint8, `dst_region`:
    the destination KV region's bytes ([region_nbytes] uint8), both on the device that runs the pass."""
    index = gather if isinstance(gather, GatherIndex) else GatherIndex.of(gather, dst_region.device)
    if staging.dtype != torch.uint8 or dst_region.dtype != torch.uint8 or staging.dim() != 1 or dst_region.dim() != 1:
        raise ValueError("apply_gather takes flat uint8 buffers (tensor.view(torch.uint8).reshape(-1))")
    src = _rows(staging, index.row_nbytes)
    dst = _rows(dst_region, index.row_nbytes)
    if src.dtype != dst.dtype:  # different alignments: both as bytes
        src, dst = _rows_as_bytes(staging, index.row_nbytes), _rows_as_bytes(dst_region, index.row_nbytes)
    if index.staging_rows is not None:
        src = src.index_select(0, index.staging_rows)
    else:
        src = src[: len(index.dst_rows)]
    dst.index_copy_(0, index.dst_rows, src)


def _rows_as_bytes(buffer: torch.Tensor, row_nbytes: int) -> torch.Tensor:
    return buffer[: buffer.numel() // row_nbytes * row_nbytes].view(-1, row_nbytes)


def rebuild_blocks(
    region: torch.Tensor, layout: KVCacheLayout | KVShard, block_ids, peer_layout: KVCacheLayout | KVShard, num_peer_blocks: int
) -> tuple[torch.Tensor, KVCacheLayout]:
    """The peer's first `num_peer_blocks` blocks of a prompt, rebuilt from our blocks `block_ids` that
    hold it (`region`: our KV region's bytes): a [region_nbytes] uint8 buffer on our device laid out
    as `peer_layout.block_major(num_peer_blocks)`, block i = the peer's i-th block. ValueError when our
    blocks do not hold every token of the peer's blocks (or, given as tensor-parallel `KVShard`s, every
    KV head of them)."""
    mine = layout if isinstance(layout, KVShard) else KVShard(layout)
    peer = peer_layout if isinstance(peer_layout, KVShard) else KVShard(peer_layout)
    layout, peer_layout = mine.layout, peer.layout
    if not mine.head_start <= peer.head_start <= peer.head_end <= mine.head_end:
        raise ValueError(
            f"our KV heads [{mine.head_start}, {mine.head_end}) do not hold the peer's [{peer.head_start}, {peer.head_end})"
        )
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    num_tokens = num_peer_blocks * peer_layout.block_size
    if num_peer_blocks <= 0 or len(ids) * layout.block_size < num_tokens:
        raise ValueError(
            f"{len(ids)} blocks of {layout.block_size} tokens do not hold the {num_tokens} tokens of "
            f"{num_peer_blocks} blocks of {peer_layout.block_size}"
        )
    rebuilt = peer_layout.block_major(num_peer_blocks)
    out = torch.zeros(rebuilt.region_nbytes, dtype=torch.uint8, device=region.device)
    rebuilt_shard = KVShard(rebuilt, peer.head_start, peer.num_total_kv_heads)
    gather = copy_gather(rebuilt_shard, np.arange(num_peer_blocks), mine, ids, num_tokens)
    apply_gather(gather, region, out)
    return out, rebuilt
