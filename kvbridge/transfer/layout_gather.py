"""The staged half of a `layout_plan.ReadPlan`: one gather pass on the reader's device.

After a STAGED plan's reads land in the staging buffer, `apply_gather` moves the prompt's tokens
into the destination pages with one indexed copy per piece of the plan's `plan_gather.Gather`
(per prefill rank: the whole blocks, and the tail), and per K|V half only where a page format keeps
K transposed: no Python loop over blocks, layers, tokens or heads. Each side is a strided view of
its bytes, [block, chunk, layer, (K|V,) token, head, dim], built from `KVCacheLayout.page_dim_strides`
(a transposed K is only other strides), of the widest integer that the contiguous head_dim and
every offset allow; the indices name blocks and token chunks, never elements.

`GatherIndex` keeps the plan's index arrays on the device, so a plan executed more than once
(a benchmark, a retried read) pays the host -> device copy of its indices once.

`rebuild_blocks` runs a gather the other way, inside one process: the prefill's blocks rebuilt
from the decode's pages, so that the decode can digest them as the prefill did (the integrity check
of a translated read covers the bytes where they landed).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.kv_shard import KVShard
from kvbridge.transfer.layout_plan import copy_gather
from kvbridge.transfer.plan_gather import Gather, GatherPiece

# integer dtypes by width: a copy moves bits, and wider words make fewer elements to index
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class GatherIndex(NamedTuple):
    """A `Gather` with its indices on a device: per piece, the indexed side's blocks and chunks."""

    gather: Gather
    blocks: tuple[torch.Tensor, ...]  # per piece [n, tokens_per_block // chunk] int64
    chunks: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, gather: Gather, device: torch.device | str) -> GatherIndex:
        def on(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        return cls(gather, tuple(on(p.blocks) for p in gather.pieces), tuple(on(p.chunks) for p in gather.pieces))


class _Side(NamedTuple):
    """One side of a piece as a strided view: sizes and byte strides of [block, chunk, layer, (kv,)
    token, head, dim], and the byte offset of its first element."""

    sizes: list[int]
    strides: list[int]
    offset: int


def _side(lay: KVCacheLayout, num_blocks: int, num_chunks: int, chunk: int, num_heads: int, halves: list[int],
          offset: int, first_head: int) -> _Side:  # fmt: skip
    """The view of `halves` ([0, 1]: K and V as one dimension; [0] or [1]: one of them) of `num_heads`
    heads from `first_head` on, for blocks and chunks of `chunk` tokens."""
    kv_stride, strides = lay.page_dim_strides()
    token, head, dim = strides[halves[0]]
    kv = [(2, kv_stride)] if len(halves) == 2 else []
    dims = [(num_blocks, lay.block_stride_bytes), (num_chunks, chunk * token), (lay.num_layers, lay.layer_stride_bytes),
            *kv, (chunk, token), (num_heads, head), (lay.head_dim, dim)]  # fmt: skip
    return _Side([n for n, _ in dims], [s for _, s in dims], offset + first_head * head + halves[0] * kv_stride)


def _word_size(a: _Side, b: _Side, buffers: tuple[torch.Tensor, torch.Tensor], element_size: int) -> int:
    """The widest word both views can be read in: head_dim contiguous on both sides, every stride,
    offset and buffer address a multiple of it. Else the element."""
    if a.strides[-1] != element_size or b.strides[-1] != element_size:
        return element_size
    row = a.sizes[-1] * element_size
    values = [row, *a.strides[:-1], a.offset, *b.strides[:-1], b.offset, *(t.data_ptr() for t in buffers)]
    return next(w for w in _WORDS if all(v % w == 0 for v in values))


def _view(buffer: torch.Tensor, side: _Side, word: int, element_size: int) -> torch.Tensor:
    words = buffer[: buffer.numel() // word * word].view(_WORDS[word])
    sizes, strides = list(side.sizes), [s // word for s in side.strides]
    if word != element_size:  # head_dim contiguous: read as fewer, wider words
        sizes[-1], strides[-1] = sizes[-1] * element_size // word, 1
    return words.as_strided(sizes, strides, words.storage_offset() + side.offset // word)


def _copy_piece(piece: GatherPiece, indexed: KVCacheLayout, plain_is_source: bool, plain_buf: torch.Tensor,
                indexed_buf: torch.Tensor, blocks: torch.Tensor, chunks: torch.Tensor) -> None:  # fmt: skip
    lay, c, e = piece.plain, piece.chunk, indexed.element_size
    same_halves = all(len(set(x.page_dim_strides()[1])) == 1 for x in (lay, indexed))  # K strided as V on both sides
    for halves in ([0, 1],) if same_halves else ([0], [1]):
        plain_offset = piece.plain_offset + piece.first_block * lay.block_stride_bytes
        n = piece.num_heads
        plain = _side(lay, len(piece.blocks), piece.tokens_per_block // c, c, n, halves, plain_offset, piece.plain_head)
        other = _side(indexed, indexed.num_blocks, indexed.block_size // c, c, n, halves, 0, piece.indexed_head)
        word = _word_size(plain, other, (plain_buf, indexed_buf), e)
        plain_view, indexed_view = _view(plain_buf, plain, word, e), _view(indexed_buf, other, word, e)
        index = (blocks, chunks)
        if indexed.block_size == c:  # one chunk per indexed block: one index per element to look up, not two
            indexed_view, index = indexed_view[:, 0], (blocks,)
        if plain_is_source:  # [n, k, L, (2,) c, heads, dim] into the indexed blocks and chunks
            indexed_view.index_put_(index, plain_view)
        else:
            plain_view.copy_(indexed_view[index])


def apply_gather(gather: Gather | GatherIndex, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Run a gather from `src` into `dst`, both flat uint8 buffers on the device that runs the pass
    (tensor.view(torch.uint8).reshape(-1)): for a staged read, the staging buffer into the destination
    KV region. Bytes outside the gather's tokens and heads are left as they are."""
    index = gather if isinstance(gather, GatherIndex) else GatherIndex.of(gather, dst.device)
    for t in (src, dst):
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise ValueError("apply_gather takes flat uint8 buffers (tensor.view(torch.uint8).reshape(-1))")
        if t.data_ptr() % index.gather.indexed.element_size:
            raise ValueError(f"apply_gather needs buffers aligned to the {index.gather.indexed.element_size}-byte element")
    g = index.gather
    plain_buf, indexed_buf = (src, dst) if g.plain_is_source else (dst, src)
    for piece, blocks, chunks in zip(g.pieces, index.blocks, index.chunks):
        _copy_piece(piece, g.indexed, g.plain_is_source, plain_buf, indexed_buf, blocks, chunks)


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
