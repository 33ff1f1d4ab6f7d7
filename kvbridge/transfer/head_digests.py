"""Per-head digests of KV blocks: what a reader holding only some of an owner's KV heads checks.

A decode of wider tensor parallelism than its prefill (TP 1 -> 2) reads only some heads of each of
the prefill's pages, so the whole-block digests (digest.py) cannot check it: the owner also returns,
with each lease, a digest per head (`KVDigest.head_values[h][i]`).

wsum64 splits by head for free: a head's digest is its words' share of the block's sum, each word
weighted with its multiplier *in the whole block* (`head_multipliers`), so a block's heads add up to
its digest mod 2^64 and one pass over the bytes yields both (the kernel of wsum_kernel.py, or one
product and two reductions). xxh3-64 cannot be split: each head's bytes (its pages narrowed to the
head, in layer order) are hashed again from one head-major copy of the blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvbridge.block_runs import run_starts
from kvbridge.layer_tensors import LayerTensors
from kvbridge.layout import OPAQUE_FORMATS
from kvbridge.transfer.digest import (
    _MASK64,
    _WSUM_CHUNK_NBYTES,
    WSUM,
    DigestError,
    DigestJob,
    _multipliers,
    block_digests,
    device_index,
    gathered_blocks,
    has_wsum_kernel,
)
from kvbridge.transfer.messages import KVDigest

if TYPE_CHECKING:
    import torch

    from kvbridge.layout import KVCacheLayout


def lease_digests(region: torch.Tensor, layout: KVCacheLayout, block_ids, alg: str) -> KVDigest:
    """Each block's digest and each of its KV heads' (`head_values[h][i]`): what an owner returns with a
    lease, so that a reader holding only some heads (a wider tensor-parallel decode) can check them
    (see the module doc). Pages of one head, or whose interior is not mapped, get no head digests.
    Raises DigestError or IndexError."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    if layout.num_kv_heads == 1 or layout.page_format in OPAQUE_FORMATS:
        return block_digests(region, layout, ids, alg)
    if isinstance(region, LayerTensors):
        return _gathered_lease_digests(region, layout, ids, alg)
    if alg == WSUM:
        layout.page_offsets(ids)  # raises IndexError
        heads = _wsum_heads(region, layout, ids)  # [n, H] int64
        whole = DigestJob(WSUM, sums=heads.sum(dim=1)).result()  # int64, wraps mod 2^64
        per_head = [[v & _MASK64 for v in column] for column in heads.t().tolist()]
        return KVDigest(alg=WSUM, values=whole.values, head_values=per_head)
    whole = block_digests(region, layout, ids, alg)
    return KVDigest(alg=alg, values=whole.values, head_values=_xxh3_heads(region, layout, ids))


def _gathered_lease_digests(layers: LayerTensors, layout: KVCacheLayout, ids: np.ndarray, alg: str) -> KVDigest:
    """`lease_digests` of blocks held one tensor per layer (vLLM's default model runner), gathered a chunk
    at a time (`gathered_blocks`): a block-major buffer's blocks have the same bytes and heads."""
    layout.page_offsets(ids)  # raises IndexError
    values: list[int] = []
    heads: list[list[int]] = [[] for _ in range(layout.num_kv_heads)]
    for flat, chunk in gathered_blocks(layers, layout, ids):
        part = lease_digests(flat, chunk, np.arange(chunk.num_blocks), alg)
        values += part.values
        for head, part_values in zip(heads, part.head_values):
            head += part_values
    return KVDigest(alg=alg, values=values, head_values=heads)


