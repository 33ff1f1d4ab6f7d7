"""Digests of KV blocks: what proves that the bytes a reader holds are the bytes the owner leased.

The owner of the blocks digests each leased block (every layer's page, in layer order) on the
device that holds it when it grants the lease; the reader digests the blocks it read, on its own
device, before they are used, with the algorithm the owner named. A block's digest depends only
on its bytes in logical order (layer 0's page, layer 1's page, ...), never on where the pages lie,
so two engines with different strides agree.

Two algorithms, chosen by the owner's device:

* `xxh3-64` (KV in host memory): xxHash's XXH3, 64 bits, from the `xxhash` package. Any random
  corruption (bit flips, a torn or stale block, another block's bytes) goes unnoticed with
  probability about 2^-64.
* `wsum64` (KV on a GPU, computed there with torch reductions, no host copy): the block read as
  signed 32-bit words x_i, digest = sum_i c_i * x_i mod 2^64 with fixed odd 64-bit multipliers
  c_i (splitmix64 of i). Fault model: every change confined to one 32-bit word is detected (an
  odd c_i is invertible mod 2^64, so c_i * delta is never 0 for a nonzero delta); a change of
  several words escapes only when it satisfies one linear equation mod 2^64 over the c_i, which
  random faults (bit flips, torn or misplaced blocks, zeroed pages) hit with a probability of
  order 2^-32 per affected pair of words or less.

Neither is a cryptographic hash. Their inputs and algorithms are public, so someone who can write
the owner's KV region on purpose can craft bytes that keep a digest (trivially for wsum64, with
effort for xxh3-64): the digest stops faults and blind tampering, and the side-channel secret
decides who can write at all (docs/pd-disaggregation.md, "Threat model").
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import xxhash  # at import: a missing xxhash fails when a connector is configured, not on its first digest

from kvbridge.block_runs import run_starts
from kvbridge.layer_tensors import LayerTensors
from kvbridge.transfer.messages import KVDigest

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from kvbridge.layout import KVCacheLayout

XXH3 = "xxh3-64"
WSUM = "wsum64"
ALGORITHMS = (XXH3, WSUM)
_MASK64 = (1 << 64) - 1
_WSUM_CHUNK_NBYTES = 64 << 20  # int64 temporaries of one reduction: bounded, whatever the request size


class BlockDigest(NamedTuple):
    """One block's digest and the algorithm that made it (what an offload tier keeps per block)."""

    alg: str
    value: int


class DigestError(ValueError):
    """A digest cannot be computed as asked (unknown algorithm, a page that is not whole words)."""


def algorithm_for(kv_cache: torch.Tensor) -> str:
    """The algorithm an owner uses for its blocks: computed where they are, with no copy."""
    return WSUM if kv_cache.is_cuda else XXH3


