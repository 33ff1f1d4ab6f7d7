"""The atoms of a read plan: every piece of KV a decode shard needs, with its byte offset on both sides. Pure numpy.

Page formats keep head_dim innermost (all but K of a K-transposed format), so the smallest piece
both sides hold contiguously is the head_dim elements of one (layer, K|V, token, head), or one
element where a side keeps K transposed. Where every page format allows, an atom spans more: a
token's heads, or a chunk of a head's tokens (`atom_shape`); fewer atoms make planning and the
gather cheaper. `collect_atoms` lists them per source, sorted by source offset,
with arrays of shape [L, 2, T, H, D] built by broadcasting (no loop over layers, tokens or heads).
Used by transfer/layout_plan.py only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvbridge.errors import PlanTooLargeError
from kvbridge.layout import K_TRANSPOSED_FORMATS
from kvbridge.transfer.kv_shard import KVShard


# At most this many atoms per plan: ~16 int64 arrays of this length live while planning (~1 GB at
# 2**23), and planning takes ~0.3 s per million atoms on one core. Beyond, the read fails.
MAX_ATOMS = 1 << 23


def head_owners(decode: KVShard, prefills: Sequence[KVShard]) -> list[tuple[int, int, int]]:
    """(source index, first head, end head) per source: each needed head is read from the first rank that holds it."""
    owner = [next(i for i, s in enumerate(prefills) if s.head_start <= h < s.head_end)
             for h in range(decode.head_start, decode.head_end)]  # fmt: skip
    spans = []
    for i in sorted(set(owner)):
        heads = [decode.head_start + k for k, o in enumerate(owner) if o == i]
        spans.append((i, heads[0], heads[-1] + 1))  # a rank's heads are a range, so its share is too
    return spans


def atom_shape(decode: KVShard, prefills: Sequence[KVShard], owners: list[tuple[int, int, int]], num_tokens: int) -> tuple[int, int, int]:
    """(heads, tokens, dims) one atom spans, contiguous on both sides for every source: fewer, larger atoms
    make planning and the gather cheaper. Heads merge when every page format ends in "HD" (a token's
    heads are adjacent), tokens too when one source holds exactly the decode's heads and the formats
    end in "NHD"; tokens merge when every format ends in "ND" (a head's tokens are adjacent). Token
    chunks of gcd(block sizes, num_tokens) never cross a block on either side. An atom spans all of
    head_dim unless a format keeps K transposed (K_TRANSPOSED_FORMATS): then it is one element."""
    sources = [prefills[i] for i, _, _ in owners]
    formats = [s.layout.page_format for s in (decode, *sources)]
    head_dim = decode.layout.head_dim
    if any(f in K_TRANSPOSED_FORMATS for f in formats):
        return 1, 1, 1
    chunk = math.gcd(num_tokens, decode.layout.block_size, *(s.layout.block_size for s in sources))
    spans = {h1 - h0 for _, h0, h1 in owners}
    if all(f.endswith("HD") for f in formats) and len(spans) == 1:
        (_, h0, h1), exact = owners[0], len(owners) == 1
        exact = exact and (decode.head_start, decode.head_end) == (h0, h1) == (sources[0].head_start, sources[0].head_end)
        return spans.pop(), (chunk if exact and all(f.endswith("NHD") for f in formats) else 1), head_dim
    if all(f.endswith("ND") for f in formats):
        return 1, chunk, head_dim
    return 1, 1, head_dim


def _atom_offsets(
    shard: KVShard, block_ids: np.ndarray, num_tokens: int, heads: range, shape: tuple[int, int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """(byte offset of each atom, byte offset of its page), both [L, 2, T / tokens, H / heads, D / dims]
    int64, for the atoms of `shape` (heads, tokens, dims) covering (layer, K|V, token, head, dim) of
    global `heads` in `shard` with its blocks `block_ids`: each offset is that of the atom's first element."""
    lay = shard.layout
    needed = -(-num_tokens // lay.block_size)
    if len(block_ids) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {lay.block_size} tokens, {len(block_ids)} given")
    heads_per_atom, tokens_per_atom, dims_per_atom = shape
    tokens = np.arange(0, num_tokens, tokens_per_atom, dtype=np.int64)
    kv_stride, halves = lay.page_dim_strides()
    block = lay.block_offsets(block_ids[tokens // lay.block_size])  # [T], IndexError for ids outside the layout
    layer = np.arange(lay.num_layers, dtype=np.int64) * lay.layer_stride_bytes  # [L]
    page = layer[:, None, None, None, None] + block[None, None, :, None, None]  # [L, 1, T, 1, 1]
    slot = (tokens % lay.block_size)[:, None, None]  # [T, 1, 1]
    head = (np.arange(heads.start, heads.stop, heads_per_atom, dtype=np.int64) - shard.head_start)[None, :, None]  # [1, H, 1]
    dim = np.arange(0, lay.head_dim, dims_per_atom, dtype=np.int64)[None, None, :]  # [1, 1, D]
    inner = np.stack([kv * kv_stride + slot * n + head * h + dim * d for kv, (n, h, d) in enumerate(halves)])  # [2, T, H, D]
    atom = page + inner[None]
    return atom, np.broadcast_to(page, atom.shape)


class Atoms(NamedTuple):
    """Every needed atom, sorted by (source, source offset)."""

    source: np.ndarray  # [A] int64
    src: np.ndarray  # [A] byte offset in its source region
    src_page: np.ndarray  # [A] byte offset of its source page
    dst: np.ndarray  # [A] byte offset in the destination region
    nbytes: int  # bytes per atom: its dims (head_dim, or 1) of each of its heads and tokens


def collect_atoms(decode, dst_ids, prefills, src_ids, num_tokens) -> Atoms:
    """Every atom of the read, or PlanTooLargeError when there would be more than MAX_ATOMS."""
    source, src, src_page, dst = [], [], [], []
    owners = head_owners(decode, prefills)
    shape = atom_shape(decode, prefills, owners, num_tokens)
    heads, tokens, dims = shape
    num_atoms = sum(decode.layout.num_layers * 2 * -(-num_tokens // tokens) * -(-(h1 - h0) // heads) for _, h0, h1 in owners)
    num_atoms *= decode.layout.head_dim // dims
    if num_atoms > MAX_ATOMS:
        raise PlanTooLargeError(
            f"reading {num_tokens} tokens from {'; '.join(p.describe() for p in prefills)} into {decode.describe()} "
            f"takes {num_atoms} atoms of {shape} (heads, tokens, dims) to plan, more than {MAX_ATOMS}: the read fails "
            "(recomputed locally under policy recompute); pages whose K is transposed (H2ND-KT) plan element by element"
        )
    for i, h0, h1 in owners:
        s, p = _atom_offsets(prefills[i], src_ids[i], num_tokens, range(h0, h1), shape)
        d, _ = _atom_offsets(decode, dst_ids, num_tokens, range(h0, h1), shape)
        order = np.argsort(s.reshape(-1), kind="stable")
        source.append(np.full(len(order), i, dtype=np.int64))
        src.append(s.reshape(-1)[order])
        src_page.append(p.reshape(-1)[order])
        dst.append(d.reshape(-1)[order])
    nbytes = shape[0] * shape[1] * shape[2] * decode.layout.element_size
    return Atoms(*(np.concatenate(a) for a in (source, src, src_page, dst)), nbytes)