def head_multipliers(layout: KVCacheLayout, head: int, device) -> torch.Tensor:
    """[num_layers * page_words / num_kv_heads] int64: the wsum64 multipliers of head `head`'s words of a
    block of `layout`, in the order of that head's own pages (what a reader rebuilds as the head)."""
    outer, num_heads, inner = _head_split(layout)
    c = _multipliers(layout.num_layers * layout.page_nbytes // 4, device)
    return c.view(layout.num_layers, outer, num_heads, inner)[:, :, head].reshape(-1)


def head_block_digests(blocks: torch.Tensor, head_layout: KVCacheLayout, owner: KVCacheLayout, head: int, alg: str) -> list[int]:
    """The digests of `head` of `owner`'s pages, from `blocks` ([n * block_nbytes] uint8 of a one-head
    `head_layout`, block-major: the head as a reader rebuilt it), as `lease_digests` gives them."""
    ids = np.arange(head_layout.num_blocks)
    if alg != WSUM:
        return block_digests(blocks, head_layout, ids, alg).values
    import torch

    c = head_multipliers(owner, head, blocks.device)
    words = blocks.view(torch.int32).view(head_layout.num_blocks, -1)  # [n, head words]
    return [v & _MASK64 for v in (words * c).sum(dim=1).tolist()]


def _head_split(layout: KVCacheLayout) -> tuple[int, int, int]:
    """A page as [outer, num_kv_heads, inner] 32-bit words: the dims around its heads' dim."""
    shape = layout.page_shape
    at = layout.page_format.index("H")
    outer, inner_nbytes = int(np.prod(shape[:at])), int(np.prod(shape[at + 1 :])) * layout.element_size
    if inner_nbytes % 4:
        raise DigestError(f"{WSUM} per head needs whole 32-bit words per head run; this layout's are {inner_nbytes} bytes")
    return outer, layout.num_kv_heads, inner_nbytes // 4


def _wsum_heads(region: torch.Tensor, layout: KVCacheLayout, ids: np.ndarray, use_kernel: bool | None = None) -> torch.Tensor:
    """[n, num_kv_heads] int64: each head's share of each block's wsum64 (rows add up to `_wsum`'s
    digests), in one pass over the blocks' bytes. Queued on the current stream."""
    import torch

    outer, num_heads, inner = _head_split(layout)
    words = region.view(torch.int32)
    block_w, layer_w = layout.block_stride_bytes // 4, layout.layer_stride_bytes // 4
    c = _multipliers(layout.num_layers * outer * num_heads * inner, region.device)
    if use_kernel if use_kernel is not None else region.is_cuda and has_wsum_kernel():
        from kvbridge.transfer.wsum_kernel import wsum_head_blocks

        index = device_index(ids, region.device)
        return wsum_head_blocks(words, index, c, block_w, layer_w, layout.num_layers, outer, num_heads, inner)
    c = c.view(layout.num_layers, outer, num_heads, inner)
    # [num_blocks, num_layers, outer, heads, inner] int32: every block's pages, split around the heads' dim
    blocks = words.as_strided(
        (layout.num_blocks, layout.num_layers, outer, num_heads, inner),
        (block_w, layer_w, num_heads * inner, inner, 1), words.storage_offset(),
    )  # fmt: skip
    per_chunk = max(1, _WSUM_CHUNK_NBYTES // (2 * layout.block_nbytes))
    sums = []
    for first in range(0, len(ids), per_chunk):
        chunk = ids[first : first + per_chunk]
        if len(run_starts(chunk)) == 1:
            view = blocks[int(chunk[0]) : int(chunk[0]) + len(chunk)]
        else:
            view = blocks.index_select(0, torch.from_numpy(np.ascontiguousarray(chunk)).to(region.device))
        sums.append((view * c).sum(dim=(1, 2, 4)))  # the one product; int64, wraps mod 2^64
    return torch.cat(sums) if sums else torch.zeros((0, num_heads), dtype=torch.int64, device=region.device)


def _xxh3_heads(region: torch.Tensor, layout: KVCacheLayout, ids: np.ndarray) -> list[list[int]]:
    """[num_kv_heads][n] xxh3-64 of each head's bytes of each block (its pages narrowed to the head, in
    layer order), through one head-major copy of the blocks: a head's runs move whole, as void items."""
    shape, at = layout.page_shape, layout.page_format.index("H")
    outer, inner_nbytes = int(np.prod(shape[:at])), int(np.prod(shape[at + 1 :])) * layout.element_size
    num_heads, num_layers = layout.num_kv_heads, layout.num_layers
    buf = (region if not region.is_cuda else region.cpu()).numpy()  # [region_nbytes] uint8
    runs = np.dtype((np.void, inner_nbytes))
    by_head = np.empty((num_heads, len(ids), num_layers, outer), dtype=runs)  # [H, n, L, outer] runs
    strides = (layout.layer_stride_bytes, num_heads * inner_nbytes, inner_nbytes, 1)
    for i, first_page in enumerate(layout.page_offsets(ids)[:, 0].tolist()):
        # block i as [L, outer, H] runs of one head, straight from the region (no copy until this one)
        block = np.lib.stride_tricks.as_strided(buf[first_page:], (num_layers, outer, num_heads, inner_nbytes), strides)
        by_head[:, i] = block.view(runs)[..., 0].transpose(2, 0, 1)
    flat = by_head.view(np.uint8).reshape(num_heads, len(ids), -1)
    return [[xxhash.xxh3_64_intdigest(flat[h, b]) for b in range(len(ids))] for h in range(num_heads)]
