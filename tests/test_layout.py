"""KVCacheLayout: page formats, strided placements, validation, and the compatibility hash."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from kvbridge.errors import ConfigError
from kvbridge.layout import OPAQUE_FORMATS, PAGE_FORMATS, KVCacheLayout

GEOMETRY = dict(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
PAGE = 2 * 4 * 2 * 8 * 2  # page_nbytes: 256


def layer_major(num_blocks: int, page_format: str = "H2ND", **geometry) -> KVCacheLayout:
    """vLLM's CPU layout: every block's page of layer 0, then layer 1..."""
    base = KVCacheLayout(num_blocks, **{**GEOMETRY, **geometry}, page_format=page_format)
    return dataclasses.replace(base, layer_stride=num_blocks * base.page_nbytes, block_stride=base.page_nbytes)


def padded(num_blocks: int, pad: int = 64) -> KVCacheLayout:
    """Block-outermost with `pad` bytes after each block."""
    return KVCacheLayout(num_blocks, **GEOMETRY, layer_stride=PAGE, block_stride=3 * PAGE + pad)


def test_page_formats_name_the_page_interior():
    block_major = KVCacheLayout(5, **GEOMETRY)
    assert block_major.page_format == "2NHD" and block_major.page_shape == (2, 4, 2, 8)
    assert block_major.shape == (5, 3, 2, 4, 2, 8) and block_major.block_shape == (3, 2, 4, 2, 8)
    vllm_cpu = KVCacheLayout(5, **GEOMETRY, page_format="H2ND")
    assert vllm_cpu.page_shape == (2, 2, 4, 8) and vllm_cpu.shape == (5, 3, 2, 2, 4, 8)
    assert block_major.page_nbytes == vllm_cpu.page_nbytes == PAGE and block_major.block_nbytes == 3 * PAGE
    vllm_cuda_hnd = KVCacheLayout(5, **GEOMETRY, page_format="2HND")
    assert vllm_cuda_hnd.page_shape == (2, 2, 4, 8) and vllm_cuda_hnd.page_nbytes == PAGE
    with pytest.raises(ConfigError, match=r"page_format='NHD2'; expected one of \['2HND', '2NHD', 'H2ND', 'H2ND-KT', "):
        KVCacheLayout(5, **GEOMETRY, page_format="NHD2")
    assert sorted(set(PAGE_FORMATS) - OPAQUE_FORMATS) == ["2HND", "2NHD", "H2ND", "H2ND-KT", "HN2D", "NH2D"]


def test_a_k_transposed_page_keeps_each_heads_k_token_innermost():
    """vLLM's CPU pages under its VEC kernels: per head, K is [head_dim, block_size] and V [block_size, head_dim]."""
    e = 2  # bfloat16
    kt = KVCacheLayout(5, **GEOMETRY, page_format="H2ND-KT")
    assert kt.page_shape == (2, 2, 4, 8) and kt.page_nbytes == PAGE
    # (K|V, ((token, head, dim) of K, (token, head, dim) of V)), in bytes
    assert kt.page_dim_strides() == (4 * 8 * e, ((e, 2 * 4 * 8 * e, 4 * e), (8 * e, 2 * 4 * 8 * e, e)))
    assert KVCacheLayout(5, **GEOMETRY, page_format="H2ND").page_dim_strides() == (
        4 * 8 * e, ((8 * e, 2 * 4 * 8 * e, e),) * 2)
    assert kt.compat_hash("m") != KVCacheLayout(5, **GEOMETRY, page_format="H2ND").compat_hash("m")
    assert kt.model_hash("m") == KVCacheLayout(5, **GEOMETRY).model_hash("m")  # translated to and from any format


def test_opaque_pages_move_whole_only():
    """vLLM CPU pages of kernels whose tiling kvbridge has not mapped: their model hash names the format and
    block size, so only the same format and block size pair with them (by compat hash); no interior strides."""
    amx = KVCacheLayout(5, **GEOMETRY, page_format="vllm-cpu-amx")
    assert "vllm-cpu-amx" in OPAQUE_FORMATS and amx.page_nbytes == PAGE
    assert amx.model_hash("m") != KVCacheLayout(5, **GEOMETRY).model_hash("m")
    assert amx.model_hash("m") != KVCacheLayout(5, **{**GEOMETRY, "block_size": 8}, page_format="vllm-cpu-amx").model_hash("m")
    assert amx.model_hash("m") == KVCacheLayout(9, **GEOMETRY, page_format="vllm-cpu-amx").model_hash("m")
    with pytest.raises(ConfigError, match="move whole only"):
        amx.page_dim_strides()


