"""The one-pass wsum64 kernel (transfer/wsum_kernel.py) gives the torch reduction's digests, bit for bit:
pages of several chunks and a ragged last one, block-major and layer-outermost placements, scattered
and repeated ids. On a GPU (`gpu`), or on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`
with Triton installed; CI runs it so)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.digest import WSUM, DigestError, _wsum, block_digests, copy_blocks_with_digests, has_wsum_kernel, region_bytes
from kvbridge.transfer.head_digests import _wsum_heads

# 40-token blocks of 4 heads of 128, bf16: 80 KiB pages = 20,480 words, 2.5 kernel chunks of 8,192
GEOMETRY = dict(num_layers=2, block_size=40, num_kv_heads=4, head_dim=128, dtype="bfloat16")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not (INTERPRETED and has_wsum_kernel()), reason="needs TRITON_INTERPRET=1 and Triton")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


def _region(layout: KVCacheLayout, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(-128, 128, (layout.region_nbytes,), dtype=torch.int8, generator=gen).view(torch.bfloat16)
    return region_bytes(torch.as_strided(buf, layout.shape, layout.strides).to(device), layout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["block-major", "layer-outermost"])
def test_the_kernel_gives_the_torch_reductions_digests(device, placement):
    layout = KVCacheLayout(**GEOMETRY, num_blocks=5)
    if placement == "layer-outermost":
        layout = KVCacheLayout(**GEOMETRY, num_blocks=5, layer_stride=5 * layout.page_nbytes, block_stride=layout.page_nbytes)
    region = _region(layout, seed=7, device=device)
    ids = np.array([4, 0, 2, 2, 1], dtype=np.int64)
    kernel = _wsum(region, layout, ids, use_kernel=True).cpu()
    torch_ = _wsum(region.cpu(), layout, ids, use_kernel=False)
    assert torch.equal(kernel, torch_)
    assert kernel[2] == kernel[3] and len(set(kernel.tolist())) == 4  # the same block twice, the others apart
    one_bit = region.clone()
    one_bit[layout.page_offsets(np.array([1]))[0, 1] + 123] ^= 4  # block 1, layer 1
    changed = _wsum(one_bit, layout, ids, use_kernel=True).cpu()
    assert (changed != kernel).tolist() == [False, False, False, False, True]


@pytest.mark.parametrize("device", DEVICES)
def test_no_block_and_out_of_range_ids(device):
    layout = KVCacheLayout(**GEOMETRY, num_blocks=3)
    region = _region(layout, seed=8, device=device)
    assert _wsum(region, layout, np.array([], dtype=np.int64), use_kernel=True).numel() == 0
    with pytest.raises(IndexError):
        block_digests(region, layout, [3], WSUM)


# 3 heads of 96 (48 words a run) in 7-token blocks: the kernel's tiles padded in both, rows not a multiple of its step
ODD_GEOMETRY = dict(num_layers=3, block_size=7, num_kv_heads=3, head_dim=96, dtype="bfloat16")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_format", ["2NHD", "H2ND"])
@pytest.mark.parametrize("geometry", [GEOMETRY, ODD_GEOMETRY], ids=["4x128", "3x96"])
def test_the_per_head_kernel_splits_the_digest_by_head(device, page_format, geometry):
    """Each head's share, from the kernel, equals the torch path's, and the shares add up to the block's
    digest (one pass yields both; transfer/head_digests.py)."""
    layout = KVCacheLayout(**geometry, num_blocks=4, page_format=page_format)
    region = _region(layout, seed=9, device=device)
    ids = np.array([3, 0, 3], dtype=np.int64)
    kernel = _wsum_heads(region, layout, ids, use_kernel=True).cpu()
    torch_ = _wsum_heads(region.cpu(), layout, ids, use_kernel=False)
    assert kernel.shape == (3, layout.num_kv_heads) and torch.equal(kernel, torch_)
    assert torch.equal(kernel.sum(dim=1), _wsum(region.cpu(), layout, ids, use_kernel=False))
    assert len(set(kernel[0].tolist())) == layout.num_kv_heads


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_copy_digests_the_blocks_it_wrote_in_the_same_pass(device):
    """copy_blocks_with_digests: a block-major source into a layer-outermost destination, scattered
    ids: every destination page holds its source page's bytes, nothing else is touched, and the
    digests are the torch reduction's of the blocks written. Without `digest`, the same copy."""
    src_layout = KVCacheLayout(**GEOMETRY, num_blocks=5)
    plain = KVCacheLayout(**GEOMETRY, num_blocks=6)
    dst_layout = KVCacheLayout(**GEOMETRY, num_blocks=6, layer_stride=6 * plain.page_nbytes, block_stride=plain.page_nbytes)
    src, dst = _region(src_layout, seed=10, device=device), _region(dst_layout, seed=11, device=device)
    before = dst.clone()
    src_ids, dst_ids = [4, 0, 2], [1, 5, 3]
    job = copy_blocks_with_digests(src, src_layout, src_ids, dst, dst_layout, dst_ids)
    got = job.result().values
    assert got == block_digests(dst.cpu(), dst_layout, dst_ids, WSUM).values  # the torch path, of the bytes written
    assert got == block_digests(src.cpu(), src_layout, src_ids, WSUM).values  # ... which are the source's
    src_pages, dst_pages = src_layout.page_offsets(np.array(src_ids)), dst_layout.page_offsets(np.array(dst_ids))
    touched = torch.zeros(dst.numel(), dtype=torch.bool)
    for s_row, d_row in zip(src_pages, dst_pages):
        for s, d in zip(s_row, d_row):
            assert torch.equal(dst[d : d + src_layout.page_nbytes].cpu(), src[s : s + src_layout.page_nbytes].cpu())
            touched[d : d + src_layout.page_nbytes] = True
    assert torch.equal(dst.cpu()[~touched], before.cpu()[~touched])
    again = before.clone()
    assert copy_blocks_with_digests(src, src_layout, src_ids, again, dst_layout, dst_ids, digest=False) is None
    assert torch.equal(again.cpu(), dst.cpu())
    with pytest.raises(IndexError):
        copy_blocks_with_digests(src, src_layout, [5], dst, dst_layout, [0])
    other_pages = KVCacheLayout(**GEOMETRY, num_blocks=6, page_format="H2ND")
    with pytest.raises(DigestError, match="same pages"):
        copy_blocks_with_digests(src, src_layout, [0], dst, other_pages, [0])
