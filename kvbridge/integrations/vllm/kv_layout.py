"""vLLM's KV cache -> kvbridge's `KVCacheLayout` and one strided tensor over it, without a copy.

This module reads vLLM's KV cache config (the CPU backend's placement, the geometry, the layer
order, the attention backend); `backend_layout.py` reads CUDA backends' layouts from the tensors.

vLLM 0.32 (CPU) allocates one backing buffer per KV cache group and describes it with `KVCacheTensor`:
the page of layer `l` for block `b` (all of that layer's K and V for `block_size` tokens, one
contiguous run of `page_size_bytes`) starts at `offset + l * layer_stride + b * block_stride`.
kvbridge's layout speaks the same language (`KVCacheLayout.layer_stride`/`block_stride`), so the
adapter hands kvbridge's connectors a view `[num_blocks, num_layers, *page_shape]` over vLLM's
own memory with those strides: NIXL registers vLLM's buffer, offload copies index it, and every
descriptor is computed from the strides (one per run of blocks per layer when layers are
outermost, as on CPU; one per run of blocks when blocks are outermost).

Supported: one KV cache group of full attention (no sliding window, MLA or hybrid models), one
`KVCacheTensor` holding every layer, unpadded pages. The page interior is named by the kernels that
write it (`cpu_page_format`: vLLM's CPU backend lays a page out per the ISA of its attention kernels)
so that only engines whose pages hold the same bytes exchange them as they are, and a translated
read (another engine, block size or page format) knows where each element lies.
"""

from __future__ import annotations

from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.layout import OPAQUE_FORMATS, KVCacheLayout

# vLLM's CPU attention kernels (the ISA vLLM picks per dtype, block size and head size) -> the page
# format their reshape_and_cache writes. A CPU page is [kv_heads, K|V, block_size * head_dim]; under
# the VEC kernels each head's K is column-major ([head_dim, block_size]) and V row-major
# (vLLM's csrc/cpu/cpu_attn_vec.hpp), which kvbridge names "H2ND-KT". Other kernels (and FP8 caches)
# tile pages in ways kvbridge has not mapped: their pages move whole only (kvbridge.layout.OPAQUE_FORMATS).
CPU_ISA_FORMATS = {"vec": "H2ND-KT"}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(kv_cache_config: Any, page_format: str) -> tuple[KVCacheLayout, list[str]]:
    """The kvbridge layout of vLLM's KV cache, and the layer names in layer order.

    Raises ConfigError naming what is unsupported (several groups, non-full attention, padding).
    """
    group = _full_attention_group(kv_cache_config)
    spec = group.kv_cache_spec
    tensors = [t for t in kv_cache_config.kv_cache_tensors if set(t.layers) & set(group.layer_names)]
    if len(tensors) != 1:
        raise ConfigError(
            f"KVBridgeConnector needs every layer's KV in one vLLM KVCacheTensor; this engine has {len(tensors)}"
        )
    tensor = tensors[0]
    layout = KVCacheLayout(
        num_blocks=kv_cache_config.num_blocks,
        num_layers=len(tensor.layers),
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        dtype=_dtype_name(spec.dtype),
        page_format=page_format,
        layer_stride=tensor.layer_stride,
        block_stride=tensor.block_stride,
    )
    if spec.page_size_bytes != layout.page_nbytes:
        raise ConfigError(
            f"vLLM's KV pages are {spec.page_size_bytes} B but {layout.page_nbytes} B of K and V "
            "(padded or packed pages); KVBridgeConnector supports dense pages only"
        )
    return layout, list(tensor.layers)


def cpu_page_format(vllm_config: Any, kv_cache_config: Any) -> str:
    """The page format of vLLM's CPU KV cache: by the ISA of its attention kernels (`CPU_ISA_FORMATS`),
    else the opaque format of that ISA, so that such pages are only ever moved whole."""
    isa = cpu_attention_isa(vllm_config, kv_cache_config)
    if isa in CPU_ISA_FORMATS and not geometry(kv_cache_config).dtype.startswith("float8"):
        return CPU_ISA_FORMATS[isa]
    opaque = f"vllm-cpu-{isa}"
    return opaque if opaque in OPAQUE_FORMATS else "vllm-cpu-unknown"


