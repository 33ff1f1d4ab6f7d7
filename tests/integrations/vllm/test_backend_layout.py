"""The KV layout read from an attention backend's shape contract and the tensors vLLM allocated (CPU tensors).

The backends here state the shape contract of vLLM 0.25's CUDA backends as their sources do
(vllm/v1/attention/backends/flash_attn.py and flashinfer.py: `get_kv_cache_shape`,
`get_kv_cache_stride_order` with and without the layers dimension); the tensors are laid out as
vLLM 0.25's model runners lay them out (the V1 runner's cross-layer allocation,
`allocate_uniform_kv_caches`; the V2 runner's one allocation per layer). The real backends on a GPU
are exercised by test_gpu_adapter.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: run from .venv-vllm (scripts/vllm-env)")

from kvbridge.errors import ConfigError  # noqa: E402
from kvbridge.integrations.vllm.backend_layout import Geometry, cross_layer_views, dim_names, layout_of_tensors  # noqa: E402

pytestmark = pytest.mark.vllm

GEO = Geometry(num_blocks=12, block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
NUM_LAYERS = 3


class FlashAttn:  # vLLM 0.25 FLASH_ATTN (and TRITON_ATTN), cache layout NHD
    layers_order, order = (1, 0, 2, 3, 4, 5), (0, 1, 2, 3, 4)

    @classmethod
    def get_name(cls) -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        if block_size % 16:
            raise ValueError("Block size must be a multiple of 16.")
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @classmethod
    def get_kv_cache_stride_order(cls, include_num_layers_dimension=False):
        return cls.layers_order if include_num_layers_dimension else cls.order


class FlashInferHND(FlashAttn):  # vLLM 0.25 FLASHINFER, cache layout HND
    layers_order, order = (1, 2, 4, 0, 3, 5), (0, 1, 3, 2, 4)

    @classmethod
    def get_name(cls) -> str:
        return "FLASHINFER"


def _cross_layer_tensor(backend) -> torch.Tensor:
    """As allocate_uniform_kv_caches: one buffer in the physical order of the layered stride order."""
    logical = (NUM_LAYERS, *backend.get_kv_cache_shape(GEO.num_blocks, GEO.block_size, GEO.num_kv_heads, GEO.head_size))
    return torch.zeros([logical[i] for i in backend.get_kv_cache_stride_order(True)], dtype=torch.bfloat16)


def test_dimensions_are_named_by_probing_the_backend():
    assert dim_names(FlashAttn, GEO) == ("blocks", "kv", "tokens", "heads", "dim")


def test_nhd_cross_layer_allocation_is_kvbridges_block_major_layout():
    kv = _cross_layer_tensor(FlashAttn)
    views = cross_layer_views(kv, FlashAttn, NUM_LAYERS, GEO)
    layout = layout_of_tensors(views, dim_names(FlashAttn, GEO), GEO, "FLASH_ATTN")
    assert (layout.page_format, layout.is_contiguous) == ("2NHD", True)
    # the page (layer 1, block 5), token 3, head 1 is where vLLM's own per-layer view writes it
    views[1][5, 0, 3, 1].fill_(7.0)
    view = torch.as_strided(views[0], layout.shape, layout.strides, views[0].storage_offset())
    assert view[5, 1, 0, 3, 1].eq(7.0).all() and view.sum() == 7.0 * GEO.head_size


def test_hnd_cross_layer_allocation_is_refused_naming_backend_and_layout():
    views = cross_layer_views(_cross_layer_tensor(FlashInferHND), FlashInferHND, NUM_LAYERS, GEO)
    with pytest.raises(ConfigError, match=r"FLASHINFER layer tensor.*order \['blocks', 'kv', 'heads', 'tokens', 'dim'\]"):
        layout_of_tensors(views, dim_names(FlashInferHND, GEO), GEO, "FLASHINFER")


def test_hnd_layers_in_one_buffer_are_2hnd_pages():
    buf = torch.zeros(NUM_LAYERS, GEO.num_blocks, 2, GEO.num_kv_heads, GEO.block_size, GEO.head_size)
    views = [buf[i].permute(0, 1, 3, 2, 4) for i in range(NUM_LAYERS)]  # logical (blocks, 2, tokens, heads, dim)
    geo = GEO._replace(dtype="float32")
    layout = layout_of_tensors(views, dim_names(FlashInferHND, geo), geo, "FLASHINFER")
    assert (layout.page_format, layout.layer_stride, layout.block_stride) == (
        "2HND", layout.page_nbytes * GEO.num_blocks, layout.page_nbytes,
    )  # fmt: skip


def test_one_allocation_per_layer_is_refused_with_the_fix():
    views = [torch.zeros(FlashAttn.get_kv_cache_shape(12, 16, 2, 64), dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]
    with pytest.raises(ConfigError, match="FLASH_ATTN, 2NHD pages.*VLLM_USE_V2_MODEL_RUNNER=0"):
        layout_of_tensors(views, dim_names(FlashAttn, GEO), GEO, "FLASH_ATTN")


def test_a_kernel_block_size_other_than_the_caches_is_refused():
    views = cross_layer_views(_cross_layer_tensor(FlashAttn), FlashAttn, NUM_LAYERS, GEO)
    with pytest.raises(ConfigError, match="kernel block size"):
        layout_of_tensors(views, dim_names(FlashAttn, GEO), GEO._replace(block_size=32), "FLASH_ATTN")
