"""Block digests (transfer/digest.py): the same bytes give the same digest whatever the placement,
one flipped bit anywhere in a block changes it, and wsum64 matches an independent uint64 reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import xxhash

from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.digest import (
    WSUM,
    XXH3,
    BlockDigester,
    DigestError,
    _multipliers_np,
    block_digests,
    mismatches,
    region_bytes,
)

GEOMETRY = dict(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")


def _kv(layout: KVCacheLayout, seed: int) -> torch.Tensor:
    """A KV tensor placed as `layout` says, filled with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(-128, 128, (layout.region_nbytes,), dtype=torch.int8, generator=gen).view(torch.bfloat16)
    return torch.as_strided(buf, layout.shape, layout.strides)


def _strided_copy(kv: torch.Tensor, layout: KVCacheLayout) -> tuple[torch.Tensor, KVCacheLayout]:
    """The same KV, layer-outermost (vLLM's placement): other strides, same logical bytes."""
    strided = KVCacheLayout(**GEOMETRY, num_blocks=layout.num_blocks, layer_stride=layout.num_blocks * layout.page_nbytes,
                            block_stride=layout.page_nbytes)  # fmt: skip
    out = torch.as_strided(torch.zeros(strided.region_nbytes // 2, dtype=torch.bfloat16), strided.shape, strided.strides)
    out.copy_(kv)
    return out, strided


def _wsum_reference(block: bytes) -> int:
    """sum_i c_i * x_i mod 2^64 over signed 32-bit words, in numpy's well-defined uint64 arithmetic."""
    x = np.frombuffer(block, dtype=np.int32).astype(np.int64).view(np.uint64)  # sign-extended
    with np.errstate(over="ignore"):
        return int(np.sum(x * _multipliers_np(len(x)), dtype=np.uint64))


@pytest.mark.parametrize("alg", [XXH3, WSUM])
def test_digests_depend_on_bytes_not_on_placement(alg):
    layout = KVCacheLayout(**GEOMETRY, num_blocks=6)
    kv = _kv(layout, seed=1)
    ids = [4, 0, 1, 2, 5]
    contiguous = block_digests(region_bytes(kv, layout), layout, ids, alg)
    other, strided = _strided_copy(kv, layout)
    assert block_digests(region_bytes(other, strided), strided, ids, alg) == contiguous
    assert len(set(contiguous.values)) == len(ids)  # random blocks: distinct digests
    blocks = kv.contiguous().view(torch.uint8).view(layout.num_blocks, -1)
    if alg == XXH3:
        assert contiguous.values == [xxhash.xxh3_64_intdigest(blocks[i].numpy().tobytes()) for i in ids]
    else:
        assert contiguous.values == [_wsum_reference(blocks[i].numpy().tobytes()) for i in ids]


@pytest.mark.parametrize("alg", [XXH3, WSUM])
def test_one_flipped_bit_anywhere_changes_the_digest(alg):
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    layout = KVCacheLayout(**GEOMETRY, num_blocks=4)
    kv = _kv(layout, seed)
    region = region_bytes(kv, layout)
    before = block_digests(region, layout, range(4), alg)
    for _ in range(200):
        block, offset, bit = rng.randrange(4), rng.randrange(layout.block_nbytes), rng.randrange(8)
        at = layout.block_offset(block) + offset
        region[at : at + 1] ^= 1 << bit
        assert mismatches(before, block_digests(region, layout, range(4), alg)) == [block], (block, offset, bit)
        region[at : at + 1] ^= 1 << bit
    assert mismatches(before, block_digests(region, layout, range(4), alg)) == []


@pytest.mark.parametrize("alg", [XXH3, WSUM])
def test_a_kv_tensor_inside_a_larger_buffer_is_digested_where_it_lies(alg):
    layout = KVCacheLayout(**GEOMETRY, num_blocks=5)
    kv = _kv(layout, seed=4)
    buf = torch.zeros(64 + layout.region_nbytes // 2, dtype=torch.bfloat16)  # 128 bytes of something else first
    inside = torch.as_strided(buf, layout.shape, layout.strides, 64)
    inside.copy_(kv)
    assert block_digests(region_bytes(inside, layout), layout, [4, 1], alg) == block_digests(
        region_bytes(kv, layout), layout, [4, 1], alg
    )


@pytest.mark.parametrize("alg", [XXH3, WSUM])
def test_a_bound_digester_gives_start_block_digests_values_and_errors(alg):
    """BlockDigester (the offload copier's digest, with its own path for XXH3 on one byte range per
    block) equals `block_digests` on a contiguous and a strided layout, and refuses the same ids."""
    layout = KVCacheLayout(**GEOMETRY, num_blocks=6)
    kv = _kv(layout, seed=5)
    other, strided = _strided_copy(kv, layout)
    ids = [5, 0, 3, 3, 1]
    expected = block_digests(region_bytes(kv, layout), layout, ids, alg)
    for tensor, placed in ((kv, layout), (other, strided)):
        digester = BlockDigester(region_bytes(tensor, placed), placed, alg)
        assert digester(ids).result() == expected
        assert digester(np.array(ids)).result() == expected
        assert digester([]).result().values == []
        for bad in ([6], [0, -1]):
            with pytest.raises(IndexError):
                digester(bad).result()


def test_swapped_blocks_and_unknown_algorithms():
    layout = KVCacheLayout(**GEOMETRY, num_blocks=3)
    region = region_bytes(_kv(layout, seed=2), layout)
    digest = block_digests(region, layout, [0, 1, 2], WSUM)
    assert mismatches(digest, block_digests(region, layout, [1, 0, 2], WSUM)) == [0, 1]
    assert mismatches(digest, block_digests(region, layout, [0, 1], WSUM)) == [0, 1, 2]  # lengths differ
    assert mismatches(digest, block_digests(region, layout, [0, 1, 2], XXH3)) == [0, 1, 2]  # algorithms differ
    with pytest.raises(DigestError, match="unknown KV digest algorithm"):
        block_digests(region, layout, [0], "md5")
    with pytest.raises(IndexError):
        block_digests(region, layout, [3], XXH3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wsum64_on_cuda_equals_cpu():
    layout = KVCacheLayout(**GEOMETRY, num_blocks=64)
    kv = _kv(layout, seed=3)
    ids = list(range(0, 64, 3)) + [1, 2]
    on_cpu = block_digests(region_bytes(kv, layout), layout, ids, WSUM)
    on_gpu = block_digests(region_bytes(kv.cuda(), layout), layout, ids, WSUM)
    assert on_gpu == on_cpu
    assert block_digests(region_bytes(kv.cuda(), layout), layout, ids, XXH3) == block_digests(
        region_bytes(kv, layout), layout, ids, XXH3
    )  # a GPU reader of a host owner's blocks


@pytest.mark.parametrize("alg", [XXH3, WSUM])
def test_digest_of_a_blocks_bytes_equals_its_block_digest_wherever_it_lies(alg):
    """What the offload tiers rely on: a host slot or a file holds a block as one byte range, and its
    digest must equal the one taken on the KV cache, block-major or layer-outermost."""
    from kvbridge.transfer.digest import digest_of_bytes

    layout = KVCacheLayout(**GEOMETRY, num_blocks=5)
    kv = _kv(layout, seed=7)
    strided, strided_layout = _strided_copy(kv, layout)
    for block in range(layout.num_blocks):
        flat = kv[block].contiguous().reshape(-1).view(torch.uint8)  # [block_nbytes], logical order
        expected = block_digests(region_bytes(kv, layout), layout, [block], alg).values[0]
        assert digest_of_bytes(flat, alg) == expected
        assert block_digests(region_bytes(strided, strided_layout), strided_layout, [block], alg).values[0] == expected
        flipped = flat.clone()
        flipped[block * 7 % flat.numel()] ^= 1
        assert digest_of_bytes(flipped, alg) != expected
    with pytest.raises(DigestError, match="unknown"):
        digest_of_bytes(flat, "md5")


def test_wsum_in_chunks_of_adjacent_and_scattered_blocks_equals_the_reference(monkeypatch):
    """wsum64 reduces a chunk of blocks at a time (a view for adjacent ids, a gather otherwise):
    with chunks of 2 blocks, every mix of both gives each block's own digest, on a strided layout too."""
    import kvbridge.transfer.digest as digest

    layout = KVCacheLayout(**GEOMETRY, num_blocks=7)
    monkeypatch.setattr(digest, "_WSUM_CHUNK_NBYTES", 4 * layout.block_nbytes)  # 2 blocks per chunk
    kv = _kv(layout, seed=7)
    blocks = kv.contiguous().view(torch.uint8).view(layout.num_blocks, -1)
    other, strided = _strided_copy(kv, layout)
    ids = [2, 3, 6, 0, 4, 5, 1]  # chunks (2, 3) adjacent, (6, 0) scattered, (4, 5) adjacent, (1) alone
    want = [_wsum_reference(blocks[i].numpy().tobytes()) for i in ids]
    assert block_digests(region_bytes(kv, layout), layout, ids, WSUM).values == want
    assert block_digests(region_bytes(other, strided), strided, ids, WSUM).values == want