def cpu_attention_isa(vllm_config: Any, kv_cache_config: Any) -> str:
    """The ISA vLLM's CPU attention runs its layers with: what its metadata builder set on the layers
    (`layer.isa`), else what vLLM's own `_get_attn_isa` picks, else "unknown"."""
    context = vllm_config.compilation_config.static_forward_context
    isas = {getattr(context.get(name), "isa", None) for name in layer_names_in_order(kv_cache_config)}
    if len(isas) == 1 and None not in isas:
        return str(isas.pop())
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        spec = _full_attention_group(kv_cache_config).kv_cache_spec
        return str(_get_attn_isa(vllm_config.model_config.dtype, spec.block_size, spec.head_size,
                                 vllm_config.cache_config.cache_dtype))  # fmt: skip
    except Exception:  # noqa: BLE001 - another vLLM: its kernels' layout is unknown, so its pages are opaque
        return "unknown"


def strided_view(kv_caches: dict[str, Any], layer_names: list[str], layout: KVCacheLayout):
    """One tensor `[num_blocks, num_layers, *page_shape]` over vLLM's per-layer KV tensors.

    Checks that vLLM's tensors are where the layout says (layer l's block 0 at layer_stride * l
    from layer 0's, each page contiguous), so a change in vLLM's allocation is an error here, not
    KV written to the wrong bytes.
    """
    import torch

    missing = [name for name in layer_names if name not in kv_caches]
    if missing:
        raise ConfigError(f"vLLM registered no KV tensor for layers {missing[:3]}")
    first = kv_caches[layer_names[0]]
    if _dtype_name(first.dtype) != layout.dtype:
        raise ConfigError(f"vLLM's KV tensors are {first.dtype}, its KV cache spec says {layout.dtype}")
    base = first.data_ptr()
    for i, name in enumerate(layer_names):
        tensor = kv_caches[name]
        if tensor.data_ptr() != base + i * layout.layer_stride_bytes or tensor.shape[0] != layout.num_blocks:
            raise ConfigError(
                f"vLLM's KV tensor of layer {name} is not where its KVCacheTensor says (layer {i}); "
                "this vLLM version allocates KV differently from what KVBridgeConnector supports"
            )
        if tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            raise ConfigError(f"vLLM's KV tensor of layer {name} is not in the same buffer as layer 0's")
    return torch.as_strided(first, layout.shape, layout.strides, first.storage_offset())



def _full_attention_group(kv_cache_config: Any) -> Any:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"KVBridgeConnector supports models with one KV cache group (full attention in every layer); "
            f"this model has {len(groups)} (sliding-window, hybrid or encoder layers)"
        )
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec" or getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise ConfigError(f"KVBridgeConnector supports full attention KV caches; this model's is {type(spec).__name__}")
    return groups[0]


def layer_names_in_order(kv_cache_config: Any) -> list[str]:
    """The attention layers in the order of vLLM's KV cache tensors (its layer order on every version)."""
    group = _full_attention_group(kv_cache_config)
    ours = set(group.layer_names)
    names: list[str] = []
    for tensor in kv_cache_config.kv_cache_tensors:
        layers = getattr(tensor, "shared_by", None) or getattr(tensor, "layers", ())  # 0.25: shared_by; 0.32: layers
        names += [name for name in layers if name in ours and name not in names]
    if set(names) != ours:
        raise ConfigError(f"vLLM's KV cache tensors do not cover its attention layers ({sorted(ours - set(names))[:3]})")
    return names


def geometry(kv_cache_config: Any):
    """Blocks, block size, heads, head size and dtype of the one full-attention group."""
    from kvbridge.integrations.vllm.backend_layout import Geometry

    spec = _full_attention_group(kv_cache_config).kv_cache_spec
    return Geometry(kv_cache_config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, _dtype_name(spec.dtype))


def attention_backend_name(vllm_config: Any, layer_names: list[str]) -> str:
    """The name of the attention backend vLLM chose, for messages only (the layout is read from the
    tensors): one name, or the names joined, or "unknown backend"."""
    try:
        return attention_backend(vllm_config, layer_names).get_name()
    except (ConfigError, AttributeError, TypeError) as exc:
        return f"unknown backend ({exc})"


def attention_backend(vllm_config: Any, layer_names: list[str]) -> Any:
    """The attention backend class vLLM chose for these layers (one for all of them, or ConfigError)."""
    context = vllm_config.compilation_config.static_forward_context
    backends = set()
    for name in layer_names:
        layer = context.get(name)
        getter = getattr(layer, "get_attn_backend", None)
        if getter is None:
            raise ConfigError(f"vLLM's layer {name} has no attention backend KVBridgeConnector can read")
        backends.add(getter())
    if len(backends) != 1:
        names = sorted(b.get_name() for b in backends)
        raise ConfigError(f"KVBridgeConnector needs one attention backend for every layer; this model has {names}")
    return backends.pop()
