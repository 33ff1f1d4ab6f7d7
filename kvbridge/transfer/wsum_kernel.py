"""The wsum64 digest (digest.py) of KV blocks in one pass over their bytes, as a Triton kernel.

digest(block) = sum_i c_i * x_i mod 2^64 over the block's 32-bit words x_i in logical order (layer
0's page, layer 1's page, ...), c_i the fixed odd multipliers. The torch reduction it replaces
materialised the int64 products of a chunk of blocks and read an int64 multiplier per word from
memory: about 5x the block's own bytes of traffic, 0.1 of HBM bandwidth on an H200. Here each
program reads one contiguous piece of one page once, multiplies in registers, and writes one int64
partial sum; the multipliers (8 bytes per word of one block, a few MiB) are reused by every block
and stay in L2. The partial sums of a block add up mod 2^64 in int64, as the torch path's do.

`wsum_head_partials` is the same pass split by KV head: a page seen as [outer, heads, inner] words,
each program reads some whole rows of one page, as contiguous as `wsum_partials`' chunks, and sums
each head's runs apart (with the whole block's multipliers), so a block's heads add up to its digest
and a lease's per-head digests cost no second pass.

`copy_blocks` runs the same pass as a block copy: the same-GPU read of a peer's KV
(cuda_ipc.py) moves the bytes on the SMs and digests them from the registers that wrote them.

Imported only where Triton is installed; digest.py chooses it for KV on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK_WORDS = 8192  # 32 KiB of a page per program
BLOCK_WORDS = 1024  # words per vector step


@triton.jit
def wsum_partials(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, c_ptr, out_ptr,
    src_block_w, src_layer_w, dst_block_w, dst_layer_w, page_words, chunks_per_page,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, COPY: tl.constexpr, DIGEST: tl.constexpr,
    HEADS: tl.constexpr = 1, INNER: tl.constexpr = 1,
):  # fmt: skip
    """Program (b, layer * chunks_per_page + k): words [k * CHUNK, (k + 1) * CHUNK) of block
    src_ids[b]'s page of `layer`; (DIGEST) their partial sum goes to out[b, layer * chunks_per_page + k],
    and (COPY) they are written to the same words of block dst_ids[b]'s page: the digest of what was
    written, from the registers that wrote it, with no second read.

    HEADS > 1: pages of [rows, HEADS, INNER] words (powers of two, HEADS * INNER dividing BLOCK), and
    the partial sum of each head apart, to out[b, piece, h]: the same contiguous reads, the heads told
    apart only in the program's last reduction."""
    b = tl.program_id(0)
    piece = tl.program_id(1)
    layer = piece // chunks_per_page
    first = (piece - layer * chunks_per_page) * CHUNK
    src = src_ptr + tl.load(src_ids_ptr + b) * src_block_w + layer.to(tl.int64) * src_layer_w  # ids: int64
    dst = dst_ptr + tl.load(dst_ids_ptr + b) * dst_block_w + layer.to(tl.int64) * dst_layer_w
    c = c_ptr + layer.to(tl.int64) * page_words
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for k in range(0, CHUNK, BLOCK):
        off = first + k + tl.arange(0, BLOCK)
        ok = off < page_words
        x = tl.load(src + off, mask=ok, other=0)
        if COPY:
            tl.store(dst + off, x, mask=ok)
        if DIGEST:
            m = tl.load(c + off, mask=ok, other=0)
            acc += x.to(tl.int64) * m  # wraps mod 2^64
    if DIGEST:
        if HEADS == 1:
            tl.store(out_ptr + b * tl.num_programs(1) + piece, tl.sum(acc, axis=0))
        else:  # a step starts on a row: word i of it belongs to head (i // INNER) % HEADS
            per_head = tl.sum(tl.sum(tl.reshape(acc, (BLOCK // (HEADS * INNER), HEADS, INNER)), axis=2), axis=0)
            tl.store(out_ptr + (b * tl.num_programs(1) + piece) * HEADS + tl.arange(0, HEADS), per_head)


def wsum_blocks(words, ids, c, block_w: int, layer_w: int, page_words: int, num_layers: int):
    """[n] int64 digests of the blocks `ids` ([n] int64 on `words`' device): `words` is the KV region as
    int32 words, `c` the [num_layers * page_words] int64 multipliers. Queued on the current stream."""
    return _blocks_pass(words, None, ids, None, c, (block_w, layer_w), None, page_words, num_layers)


def copy_blocks(src_words, dst_words, src_ids, dst_ids, c, src_strides: tuple[int, int], dst_strides: tuple[int, int],
                page_words: int, num_layers: int):  # fmt: skip
    """Copy blocks src_ids[i] -> dst_ids[i] ([n] int64 on the device) between two KV regions seen as int32
    words with the same pages (`*_strides`: (block, layer) strides in words), on the SMs; with `c` (the
    [num_layers * page_words] int64 multipliers) also return the [n] int64 wsum64 digests of the
    blocks written, else None. Queued on the current stream."""
    return _blocks_pass(src_words, dst_words, src_ids, dst_ids, c, src_strides, dst_strides, page_words, num_layers)


def _blocks_pass(src_words, dst_words, src_ids, dst_ids, c, src_strides, dst_strides, page_words: int, num_layers: int,
                 heads: int = 1, inner: int = 1):  # fmt: skip
    """One `wsum_partials` launch: a digest (no `dst_words`), a copy (no `c`) or both; the digests ([n], or
    [n, heads] with `heads` > 1) or None."""
    import torch

    chunks_per_page = triton.cdiv(page_words, CHUNK_WORDS)
    copy, digest = dst_words is not None, c is not None
    shape = (len(src_ids), num_layers * chunks_per_page, *((heads,) if heads > 1 else ()))
    partials = torch.empty(shape if digest else (0,), dtype=torch.int64, device=src_words.device)
    if len(src_ids):
        grid = (len(src_ids), num_layers * chunks_per_page)
        wsum_partials[grid](src_words, dst_words if copy else src_words, src_ids, dst_ids if copy else src_ids,
                            c if digest else partials, partials, *src_strides, *(dst_strides if copy else src_strides),
                            page_words, chunks_per_page, CHUNK=CHUNK_WORDS, BLOCK=BLOCK_WORDS, COPY=copy, DIGEST=digest,
                            HEADS=heads, INNER=inner)  # fmt: skip
    return partials.sum(dim=1) if digest else None  # int64, wraps mod 2^64


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


ROW_CHUNK_WORDS = 8192  # about as many words per program as `wsum_partials` reads


@triton.jit
def wsum_head_partials(
    words_ptr, ids_ptr, c_ptr, out_ptr,
    block_w, layer_w, outer, num_heads, inner, rows_per_program, programs_per_layer,
    ROWS: tl.constexpr, HEADS: tl.constexpr, INNER: tl.constexpr,
):  # fmt: skip
    """Program (b, layer * programs_per_layer + k): rows [k * rows_per_program, ...) of block ids[b]'s
    page of `layer`, every head of them, read front to back as `wsum_partials` reads a chunk; each
    head's sum goes to out[b, piece, h]. A tile is [ROWS, HEADS, INNER] words (HEADS and INNER the
    powers of two at or above num_heads and min(inner, a vector step), the excess masked off)."""
    b = tl.program_id(0)
    piece = tl.program_id(1)
    layer = piece // programs_per_layer
    first_row = (piece - layer * programs_per_layer) * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, outer)
    block_id = tl.load(ids_ptr + b)  # int64
    page = words_ptr + block_id * block_w + layer.to(tl.int64) * layer_w
    c = c_ptr + layer.to(tl.int64) * (outer * num_heads * inner)
    h = tl.arange(0, HEADS)[None, :, None]
    acc = tl.zeros([ROWS, HEADS, INNER], dtype=tl.int64)
    for r0 in range(first_row, last_row, ROWS):
        rows = (r0 + tl.arange(0, ROWS))[:, None, None]
        base = (rows * num_heads + h) * inner  # [ROWS, HEADS, 1]: where each row's run of each head starts
        for k in range(0, inner, INNER):
            i = k + tl.arange(0, INNER)[None, None, :]
            ok = (rows < last_row) & (h < num_heads) & (i < inner)
            x = tl.load(page + base + i, mask=ok, other=0)
            m = tl.load(c + base + i, mask=ok, other=0)
            acc += x.to(tl.int64) * m  # wraps mod 2^64
    per_head = tl.sum(tl.sum(acc, axis=2), axis=0)  # [HEADS]
    heads = tl.arange(0, HEADS)
    tl.store(out_ptr + (b * tl.num_programs(1) + piece) * num_heads + heads, per_head, mask=heads < num_heads)


def wsum_head_blocks(words, ids, c, block_w: int, layer_w: int, num_layers: int, outer: int, num_heads: int, inner: int):
    """[n, num_heads] int64: each head's share of the digests of blocks `ids`, whose pages are [outer,
    num_heads, inner] words; `c` the [num_layers * outer * num_heads * inner] int64 multipliers. Where a
    row of every head is a power of two that divides a vector step (e.g. 8 heads of 128 bf16: 512
    words), `wsum_partials`' own contiguous pass, split by head at its end; else tiles of rows."""
    import torch

    if num_heads > 1 and _is_pow2(num_heads) and _is_pow2(inner) and BLOCK_WORDS % (num_heads * inner) == 0:
        page_words = outer * num_heads * inner
        return _blocks_pass(words, None, ids, None, c, (block_w, layer_w), None, page_words, num_layers, num_heads, inner)

    heads = triton.next_power_of_2(num_heads)
    step = min(triton.next_power_of_2(inner), max(1, BLOCK_WORDS // heads))
    rows = max(1, BLOCK_WORDS // (heads * step))
    rows_per_program = max(1, ROW_CHUNK_WORDS // (num_heads * inner))
    programs_per_layer = triton.cdiv(outer, rows_per_program)
    partials = torch.empty((len(ids), num_layers * programs_per_layer, num_heads), dtype=torch.int64, device=words.device)
    if len(ids):
        grid = (len(ids), num_layers * programs_per_layer)
        wsum_head_partials[grid](words, ids, c, partials, block_w, layer_w, outer, num_heads, inner, rows_per_program,
                                 programs_per_layer, ROWS=rows, HEADS=heads, INNER=step)  # fmt: skip
    return partials.sum(dim=1)  # int64, wraps mod 2^64

