"""The KV layout of vLLM's attention layers, read at run time from the tensors vLLM allocated.

No table of backends or versions, and no call into the backend: a tensor's dimensions are named
by their sizes (the KV cache spec gives blocks, block size, KV heads and head size), and, where
two sizes coincide, by the order vLLM gives them (`CONVENTIONS`, by the tensor's rank); its
strides then say where vLLM put them. What kvbridge can express is dense pages:

    page (layer l, block b), `block_stride` from page (l, b - 1),

each page one layer's K and V for `block_size` tokens in one of kvbridge's page formats
(`kvbridge.layout.PAGE_FORMATS`): "2NHD" is FLASH_ATTN / TRITON_ATTN / FLASHINFER of vLLM 0.25 with
the NHD layout, "2HND" the HND layout, "NH2D" / "HN2D" vLLM 0.32's CUDA pages (a head's K and V
side by side, its LBNHC / LBHNC layouts). The layers lie

* in one allocation at a constant layer stride (vLLM 0.25's cross-layer allocation, which its V1
  model runner makes when the connector prefers it: kvbridge's own block-major layout; vLLM 0.32's
  one buffer per KV cache group): one region, one view; or
* each in an allocation of its own (vLLM 0.25's V2 model runner, its default on GPUs): one NIXL
  region per layer, registered at once (`kvbridge.layer_tensors`).

Anything else is refused at start-up with a `ConfigError` that names the backend, the shape,
strides and dimension order found, and what to change: dimensions no geometry explains or that
sizes and order cannot tell apart, blocks not outermost, padded pages, a page order kvbridge has
no format for, a kernel block size other than the cache's.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

from kvbridge.errors import ConfigError
from kvbridge.layout import DTYPE_SIZES, PAGE_FORMATS, KVCacheLayout

# logical dimension -> its letters in a kvbridge page format ("kvdim": a head's K|V, K first)
_LETTERS = {"kv": "2", "tokens": "N", "heads": "H", "dim": "D", "kvdim": "2D"}

# The logical order of the dimensions of the KV tensors vLLM hands a connector, by rank; names a
# dimension only where sizes cannot (e.g. 2 KV heads, or as many heads as tokens per block).
CONVENTIONS: dict[int, tuple[str, ...]] = {
    5: ("blocks", "kv", "tokens", "heads", "dim"),  # vLLM 0.25 per-layer: [num_blocks, 2, block_size, heads, head_size]
    4: ("blocks", "heads", "tokens", "kvdim"),  # vLLM 0.32 per-layer: [B, H, N, C], C = K|V of one head
    6: ("blocks", "layers", "kv", "tokens", "heads", "dim"),  # vLLM 0.25's cross-layer tensor, NHD, as allocated
}


class Geometry(NamedTuple):
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str


def dim_names(shape: tuple[int, ...], element_size: int, geo: Geometry, backend_name: str,
              num_layers: int | None = None) -> tuple[str, ...]:  # fmt: skip
    """The logical dimension of each of `shape`'s dimensions, named by size (and `CONVENTIONS` where
    sizes coincide), or ConfigError: no naming fits, or several do and vLLM's order is not one of them."""
    shape = tuple(shape)
    convention = CONVENTIONS.get(len(shape))
    found = f"vLLM's {backend_name} KV tensor of shape {shape} ({element_size}-byte elements)"
    if convention is None:
        raise ConfigError(
            f"KVBridgeConnector cannot read {found}: it knows KV tensors of {sorted(CONVENTIONS)} dimensions "
            "(blocks, K|V, tokens, heads, head size; or blocks, heads, tokens, K|V x head size)"
        )
    sizes = {
        "blocks": geo.num_blocks, "kv": 2, "tokens": geo.block_size, "heads": geo.num_kv_heads, "dim": geo.head_size,
        "kvdim": 2 * geo.head_size * DTYPE_SIZES.get(geo.dtype, element_size) / element_size, "layers": num_layers,
    }  # fmt: skip
    fits = [p for p in itertools.permutations(convention) if all(shape[i] == sizes[n] for i, n in enumerate(p))]
    if convention in fits:
        return convention
    if len(fits) == 1:
        return fits[0]
    want = {n: sizes[n] for n in convention}
    if not fits:
        raise ConfigError(
            f"KVBridgeConnector cannot read {found}: its sizes are not those of {want} in any order (a kernel block "
            "size other than the cache's block size, padded or quantized pages with scales, or another model's "
            "geometry); kvbridge supports dense K and V pages of the cache's block size"
        )
    raise ConfigError(
        f"KVBridgeConnector cannot tell the dimensions of {found} apart: {len(fits)} orders of {want} fit and "
        f"vLLM's order {convention} is not one of them"
    )


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
    if page_format not in PAGE_FORMATS:
        raise ConfigError(f"KVBridgeConnector has no page format {page_format} (known: {sorted(PAGE_FORMATS)}); {found}")
    return PagePlacement(page_format, tensor.stride(order[0]) * tensor.element_size())