def region_bytes(kv_cache: torch.Tensor | LayerTensors, layout: KVCacheLayout) -> torch.Tensor | LayerTensors:
    """[region_nbytes] uint8: every byte from page (0, 0) to the end of the last page, as one tensor.
    KV held one tensor per layer has no such tensor: it is its own region (digests gather its blocks)."""
    import torch

    if isinstance(kv_cache, LayerTensors):
        return kv_cache

    elements = kv_cache.as_strided((layout.region_nbytes // layout.element_size,), (1,), kv_cache.storage_offset())
    return elements.view(torch.uint8)


class DigestJob:
    """Digests being computed on a device: `result()` waits for them (GPU) or just returns them."""

    def __init__(self, alg: str, values: list[int] | None = None, sums: torch.Tensor | None = None) -> None:
        self.alg, self._values, self._sums = alg, values, sums  # sums: [n] int64 on the device
        self._stream = None  # the stream the sums are queued on: the copy to the host follows them there
        if sums is not None and sums.is_cuda:
            import torch

            self._stream = torch.cuda.current_stream(sums.device)

    def result(self) -> KVDigest:
        if self._values is None:
            if self._stream is not None:
                import torch

                with torch.cuda.stream(self._stream):  # waits for that stream only, not for the engine's
                    sums = self._sums.tolist()
            else:
                sums = self._sums.tolist()
            self._values = [v & _MASK64 for v in sums]
            self._sums = self._stream = None
        return KVDigest(alg=self.alg, values=self._values)


def start_block_digests(region: torch.Tensor, layout: KVCacheLayout, block_ids, alg: str) -> DigestJob:
    """Start digesting each block of `block_ids` (in their order) on `region`'s device.

    `region` is `region_bytes(kv_cache, layout)`. On a GPU the work is queued on the current stream
    and `result()` waits for it. Raises DigestError for an algorithm this build does not know,
    IndexError for a block id outside the layout.
    """
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    pages = layout.page_offsets(ids)  # [n, num_layers] byte offsets; raises IndexError
    if isinstance(region, LayerTensors):
        return _gathered_digests(region, layout, ids, alg)
    if alg == XXH3:
        return DigestJob(alg, values=_xxh3(region, layout, pages))
    if alg == WSUM:
        return DigestJob(alg, sums=_wsum(region, layout, ids))
    raise DigestError(f"unknown KV digest algorithm {alg!r}; this build knows {', '.join(ALGORITHMS)}")


def device_index(ids, device) -> torch.Tensor:
    """Block ids as an int64 tensor on `device`; on a GPU uploaded from pinned memory, without waiting:
    a pageable upload would wait for everything queued on the stream (e.g. the copies being digested)."""
    import torch

    index = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    device = torch.device(device)
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index


def _word_strides(layout: KVCacheLayout) -> tuple[int, int, int]:
    """(block stride, layer stride, page size) of `layout` in 32-bit words, as wsum64 reads it; DigestError
    where one is not whole words."""
    strides = (layout.block_stride_bytes, layout.layer_stride_bytes, layout.page_nbytes)
    if any(s % 4 for s in strides):
        raise DigestError(f"{WSUM} needs pages of whole 32-bit words; this layout's strides are {strides} bytes")
    return strides[0] // 4, strides[1] // 4, strides[2] // 4


def gathered_blocks(
    layers: LayerTensors, layout: KVCacheLayout, ids: np.ndarray
) -> Iterator[tuple[torch.Tensor, KVCacheLayout]]:
    """Blocks `ids` of KV held one tensor per layer, a chunk at a time, each chunk gathered into one
    block-major buffer (every layer's page in layer order: the bytes a block's digest is defined on):
    yields (its bytes, its layout), its blocks numbered from 0 in the order of `ids`."""
    import torch

    per_chunk = max(1, _WSUM_CHUNK_NBYTES // layout.block_nbytes)
    index = device_index(ids, layers.device)
    for first in range(0, len(ids), per_chunk):
        blocks = layers.index_select(0, index[first : first + per_chunk])  # [n, L, *page_shape] contiguous
        yield blocks.view(-1).view(torch.uint8), layout.block_major(len(blocks))


def _gathered_digests(layers: LayerTensors, layout: KVCacheLayout, ids: np.ndarray, alg: str) -> DigestJob:
    """Digests of blocks held one tensor per layer, gathered a chunk at a time (`gathered_blocks`)."""
    import torch

    if alg not in ALGORITHMS:
        raise DigestError(f"unknown KV digest algorithm {alg!r}; this build knows {', '.join(ALGORITHMS)}")
    jobs = [start_block_digests(flat, chunk, np.arange(chunk.num_blocks), alg)
            for flat, chunk in gathered_blocks(layers, layout, ids)]  # fmt: skip
    if alg == XXH3:
        return DigestJob(alg, values=[v for job in jobs for v in job.result().values])
    sums = [job._sums for job in jobs]
    return DigestJob(alg, sums=torch.cat(sums) if sums else torch.zeros(0, dtype=torch.int64, device=layers.device))


class BlockDigester:
    """`start_block_digests` bound to a region, its layout and an algorithm: what the offload copier
    calls for each piece it copied. On CPU a piece is often one block of MiBs, so a call's own cost
    counts (~35 us of a 2 MiB block's ~75 us hash through `start_block_digests`): for XXH3 over host
    memory with one byte range per block, what does not depend on the ids is worked out once here.
    Same values and errors as `start_block_digests`."""

    def __init__(self, region: torch.Tensor, layout: KVCacheLayout, alg: str) -> None:
        self.region, self.layout, self.alg = region, layout, alg
        is_fast = alg == XXH3 and not region.is_cuda and layout.is_block_contiguous
        self._buf = region.numpy() if is_fast else None  # [region_nbytes] uint8
        self._stride, self._nbytes, self._num_blocks = layout.block_stride_bytes, layout.block_nbytes, layout.num_blocks

    def __call__(self, block_ids) -> DigestJob:
        if self._buf is None:
            return start_block_digests(self.region, self.layout, block_ids, self.alg)
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self._num_blocks]
        if bad:
            raise IndexError(f"block id {bad[0]} outside [0, {self._num_blocks})")
        s, n, buf = self._stride, self._nbytes, self._buf
        return DigestJob(self.alg, values=[xxhash.xxh3_64_intdigest(buf[b * s : b * s + n]) for b in ids])


def copy_blocks_with_digests(
    src_region: torch.Tensor, src_layout: KVCacheLayout, src_ids, dst_region: torch.Tensor, dst_layout: KVCacheLayout,
    dst_ids, digest: bool = True,
) -> DigestJob | None:
    """Copy block src_ids[i] of `src_region` into block dst_ids[i] of `dst_region` (both `region_bytes`
    of layouts with the same pages, on one device) on the SMs, queued on the current stream, and with
    `digest` return the wsum64 digests of the blocks written, from the same pass: equal to
    `start_block_digests(dst_region, dst_layout, dst_ids, WSUM)` once the copy ran. Needs Triton
    (`has_wsum_kernel`). Raises IndexError for an id outside a layout, DigestError for layouts whose
    pages differ or are not whole 32-bit words."""
    import torch

    from kvbridge.transfer.wsum_kernel import copy_blocks

    src, dst = (np.ascontiguousarray(np.asarray(i, dtype=np.int64).reshape(-1)) for i in (src_ids, dst_ids))
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    src_layout.page_offsets(src), dst_layout.page_offsets(dst)  # IndexError for ids outside
    if (src_layout.page_nbytes, src_layout.page_format, src_layout.num_layers) != (
        dst_layout.page_nbytes, dst_layout.page_format, dst_layout.num_layers
    ):  # fmt: skip
        raise DigestError("a block copy with its digest needs the same pages on both sides")
    (*src_strides, page_words), (*dst_strides, _) = _word_strides(src_layout), _word_strides(dst_layout)
    device = dst_region.device
    index = device_index(np.concatenate([src, dst]), device)  # one upload for both sides
    c = _multipliers(src_layout.num_layers * page_words, device) if digest else None
    sums = copy_blocks(src_region.view(torch.int32), dst_region.view(torch.int32), index[: len(src)], index[len(src) :], c,
                       tuple(src_strides), tuple(dst_strides), page_words, src_layout.num_layers)  # fmt: skip
    return DigestJob(WSUM, sums=sums) if digest else None


def block_digests(region: torch.Tensor, layout: KVCacheLayout, block_ids, alg: str) -> KVDigest:
    """The digest of each block of `block_ids` (in their order), computed on `region`'s device."""
    return start_block_digests(region, layout, block_ids, alg).result()


def digest_of_bytes(data: torch.Tensor, alg: str) -> int:
    """The digest of one block given as its bytes in logical order ([block_nbytes] uint8, contiguous,
    on any device): equal to `block_digests` of that block wherever it lies. For the offload tiers,
    whose slots and files hold a block as one byte range."""
    import torch

    if alg == XXH3:
        return xxhash.xxh3_64_intdigest(data.cpu().numpy())
    if alg == WSUM:
        if data.numel() % 4:
            raise DigestError(f"{WSUM} needs whole 32-bit words; this block has {data.numel()} bytes")
        words = data.view(torch.int32)  # [n]
        return int((words * _multipliers(words.numel(), data.device)).sum()) & _MASK64  # int64, wraps mod 2^64
    raise DigestError(f"unknown KV digest algorithm {alg!r}; this build knows {', '.join(ALGORITHMS)}")


def mismatches(expected: KVDigest, got: KVDigest) -> list[int]:
    """Positions whose digests differ (every position when the lengths or algorithms differ)."""
    if expected.alg != got.alg or len(expected.values) != len(got.values):
        return list(range(max(len(expected.values), len(got.values))))
    return [i for i, (a, b) in enumerate(zip(expected.values, got.values)) if a != b]


# ---------------------------------------------------------------------- xxh3-64 (host memory)


def _xxh3(region: torch.Tensor, layout: KVCacheLayout, pages: np.ndarray) -> list[int]:

    if region.is_cuda:  # a GPU reader of a host owner's blocks: hash a host copy of them
        return _xxh3_host_copy(region, layout, pages)
    buf = region.numpy()
    if layout.is_block_contiguous:  # one range per block: one call each
        n = layout.block_nbytes
        return [xxhash.xxh3_64_intdigest(buf[o : o + n]) for o in pages[:, 0].tolist()]
    p = layout.page_nbytes
    values = []
    for row in pages.tolist():  # streaming over the pages == one call over their concatenation
        h = xxhash.xxh3_64()
        for o in row:
            h.update(buf[o : o + p])
        values.append(h.intdigest())
    return values


def _xxh3_host_copy(region: torch.Tensor, layout: KVCacheLayout, pages: np.ndarray) -> list[int]:
    import torch

    p = layout.page_nbytes
    values = []
    for row in pages.tolist():
        block = torch.cat([region[o : o + p] for o in row]).cpu().numpy()
        values.append(xxhash.xxh3_64_intdigest(block))
    return values


# ---------------------------------------------------------------------- wsum64 (any torch device)


@lru_cache(maxsize=8)
def _multipliers_np(num_words: int) -> np.ndarray:
    """[num_words] uint64: odd splitmix64(i) for i in 0..num_words-1 (public, fixed forever)."""
    with np.errstate(over="ignore"):
        z = np.arange(1, num_words + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z | np.uint64(1)


_device_multipliers: dict[tuple[int, str], torch.Tensor] = {}  # (num_words, device) -> int64 tensor


def _multipliers(num_words: int, device: torch.device) -> torch.Tensor:
    import torch

    key = (num_words, str(device))
    c = _device_multipliers.get(key)
    if c is None:
        if len(_device_multipliers) >= 8:
            _device_multipliers.clear()
        c = _device_multipliers[key] = torch.from_numpy(_multipliers_np(num_words).view(np.int64)).to(device)
    return c


@lru_cache(maxsize=1)
def has_wsum_kernel() -> bool:
    """Whether the one-pass kernel of wsum64 (wsum_kernel.py) can run here: Triton is installed."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _wsum(region: torch.Tensor, layout: KVCacheLayout, ids: np.ndarray, use_kernel: bool | None = None) -> torch.Tensor:
    """[n] int64 digests of blocks `ids`, queued on the current stream. `use_kernel` (None: on a GPU
    with Triton) takes the one-pass kernel; otherwise torch reductions, chunk by chunk."""
    import torch

    block_w, layer_w, page_words = _word_strides(layout)
    words = region.view(torch.int32)  # [region_nbytes / 4]
    if use_kernel if use_kernel is not None else region.is_cuda and has_wsum_kernel():
        from kvbridge.transfer.wsum_kernel import wsum_blocks

        index = device_index(ids, region.device)
        c = _multipliers(layout.num_layers * page_words, region.device)
        return wsum_blocks(words, index, c, block_w, layer_w, page_words, layout.num_layers)
    c = _multipliers(layout.num_layers * page_words, region.device).view(layout.num_layers, page_words)
    # [num_blocks, num_layers, page_words] int32: every block, pages in layer order (as_strided's offset is absolute)
    blocks = words.as_strided((layout.num_blocks, layout.num_layers, page_words), (block_w, layer_w, 1), words.storage_offset())
    per_chunk = max(1, _WSUM_CHUNK_NBYTES // (2 * layout.block_nbytes))  # int64 products: twice the bytes
    # A few reductions per chunk of blocks, never per block: a load's blocks are scattered over the
    # cache, and 256 blocks one by one were 512 kernel launches (milliseconds of a host-tier hit).
    # Scattered chunks are gathered through one upload of the ids (made at the first such chunk), from
    # pinned memory: a pageable upload would wait for everything queued on the stream (the copies
    # being digested).
    index = None
    sums = []
    for first in range(0, len(ids), per_chunk):
        chunk = ids[first : first + per_chunk]
        if len(run_starts(chunk)) == 1:  # adjacent blocks: a view, no copy
            view = blocks[int(chunk[0]) : int(chunk[0]) + len(chunk)]
        else:
            if index is None:
                index = device_index(ids, region.device)
            view = blocks.index_select(0, index[first : first + len(chunk)])
        sums.append((view * c).sum(dim=(1, 2)))  # int64, wraps mod 2^64
    return torch.cat(sums) if sums else torch.zeros(0, dtype=torch.int64, device=region.device)  # [n] int64