def test_block_major_is_the_default_and_a_contiguous_tensor():
    layout = KVCacheLayout(5, **GEOMETRY)
    assert (layout.layer_stride_bytes, layout.block_stride_bytes) == (PAGE, 3 * PAGE)
    assert layout.is_contiguous and layout.is_block_contiguous
    assert layout.region_nbytes == layout.total_nbytes == 5 * 3 * PAGE
    assert layout.strides == torch.zeros(layout.shape).stride()
    assert layout.block_offsets([0, 4]).tolist() == [0, 4 * 3 * PAGE]


@pytest.mark.parametrize("make", [lambda: KVCacheLayout(6, **GEOMETRY), lambda: layer_major(6), lambda: padded(6),
                                  lambda: layer_major(6, "2NHD")], ids=["block-major", "layer-major", "padded", "layer-major-2NHD"])
def test_page_offsets_are_where_torch_puts_each_page(make):
    """layout.py's arithmetic is the truth of the view torch.as_strided builds from its strides."""
    layout = make()
    buffer = torch.zeros(layout.region_nbytes // layout.element_size, dtype=torch.bfloat16)
    kv = buffer.as_strided(layout.shape, layout.strides)
    offsets = layout.page_offsets(range(layout.num_blocks))  # [num_blocks, L]
    assert offsets.shape == (6, 3) and offsets.dtype == np.int64
    for b in range(layout.num_blocks):
        assert kv[b].data_ptr() - kv.data_ptr() == layout.block_offset(b) == offsets[b, 0]
        for layer in range(layout.num_layers):
            page = kv[b, layer]
            assert page.is_contiguous() and page.numel() * 2 == layout.page_nbytes
            assert page.data_ptr() - kv.data_ptr() == offsets[b, layer]
    last = kv[-1, -1]
    assert last.data_ptr() - kv.data_ptr() + layout.page_nbytes == layout.region_nbytes  # the last page ends the region
    # every page distinct, nothing overlapping: writing each page's index marks every element once
    kv.copy_(torch.arange(6 * 3, dtype=torch.bfloat16).reshape(6, 3, 1, 1, 1, 1).expand(layout.shape))
    assert int((buffer != 0).sum()) + layout.page_nbytes // 2 == 6 * 3 * layout.page_nbytes // 2  # page (0, 0) holds 0


def test_strided_layouts_are_described_exactly():
    lm = layer_major(6)
    assert (lm.layer_stride_bytes, lm.block_stride_bytes) == (6 * PAGE, PAGE)
    assert not lm.is_contiguous and not lm.is_block_contiguous
    assert lm.region_nbytes == lm.total_nbytes == 18 * PAGE  # packed: no padding
    pd = padded(6)
    assert pd.is_block_contiguous and not pd.is_contiguous
    assert pd.total_nbytes == 18 * PAGE and pd.region_nbytes == 5 * (3 * PAGE + 64) + 3 * PAGE
    one_layer = KVCacheLayout(6, **{**GEOMETRY, "num_layers": 1}, layer_stride=10 * PAGE, block_stride=PAGE)
    assert one_layer.is_contiguous  # a stride that is never stepped over does not matter
    explicit_default = KVCacheLayout(6, **GEOMETRY, layer_stride=PAGE, block_stride=3 * PAGE)
    assert explicit_default.is_contiguous and explicit_default.region_nbytes == 18 * PAGE


@pytest.mark.parametrize(
    "strides, match",
    [
        ((PAGE, 2 * PAGE), "block_stride=512 B must be at least 768 B"),  # blocks overlap the last layer
        ((PAGE // 2, 3 * PAGE), "layer_stride=128 B must be at least 256 B"),  # layers overlap inside a page
        ((5 * PAGE, PAGE), "layer_stride=1280 B must be at least 1536 B"),  # layer-major with too few blocks' room
        ((PAGE, 0), "give both layer_stride and block_stride, or neither"),
        ((-PAGE, PAGE), "non-negative multiple"),
        ((PAGE + 1, 3 * PAGE + 3), "non-negative multiple of the 2-byte element"),
        ((2 * PAGE, 2 * PAGE), "must be at least"),  # two pages at one address
    ],
)
def test_overlapping_or_malformed_strides_are_refused_with_a_clear_error(strides, match):
    with pytest.raises(ConfigError, match=match):
        KVCacheLayout(6, **GEOMETRY, layer_stride=strides[0], block_stride=strides[1])


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_validation_accepts_exactly_the_strides_whose_pages_do_not_overlap(seed):
    """Brute force on tiny layouts: the check refuses overlaps and accepts every nested placement."""
    rng = random.Random(seed)
    print(f"seed={seed}")
    tiny = dict(block_size=1, num_kv_heads=1, head_dim=2, dtype="float32")  # 16-byte pages
    for _ in range(300):
        num_blocks, num_layers = rng.randrange(1, 5), rng.randrange(1, 4)
        layer_stride, block_stride = 4 * rng.randrange(1, 30), 4 * rng.randrange(1, 30)
        starts = [l * layer_stride + b * block_stride for l in range(num_layers) for b in range(num_blocks)]
        overlap = any(abs(x - y) < 16 for i, x in enumerate(starts) for y in starts[i + 1:])
        try:
            KVCacheLayout(num_blocks, num_layers, **tiny, layer_stride=layer_stride, block_stride=block_stride)
            accepted = True
        except ConfigError:
            accepted = False
        assert not (accepted and overlap), (num_blocks, num_layers, layer_stride, block_stride)
        inner, outer = sorted([(layer_stride, num_layers), (block_stride, num_blocks)])
        nested = all(s >= 16 for s, n in (inner, outer) if n > 1) and (
            inner[1] == 1 or outer[1] == 1 or outer[0] >= (inner[1] - 1) * inner[0] + 16)
        assert accepted == nested, (num_blocks, num_layers, layer_stride, block_stride)


def test_with_num_blocks_keeps_strides_and_block_major_drops_them():
    assert KVCacheLayout(6, **GEOMETRY).with_num_blocks(9) == KVCacheLayout(9, **GEOMETRY)
    pd = padded(6)
    assert pd.with_num_blocks(9).block_stride_bytes == pd.block_stride_bytes  # padding is per block
    lm = layer_major(6)
    assert lm.with_num_blocks(4).layer_stride_bytes == 6 * PAGE  # the same buffer, fewer blocks used
    with pytest.raises(ConfigError, match="layer_stride"):
        lm.with_num_blocks(7)  # would run into the next layer's pages
    host = lm.block_major(10)
    assert host == KVCacheLayout(10, **GEOMETRY, page_format="H2ND") and host.is_contiguous


def test_compat_hash_covers_the_page_format_but_not_placement():
    block_major = KVCacheLayout(6, **GEOMETRY)
    h = block_major.compat_hash("m")
    # the hash of a block-major layout is the one it had before page formats and strides existed:
    # older peers and disk-tier files written by them still match
    assert h == "582cf65f61dd362e225ff3445f263575"
    assert KVCacheLayout(64, 2, 4, 2, 8, "bfloat16").compat_hash("tiny-test-model") == "ddee57428753604c7e2c76bd896fb8c3"
    assert padded(6).compat_hash("m") == layer_major(9, "2NHD").compat_hash("m") == h
    assert KVCacheLayout(6, **GEOMETRY, page_format="H2ND").compat_hash("m") != h
    assert layer_major(6).compat_hash("m") == layer_major(12).compat_hash("m")
    assert layer_major(6).compat_hash("m") == KVCacheLayout(2, **GEOMETRY, page_format="H2ND").compat_hash("m")
    assert block_major.compat_hash("other-model") != h
    assert block_major.geometry_key() == (3, 4, 2, 8, "bfloat16", "2NHD")
    assert layer_major(6).geometry_key() != block_major.geometry_key()