def layout_of_tensors(tensors: list[Any], geo: Geometry, backend_name: str) -> tuple[KVCacheLayout, bool]:
    """kvbridge's layout of vLLM's per-layer KV tensors (in layer order) and whether each layer is an
    allocation of its own (then the layout is `KVCacheLayout.per_layer`), or a ConfigError saying why not."""
    first = tensors[0]
    names = dim_names(tuple(first.shape), first.element_size(), geo, backend_name)
    placement = page_placement(first, names, backend_name)
    base = first.data_ptr()
    layer_stride = tensors[1].data_ptr() - base if len(tensors) > 1 else 0
    is_one_buffer = layer_stride > 0
    for i, tensor in enumerate(tensors):
        if tuple(tensor.shape) != tuple(first.shape) or page_placement(tensor, names, backend_name) != placement:
            raise ConfigError(f"vLLM's {backend_name} KV tensor of layer {i} is laid out unlike layer 0's")
        if tensor.data_ptr() != base + i * layer_stride or not _same_allocation(tensor, first):
            is_one_buffer = False
    geometry = dict(
        num_blocks=geo.num_blocks, num_layers=len(tensors), block_size=geo.block_size, num_kv_heads=geo.num_kv_heads,
        head_dim=geo.head_size, dtype=geo.dtype, page_format=placement.page_format,
    )  # fmt: skip
    try:
        if len(tensors) == 1:  # one layer never steps its layer stride: any no smaller than a page
            return KVCacheLayout(**geometry, layer_stride=placement.block_stride, block_stride=placement.block_stride), False
        if is_one_buffer:
            return KVCacheLayout(**geometry, layer_stride=layer_stride, block_stride=placement.block_stride), False
        return KVCacheLayout.per_layer(placement.block_stride, **geometry), True
    except ConfigError as exc:
        raise ConfigError(f"vLLM's {backend_name} KV layout cannot be expressed by kvbridge: {exc}") from exc


def _same_allocation(a: Any, b: Any) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def cross_layer_views(kv_cache: Any, num_layers: int, geo: Geometry, backend_name: str) -> list[Any]:
    """The per-layer views of vLLM's cross-layer KV tensor (one allocation for every layer, as allocated:
    its dimensions in memory order), its layers' dimension named by size like the others."""
    names = dim_names(tuple(kv_cache.shape), kv_cache.element_size(), geo, backend_name, num_layers=num_layers)
    layers = names.index("layers")
    return [kv_cache.select(layers, i) for i in range(num_layers)]


def layer_views(tensors: list[Any], layout: KVCacheLayout) -> list[Any]:
    """Each layer's pages as `[num_blocks, *page_shape]` in the layout's page format and dtype, over
    vLLM's own memory (what `LayerTensors` holds)."""
    import torch

    dtype = getattr(torch, layout.dtype)
    strides = layout.strides[:1] + layout.strides[2:]
    shape = layout.shape[:1] + layout.shape[2:]
    out = []
    for t in tensors:
        typed = t if t.dtype == dtype else t.view(dtype)  # a byte view of the pages (last dimension dense)
        out.append(torch.as_strided(typed, shape, strides, typed.storage_offset()))
    return out
