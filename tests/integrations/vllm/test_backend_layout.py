"""The KV layout read from the tensors vLLM allocated (their shapes and strides), on CPU tensors.

Each fixture allocates and views memory as vLLM does on CUDA, step for step, with its recorded
shapes and stride orders:

* vLLM 0.25 (vllm/v1/attention/backends/{flash_attn,triton_attn,flashinfer}.py: every backend's
  `get_kv_cache_shape` is `(num_blocks, 2, block_size, num_kv_heads, head_size)`; stride order NHD
  `(0, 1, 2, 3, 4)`, HND `(0, 1, 3, 2, 4)`, with the layers dimension NHD `(1, 0, 2, 3, 4, 5)`);
  its V2 model runner (vllm/v1/worker/gpu/attn_utils.py, `_allocate_kv_cache`: one
  `torch.zeros(size, int8)` per layer, viewed in the permuted shape, then permuted back); its V1
  runner's cross-layer allocation (one buffer in the physical order of the layered stride order);
* vLLM 0.32's CUDA backends (vllm/v1/kv_cache_interface.py, `create_kv_cache_views`: one int8
  buffer per KV cache group, a 5D `[L, B, H, N, C]` strided view, C = K|V of one head in bytes,
  strides by `KVCacheLayout.stride_order`, each layer `view_5d[l].view(dtype)`), which have no
  `get_kv_cache_shape` any more.

No backend object is consulted: the reader names dimensions by size (and by vLLM's order where
sizes coincide). The real backends on a GPU: test_gpu_adapter.py, test_gpu_per_layer.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: run from .venv-vllm (scripts/vllm-env)")

from kvbridge.errors import ConfigError  # noqa: E402
from kvbridge.integrations.vllm.backend_layout import (
    Geometry,
    cross_layer_views,
    dim_names,
    layer_views,
    layout_of_tensors,
)  # noqa: E402
from kvbridge.layer_tensors import LayerTensors  # noqa: E402

pytestmark = pytest.mark.vllm

GEO = Geometry(num_blocks=12, block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
NUM_LAYERS = 3
SHAPE_025 = (GEO.num_blocks, 2, GEO.block_size, GEO.num_kv_heads, GEO.head_size)  # get_kv_cache_shape, 0.25
NHD, HND = (0, 1, 2, 3, 4), (0, 1, 3, 2, 4)


def v025_layer(order, shape=SHAPE_025, dtype=torch.bfloat16) -> torch.Tensor:
    """vLLM 0.25 V2 runner: `_reshape_attention_kv_cache` of one layer's own int8 allocation."""
    raw = torch.zeros(int(torch.tensor(shape).prod()) * torch.finfo(dtype).bits // 8, dtype=torch.int8)
    permuted = raw.view(dtype).view(tuple(shape[i] for i in order))
    return permuted.permute(*[order.index(i) for i in range(len(order))])


def v025_cross_layer() -> torch.Tensor:
    """vLLM 0.25 V1 runner, NHD: one buffer [num_blocks, num_layers, 2, block_size, heads, head_size]."""
    logical = (NUM_LAYERS, *SHAPE_025)
    return torch.zeros([logical[i] for i in (1, 0, 2, 3, 4, 5)], dtype=torch.bfloat16)


# vLLM 0.32's KVCacheLayout stride orders over logical [L, B, H, N, C]
LBNHC, LBHNC, BLNHC, BHLNC = (0, 1, 3, 2, 4), (0, 1, 2, 3, 4), (1, 0, 3, 2, 4), (1, 2, 0, 3, 4)


def v032_layers(order, geo=GEO) -> list[torch.Tensor]:
    """vLLM 0.32 CUDA: `create_kv_cache_views` over one int8 buffer (no padding, no fixed strides)."""
    c_bytes = 2 * geo.head_size * 2  # (head_size + head_size_v) * bf16
    shape = (NUM_LAYERS, geo.num_blocks, geo.num_kv_heads, geo.block_size, c_bytes)
    strides, current = [0] * 5, 1
    for dim in reversed(order):  # compute_layout_strides
        strides[dim] = current
        current *= shape[dim]
    raw = torch.zeros(current, dtype=torch.int8)
    view_5d = torch.as_strided(raw, shape, strides, 0)
    return [view_5d[i].view(torch.bfloat16) for i in range(NUM_LAYERS)]


def _read(tensors, geo=GEO, name="FLASH_ATTN"):
    layout, is_per_layer = layout_of_tensors(tensors, geo, name)
    return layout, is_per_layer


@pytest.mark.parametrize(("order", "page_format"), [(NHD, "2NHD"), (HND, "2HND")])
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"])
def test_v025_v2_runner_per_layer(backend, order, page_format):
    tensors = [v025_layer(order) for _ in range(NUM_LAYERS)]
    layout, is_per_layer = _read(tensors, name=backend)
    page = 2 * GEO.block_size * GEO.num_kv_heads * GEO.head_size * 2
    assert is_per_layer and layout.page_format == page_format
    assert layout.block_stride_bytes == page and layout.layer_stride_bytes > GEO.num_blocks * page  # a gap between layers
    kv = LayerTensors(layer_views(tensors, layout), layout)
    # block b of layer l, as vLLM's kernels address it, is the LayerTensors' page (b, l)
    tensors[1][5, 1, 3, 1, :7] = torch.arange(1, 8, dtype=torch.bfloat16)  # V of token 3, head 1
    got = kv.index_select(0, torch.tensor([5]))[0, 1]  # [*page_shape]
    want = tensors[1][5] if order == NHD else tensors[1][5].permute(0, 2, 1, 3)  # 2NHD / 2HND page order
    assert torch.equal(got, want)


def test_v025_v1_runner_cross_layer_is_block_major():
    views = cross_layer_views(v025_cross_layer(), NUM_LAYERS, GEO, "FLASH_ATTN")
    layout, is_per_layer = _read(views)
    assert not is_per_layer and layout.page_format == "2NHD" and layout.is_contiguous


def test_v025_shared_dims_follow_vllm_order():
    """2 KV heads (as many as K|V) and 64 tokens per block (as many as the head size): vLLM's order names them."""
    geo = GEO._replace(block_size=64)
    shape = (geo.num_blocks, 2, 64, 2, 64)
    assert dim_names(shape, 2, geo, "X") == ("blocks", "kv", "tokens", "heads", "dim")
    layout, _ = _read([v025_layer(HND, shape) for _ in range(2)], geo)
    assert layout.page_format == "2HND"


@pytest.mark.parametrize(("order", "page_format", "block_major"), [
    (LBNHC, "NH2D", False), (LBHNC, "HN2D", False), (BLNHC, "NH2D", True),
])  # fmt: skip
def test_v032_cuda_one_buffer(order, page_format, block_major):
    tensors = v032_layers(order)
    assert tensors[0].dim() == 4 and tensors[0].shape[-1] == 2 * GEO.head_size
    layout, is_per_layer = _read(tensors, name="FLASH_ATTN")
    assert not is_per_layer and layout.page_format == page_format and layout.is_contiguous == block_major
    # the page's (token, head, K|V, dim) is where vLLM's view has it: K of head h, token n at [b, h, n, :D]
    tensors[2][3, 1, 5, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.bfloat16)
    tensors[2][3, 1, 5, GEO.head_size : GEO.head_size + 2] = torch.tensor([7, 8], dtype=torch.bfloat16)
    view = layer_views(tensors, layout)[2][3]  # [N, H, 2, D] or [H, N, 2, D]
    page = view if page_format == "NH2D" else view.permute(1, 0, 2, 3)
    assert page[5, 1, 0, :4].tolist() == [1, 2, 3, 4] and page[5, 1, 1, :2].tolist() == [7, 8]


def test_v032_heads_outside_layers_is_refused():
    """BHLNC: a layer's page is split across heads (another layer's pages between): named, not misread."""
    with pytest.raises(ConfigError, match="dense pages"):
        _read(v032_layers(BHLNC))


def test_kernel_block_size_other_than_the_cache_is_refused():
    with pytest.raises(ConfigError, match="kernel block"):
        _read([v025_layer(NHD) for _ in range(2)], GEO._replace(block_size=32))


def test_padding_between_pages_is_a_block_stride():
    """vLLM's padded pages (page_size_padded): dense pages further apart; the block stride says how far."""
    raw = torch.zeros(GEO.num_blocks * (2 * 16 * 2 * 64 + 64), dtype=torch.bfloat16)
    padded = [torch.as_strided(raw, SHAPE_025, (2 * 16 * 2 * 64 + 64, 2048, 128, 64, 1)) for _ in range(1)]
    layout, _ = _read(padded)
    assert layout.block_stride_bytes == (2 * 16 * 2 * 64 + 64) * 2 and layout.page_nbytes == 2 * 16 * 2 * 64 * 2


def test_unknown_rank_is_refused():
    with pytest.raises(ConfigError, match="knows KV tensors of"):
        _read([torch.zeros(12, 2, 16 * 2 * 64)])


def test_ambiguous_dims_outside_vllm_order_are_refused():
    """Heads and tokens of one size, in an order vLLM does not use: two namings fit, neither is vLLM's."""
    geo = GEO._replace(num_kv_heads=16)
    tensor = torch.zeros(geo.num_blocks, 16, 64, 2, 16)  # blocks, ?, dim, kv, ?
    with pytest.raises(ConfigError, match="cannot tell the dimensions"):
        _read([tensor], geo)
