"""The gather of a read plan: which tokens move between two paged buffers, as block indices. Pure numpy.

A gather moves every layer, K|V, head_dim element of a range of heads for a range of tokens between
a *plain* side, read (or written) as one strided view of consecutive blocks, and an *indexed* side,
whose blocks are named per token chunk. Token t lives in block t // B and slot t % B of a side of
block size B; tokens move in chunks of c = gcd(both block sizes) tokens, which never cross a block
on either side, so the indices are [blocks, B / c] per piece: O(tokens), never O(elements), whatever
the page formats (a transposed K included: layout_gather.py builds the views from
`KVCacheLayout.page_dim_strides`).

- a STAGED read: the staging buffer (one plain side per prefill shard, `page_reads.StagedShard`)
  -> the decode's pages (indexed by the decode's block ids);
- `rebuild_blocks` of a digest check: the reader's pages (indexed) -> a block-major copy of the
  prefill's blocks (plain).
Used by transfer/layout_plan.py; executed by transfer/layout_gather.py.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from kvbridge.layout import KVCacheLayout


class GatherPiece(NamedTuple):
    """One indexed copy: slots [0, tokens_per_block) of the plain side's blocks [first_block,
    first_block + len(blocks)), in chunks of `chunk` tokens, against the indexed side's block
    `blocks[i, j]`, chunk `chunks[i, j]` (slots [chunk * c, (chunk + 1) * c)), for `num_heads` heads."""

    plain: KVCacheLayout
    plain_offset: int  # bytes from the plain buffer's start to this layout's page (0, 0)
    first_block: int
    tokens_per_block: int  # a multiple of chunk
    chunk: int
    plain_head: int  # first head, counted in the plain side's pages
    indexed_head: int  # the same head, counted in the indexed side's pages
    num_heads: int
    blocks: np.ndarray  # [num_blocks, tokens_per_block // chunk] int64, the indexed side's block ids
    chunks: np.ndarray  # [num_blocks, tokens_per_block // chunk] int64, chunk index within that block


class Gather(NamedTuple):
    """Every piece of one gather. `plain_is_source`: the plain sides are read and the indexed side
    (`indexed`, a whole region's layout) is written (a staged read), else the reverse (a rebuild)."""

    indexed: KVCacheLayout
    plain_is_source: bool
    pieces: tuple[GatherPiece, ...]

    @property
    def num_indices(self) -> int:
        return sum(p.blocks.size for p in self.pieces)


def gather_pieces(
    plain: KVCacheLayout, plain_offset: int, token_blocks: np.ndarray,
    indexed: KVCacheLayout, indexed_ids: np.ndarray, num_tokens: int, heads: tuple[int, int, int],
) -> list[GatherPiece]:
    """The pieces that move tokens [0, num_tokens) between `plain`'s blocks, block k holding the
    prompt's token block `token_blocks[k]`, and the indexed side's blocks `indexed_ids` (in token
    order). `heads`: (plain head, indexed head, number of heads). The whole blocks on either side of
    the tail's block (the prompt's last, partly filled) are a piece each, the tail one more."""
    size, chunk = plain.block_size, math.gcd(plain.block_size, indexed.block_size)
    num_full, tail = divmod(num_tokens, size)

    def piece(first: int, last: int, num_slots: int, c: int) -> GatherPiece:
        starts = token_blocks[first:last, None] * size + np.arange(0, num_slots, c, dtype=np.int64)  # [n, slots / c] chunk starts
        blocks, slots = np.divmod(starts, indexed.block_size)
        return GatherPiece(plain, plain_offset, first, num_slots, c, *heads, indexed_ids[blocks], slots // c)

    at_tail = int(np.flatnonzero(token_blocks == num_full)[0]) if tail else len(token_blocks)
    whole = ((0, at_tail), (at_tail + 1, len(token_blocks)))
    pieces = [piece(first, last, size, chunk) for first, last in whole if last > first]
    if tail:  # chunks of gcd(chunk, tail) tokens: none passes the prompt's last token
        pieces.append(piece(at_tail, at_tail + 1, tail, math.gcd(chunk, tail)))
    return pieces
