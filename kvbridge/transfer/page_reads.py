"""The reads of a read plan: which bytes of the prefill's pages a read moves, and where to. Pure numpy.

Both kinds read whole pages (or a head range that is one byte range of a page), never pieces of a
token, so the lists are as long as the pages read and planning never depends on head_dim:

- `direct_reads`, for layouts that agree page for page (same block size and page format, whole
  blocks, each prefill shard's heads one byte range of both pages): each page's bytes go straight
  into the decode's page; runs adjacent on both sides merge.
- `staged_reads`, for any layouts: the pages of the blocks holding the prompt's tokens, whole,
  into a staging buffer laid out like the prefill shard (`staging_layout`), blocks sorted by id so
  that runs of the shard's blocks read as one range (`descriptors.coalesce_blocks`). The gather
  (plan_gather.py) then moves tokens from there into the decode's pages.
Used by transfer/layout_plan.py only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvbridge.block_runs import run_lengths, run_starts
from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.descriptors import coalesce_blocks
from kvbridge.transfer.kv_shard import HeadSpan, KVShard


class Reads(NamedTuple):
    """Byte ranges to read: range i copies nbytes[i] bytes from `remote_offsets[i]` of prefill rank
    `source[i]`'s region to `local_offsets[i]` of the destination region (DIRECT) or of the staging
    buffer (STAGED)."""

    source: np.ndarray  # [N] int64, an index into the plan's sources
    remote_offsets: np.ndarray  # [N] int64
    local_offsets: np.ndarray  # [N] int64
    nbytes: np.ndarray  # [N] int64

    @classmethod
    def concat(cls, parts: Sequence[Reads]) -> Reads:
        return cls(*(np.concatenate([p[i] for p in parts]).astype(np.int64) for i in range(4)))


class StagedShard(NamedTuple):
    """One prefill shard's pages in the staging buffer: staged block k is the shard's block holding
    the prompt's token block `token_blocks[k]`, sorted by the shard's block id."""

    layout: KVCacheLayout  # the staged copy (`staging_layout`)
    offset: int  # bytes from the staging buffer's start to its page (0, 0)
    token_blocks: np.ndarray  # [n] int64


def blocks_needed(layout: KVCacheLayout, block_ids: np.ndarray, num_tokens: int) -> int:
    """Blocks holding tokens [0, num_tokens); ValueError when `block_ids` has fewer, IndexError for an
    id outside the layout."""
    needed = -(-num_tokens // layout.block_size)
    if len(block_ids) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {layout.block_size} tokens, {len(block_ids)} given")
    layout.block_offsets(block_ids[:needed])
    return needed


def staging_layout(layout: KVCacheLayout, num_blocks: int) -> KVCacheLayout:
    """Where `num_blocks` of `layout`'s blocks lie in a staging buffer: block-major when each block is one
    byte range at the source (a run of blocks reads as one range), else layer-major (a run of one
    layer's pages does)."""
    if layout.is_block_contiguous:
        return layout.block_major(num_blocks)
    page = layout.page_nbytes
    return dataclasses.replace(layout, num_blocks=num_blocks, layer_stride=num_blocks * page, block_stride=page)


def staged_reads(
    prefills: Sequence[KVShard], src_ids: Sequence[np.ndarray], spans: Sequence[HeadSpan], num_tokens: int
) -> tuple[Reads, list[StagedShard], int]:
    """The reads of every page the spans' shards hold of the prompt, packed shard after shard into one
    staging buffer; and the buffer's size in bytes."""
    parts, staged, offset = [], [], 0
    for span in spans:
        lay, ids = prefills[span.source].layout, src_ids[span.source]
        needed = blocks_needed(lay, ids, num_tokens)
        token_blocks = np.argsort(ids[:needed], kind="stable")  # runs of the shard's ids become runs of staged blocks
        copy = staging_layout(lay, len(token_blocks))
        ranges = coalesce_blocks(np.arange(len(token_blocks)), ids[token_blocks], copy, lay)
        parts.append(Reads(np.full(ranges.num_descriptors, span.source), ranges.remote_offsets,
                           ranges.local_offsets + offset, ranges.nbytes))  # fmt: skip
        staged.append(StagedShard(copy, offset, token_blocks.astype(np.int64)))
        offset += copy.region_nbytes
    return Reads.concat(parts), staged, offset


def _page_range(shard: KVShard, span: HeadSpan) -> tuple[int, int] | None:
    """(byte offset in a page, bytes) of the span's heads in `shard`'s pages when they are one range:
    all of the shard's heads, or any of them where heads are outermost in a page ("H2ND", "H2ND-KT")."""
    lay = shard.layout
    if (span.head_start, span.head_end) == (shard.head_start, shard.head_end):
        return 0, lay.page_nbytes
    if lay.page_format.startswith("H"):
        per_head = lay.page_nbytes // lay.num_kv_heads
        return (span.head_start - shard.head_start) * per_head, span.num_heads * per_head
    return None


def direct_reads(
    decode: KVShard, dst_ids: np.ndarray, prefills: Sequence[KVShard], src_ids: Sequence[np.ndarray],
    spans: Sequence[HeadSpan], num_tokens: int,
) -> Reads | None:
    """The reads straight into the decode's pages, or None unless the layouts agree page for page: same
    block size and page format, whole blocks only, and each span one byte range of both pages. Sorted by
    source offset, runs adjacent on both sides merge: the fewest descriptors possible."""
    lay = decode.layout
    if num_tokens % lay.block_size:
        return None
    n = blocks_needed(lay, dst_ids, num_tokens)
    parts = []
    for span in spans:
        shard = prefills[span.source]
        src, dst = _page_range(shard, span), _page_range(decode, span)
        same_pages = (shard.layout.block_size, shard.layout.page_format) == (lay.block_size, lay.page_format)
        if not same_pages or src is None or dst is None:
            return None
        blocks_needed(shard.layout, src_ids[span.source], num_tokens)
        remote = (shard.layout.page_offsets(src_ids[span.source][:n]) + src[0]).reshape(-1)  # [n * L]
        local = (lay.page_offsets(dst_ids[:n]) + dst[0]).reshape(-1)
        order = np.argsort(remote, kind="stable")
        remote, local = remote[order], local[order]
        starts = run_starts(remote, local, src[1])
        nbytes = run_lengths(starts, len(remote)) * src[1]
        parts.append(Reads(np.full(len(starts), span.source), remote[starts], local[starts], nbytes))
    return Reads.concat(parts)
