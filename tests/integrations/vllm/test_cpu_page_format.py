"""The page format of vLLM's CPU KV cache follows the kernels vLLM runs attention with (kv_layout.cpu_page_format).

vLLM's CPU backend picks an ISA per dtype, block size and head size and sets it on every attention
layer (`layer.isa`); under the VEC kernels each head's K is column-major (kvbridge's "H2ND-KT"), the
others tile pages in ways kvbridge has not mapped (opaque: moved whole only, never translated).
test_mixed_engines.py reads real VEC pages from and into kvbridge's engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: run from .venv-vllm (scripts/vllm-env)")

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402

from kvbridge.integrations.vllm.kv_layout import cpu_page_format  # noqa: E402
from kvbridge.layout import OPAQUE_FORMATS  # noqa: E402

pytestmark = pytest.mark.vllm

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def _kv_cache_config(dtype=torch.float32) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=dtype)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=2 * 4 * page, layers=LAYERS, layer_stride=4 * page, block_stride=page)
    return KVCacheConfig(num_blocks=4, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


def _vllm_config(isa: str | None):
    layers = {name: SimpleNamespace() if isa is None else SimpleNamespace(isa=isa) for name in LAYERS}
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(dtype=torch.float32),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


@pytest.mark.parametrize(("isa", "page_format"), [("vec", "H2ND-KT"), ("amx", "vllm-cpu-amx"),
                                                  ("neon", "vllm-cpu-neon"), ("next-year", "vllm-cpu-unknown")])  # fmt: skip
def test_the_layers_isa_names_the_page_format(isa, page_format):
    assert cpu_page_format(_vllm_config(isa), _kv_cache_config()) == page_format


def test_fp8_pages_of_the_vec_kernels_are_opaque():
    fmt = cpu_page_format(_vllm_config("vec"), _kv_cache_config(torch.float8_e4m3fn))
    assert fmt == "vllm-cpu-vec" and fmt in OPAQUE_FORMATS


def test_layers_without_an_isa_get_the_one_vllm_would_pick():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.float32, 128, 64, "auto")
    expected = "H2ND-KT" if isa == "vec" else f"vllm-cpu-{isa}"
    assert cpu_page_format(_vllm_config(None), _kv_cache_config()) == expected
