"""The KV layout of a vLLM attention backend, read at run time from the backend and the tensors vLLM allocated.

No table of backends: the backend says which logical dimension is which (`get_kv_cache_shape`,
probed by changing one argument at a time), and the tensors say where vLLM put them (their
strides and addresses). What kvbridge can express is one buffer of dense pages:

    page (layer l, block b) at  l * layer_stride + b * block_stride  from page (0, 0),

each page one layer's K and V for `block_size` tokens in one of kvbridge's page formats
(`kvbridge.layout.PAGE_FORMATS`: "2NHD" is FLASH_ATTN / TRITON_ATTN / FLASHINFER with the NHD
layout, "2HND" the HND layout). Two placements of vLLM 0.25 on CUDA qualify:

* the cross-layer allocation vLLM makes when the connector prefers it (V1 model runner,
  `prefer_cross_layer_blocks`): one tensor, blocks outermost, all of a block's layers adjacent —
  kvbridge's own block-major layout, one NIXL descriptor per run of blocks;
* per-layer tensors that sit in one allocation at a constant layer stride.

Anything else is refused at start-up with a `ConfigError` that names the backend, the layout it
found and what to change: per-layer tensors in separate allocations (vLLM 0.25's V2 model runner,
which ignores `prefer_cross_layer_blocks`), the HND cross-layer allocation (heads outside
layers: a layer's page is not contiguous), padded or quantized-with-scales pages.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvbridge.errors import ConfigError
from kvbridge.layout import KVCacheLayout

# logical dimension -> its letter in a kvbridge page format
_LETTERS = {"kv": "2", "tokens": "N", "heads": "H", "dim": "D"}


class Geometry(NamedTuple):
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str


def dim_names(backend: Any, geo: Geometry) -> tuple[str, ...]:
    """The logical dimensions of `backend.get_kv_cache_shape(...)`, named by probing: each probe
    changes one argument, and the one dimension that changes with it is that argument's."""
    name = backend.get_name()
    args = (geo.num_blocks, geo.block_size, geo.num_kv_heads, geo.head_size)
    try:
        base = tuple(backend.get_kv_cache_shape(*args))
        probes = {
            "blocks": (geo.num_blocks + 1, geo.block_size, geo.num_kv_heads, geo.head_size),
            "tokens": (geo.num_blocks, geo.block_size * 2, geo.num_kv_heads, geo.head_size),
            "heads": (geo.num_blocks, geo.block_size, geo.num_kv_heads + 1, geo.head_size),
            "dim": (geo.num_blocks, geo.block_size, geo.num_kv_heads, geo.head_size + 16),
        }
        names: list[str | None] = [None] * len(base)
        for dim, probe in probes.items():
            shape = tuple(backend.get_kv_cache_shape(*probe))
            changed = [i for i, (a, b) in enumerate(zip(base, shape)) if a != b]
            if len(shape) != len(base) or len(changed) != 1:
                raise ConfigError(f"changing {dim} changed dimensions {changed} of {shape}")
            names[changed[0]] = dim
        rest = [i for i, n in enumerate(names) if n is None]
        if len(rest) != 1 or base[rest[0]] != 2:
            raise ConfigError(f"expected one K|V dimension of size 2 besides blocks, tokens, heads, dim; got {base}")
        names[rest[0]] = "kv"
    except (ConfigError, ValueError, NotImplementedError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"KVBridgeConnector cannot read the KV layout of vLLM's {name} attention backend "
            f"(get_kv_cache_shape{args}): {exc}; kvbridge supports backends whose KV cache is "
            "[num_blocks, 2, block_size, num_kv_heads, head_size] in some order (FLASH_ATTN, TRITON_ATTN, FLASHINFER)"
        ) from exc
    return tuple(n for n in names if n is not None)


class PagePlacement(NamedTuple):
    page_format: str
    block_stride: int  # bytes


def page_placement(tensor: Any, names: tuple[str, ...], backend_name: str) -> PagePlacement:
    """Page format and block stride of one layer's KV tensor (logical shape, any strides)."""
    order = sorted(range(len(names)), key=lambda i: (-tensor.stride(i), i))  # physical, outermost first
    physical = [names[i] for i in order]
    found = f"{backend_name} layer tensor: shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}, order {physical}"
    if physical[0] != "blocks":
        raise ConfigError(f"KVBridgeConnector needs blocks outermost in each layer's KV; {found}")
    inner, expected = order[1:], 1
    for i in reversed(inner):  # the page must be dense: each stride steps over everything inside it
        if tensor.shape[i] > 1 and tensor.stride(i) != expected:
            raise ConfigError(f"KVBridgeConnector needs dense pages (no padding, no interleaved layers); {found}")
        expected *= tensor.shape[i]
    page_format = "".join(_LETTERS[names[i]] for i in inner)
    from kvbridge.layout import PAGE_FORMATS

    if page_format not in PAGE_FORMATS:
        raise ConfigError(f"KVBridgeConnector has no page format {page_format} (known: {sorted(PAGE_FORMATS)}); {found}")
    return PagePlacement(page_format, tensor.stride(order[0]) * tensor.element_size())


def layout_of_tensors(tensors: list[Any], names: tuple[str, ...], geo: Geometry, backend_name: str) -> KVCacheLayout:
    """kvbridge's layout of vLLM's per-layer KV tensors (in layer order), or a ConfigError saying why not."""
    first = tensors[0]
    blocks_dim, tokens_dim = names.index("blocks"), names.index("tokens")
    if first.shape[blocks_dim] != geo.num_blocks or first.shape[tokens_dim] != geo.block_size:
        raise ConfigError(
            f"vLLM's {backend_name} KV tensors hold {first.shape[blocks_dim]} blocks of {first.shape[tokens_dim]} tokens "
            f"but its scheduler manages {geo.num_blocks} blocks of {geo.block_size} (a kernel block size other than the "
            "cache's); KVBridgeConnector needs them equal"
        )
    placement = page_placement(first, names, backend_name)
    base = first.data_ptr()
    layer_stride = tensors[1].data_ptr() - base if len(tensors) > 1 else 0
    for i, tensor in enumerate(tensors):
        if page_placement(tensor, names, backend_name) != placement or tensor.shape != first.shape:
            raise ConfigError(f"vLLM's {backend_name} KV tensor of layer {i} is laid out unlike layer 0's")
        if tensor.data_ptr() != base + i * layer_stride or not _same_allocation(tensor, first):
            raise ConfigError(
                f"vLLM allocated each layer's KV ({backend_name}, {placement.page_format} pages) separately; "
                "KVBridgeConnector needs every layer in one buffer. vLLM makes one (the cross-layer allocation) "
                "for connectors that ask, in its V1 model runner: start vLLM with VLLM_USE_V2_MODEL_RUNNER=0"
            )
    if len(tensors) == 1:
        layer_stride = placement.block_stride  # any value no smaller than a page; one layer never steps it
    try:
        return KVCacheLayout(
            num_blocks=geo.num_blocks,
            num_layers=len(tensors),
            block_size=geo.block_size,
            num_kv_heads=geo.num_kv_heads,
            head_dim=geo.head_size,
            dtype=geo.dtype,
            page_format=placement.page_format,
            layer_stride=layer_stride,
            block_stride=placement.block_stride,
        )
    except ConfigError as exc:
        raise ConfigError(f"vLLM's {backend_name} KV layout cannot be expressed by kvbridge: {exc}") from exc


def _same_allocation(a: Any, b: Any) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def cross_layer_views(kv_cache: Any, backend: Any, num_layers: int, geo: Geometry) -> list[Any]:
    """The per-layer views (logical shape) of vLLM's cross-layer KV tensor, as vLLM's own model runner makes them:
    `kv_cache` is in physical order, `get_kv_cache_stride_order(include_num_layers_dimension=True)` maps it back."""
    logical = (num_layers, *backend.get_kv_cache_shape(geo.num_blocks, geo.block_size, geo.num_kv_heads, geo.head_size))
    try:
        order = tuple(backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
    except (AttributeError, NotImplementedError, TypeError):
        order = tuple(range(len(logical)))
    if tuple(kv_cache.shape) != tuple(logical[i] for i in order):
        raise ConfigError(
            f"vLLM's cross-layer KV tensor of {backend.get_name()} has shape {tuple(kv_cache.shape)}, not the "
            f"{tuple(logical[i] for i in order)} its backend describes"
        )
    inverse = [order.index(i) for i in range(len(order))]
    permuted = kv_cache.permute(*inverse)
    return [permuted[i] for i in range(num_layers)]
