"""The KV cache layout, and all block -> byte-offset arithmetic.

A *page* is one layer's K and V for one block of `block_size` tokens: `page_nbytes` contiguous
bytes whose order is named by `page_format`. One engine's KV cache is one buffer of pages, page
(layer l, block b) starting at

    l * layer_stride_bytes + b * block_stride_bytes

bytes from page (0, 0). As a tensor that is the view `kv[num_blocks, num_layers, *page_shape]`
with element strides `layout.strides`. Two placements matter:

- block-major (the default, strides 0): kvbridge's engine and its host tier,
  `kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` contiguous, so one block
  is one byte range that holds every layer's K and V; attention reads the view `kv[:, layer]`.
- strided: another engine's buffer, e.g. vLLM's CPU backend, layer-outermost
  (`layer_stride = num_blocks * page_nbytes`, `block_stride = page_nbytes`, "H2ND" pages), or
  block-outermost with padding between blocks (`block_stride > num_layers * page_nbytes`).

Transfers and offload move whole blocks, i.e. all of a block's pages. Two engines exchange pages
as they are when their page formats and geometry agree, whatever their strides (`compat_hash`);
of the same model but another block size or page format (`model_hash`), through a read plan
(transfer/layout_plan.py).

This module imports neither torch nor nixl: the engine, the transfer layer and the connectors
all share it, and bookkeeping code can use it without a device.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from kvbridge.errors import ConfigError

# torch dtype name -> bytes per element
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# page format -> the shape of one page, outermost first, from (block_size, num_kv_heads, head_dim)
PAGE_FORMATS: dict[str, Callable[[int, int, int], tuple[int, int, int, int]]] = {
    "2NHD": lambda block_size, heads, head_dim: (2, block_size, heads, head_dim),  # kvbridge's engine
    "H2ND": lambda block_size, heads, head_dim: (heads, 2, block_size, head_dim),  # vLLM's CPU backend
    "2HND": lambda block_size, heads, head_dim: (2, heads, block_size, head_dim),  # vLLM's CUDA backends, HND layout
    # H2ND with each head's K transposed, [head_dim, block_size] (token innermost); V stays [block_size,
    # head_dim]: vLLM's CPU backend under its VEC kernels ("reshape K as column-major and V as row-major")
    "H2ND-KT": lambda block_size, heads, head_dim: (heads, 2, block_size, head_dim),
    # K and V of one (token, head) side by side: vLLM 0.32's CUDA pages, whose cell is K|V of one head
    "NH2D": lambda block_size, heads, head_dim: (block_size, heads, 2, head_dim),  # its LBNHC layout
    "HN2D": lambda block_size, heads, head_dim: (heads, block_size, 2, head_dim),  # its LBHNC layout
}
K_TRANSPOSED_FORMATS = frozenset({"H2ND-KT"})
# vLLM's CPU backend under its other kernels (AMX, NEON, VEC16, ...) packs a page's interior in tiles
# kvbridge has not mapped: such pages move whole between engines of the same format and block size
# (equal compat hashes) and are never translated (their model hash names the format, so the
# handshake refuses any other layout). The shape is only a view of the page's bytes.
OPAQUE_FORMATS = frozenset(
    f"vllm-cpu-{isa}" for isa in ("amx", "vec", "vec16", "neon", "rvv", "vxe", "vsx", "unknown")
)
PAGE_FORMATS.update({fmt: PAGE_FORMATS["H2ND"] for fmt in OPAQUE_FORMATS})


@dataclass(frozen=True)
class KVCacheLayout:
    """Geometry of one engine's KV cache: the pages, and where each one lives (see the module doc)."""

    num_blocks: int
    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPE_SIZES
    page_format: str = "2NHD"  # a key of PAGE_FORMATS
    # Bytes from a page to the next layer's / next block's page. Both 0: block-major, i.e.
    # page_nbytes and num_layers * page_nbytes. Give both or neither.
    layer_stride: int = 0
    block_stride: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"KVCacheLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"KVCacheLayout.dtype={self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
        if self.page_format not in PAGE_FORMATS:
            raise ConfigError(
                f"KVCacheLayout.page_format={self.page_format!r}; expected one of {sorted(PAGE_FORMATS)}"
            )
        self._check_strides()

    def _check_strides(self) -> None:
        strides = {"layer_stride": self.layer_stride, "block_stride": self.block_stride}
        if (self.layer_stride == 0) != (self.block_stride == 0):
            raise ConfigError(f"KVCacheLayout: give both layer_stride and block_stride, or neither (block-major); got {strides}")
        for name, stride in strides.items():
            if stride < 0 or stride % self.element_size:
                raise ConfigError(
                    f"KVCacheLayout.{name}={stride} must be a non-negative multiple of the {self.element_size}-byte element"
                )
        # Pages never overlap when, from the smaller stride to the larger, each stride steps over
        # everything the dimensions inside it span (a dimension of one page has no stride to check).
        dims = [(self.layer_stride_bytes, self.num_layers, "layer_stride"),
                (self.block_stride_bytes, self.num_blocks, "block_stride")]  # fmt: skip
        span = self.page_nbytes
        for stride, count, name in sorted(d for d in dims if d[1] > 1):
            if stride < span:
                raise ConfigError(
                    f"KVCacheLayout: pages of different (layer, block) overlap: {name}={stride} B must be at least "
                    f"{span} B, the bytes it steps over (pages of {self.page_nbytes} B, {self.num_layers} layers, "
                    f"{self.num_blocks} blocks, {strides}); fix the strides"
                )
            span += (count - 1) * stride

    # ------------------------------------------------------------------ shapes and sizes

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """One page's shape in `page_format` order, e.g. "2NHD": (2, block_size, num_kv_heads, head_dim)."""
        return PAGE_FORMATS[self.page_format](self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def shape(self) -> tuple[int, ...]:
        """The KV tensor (a view, when strided): (num_blocks, num_layers, *page_shape)."""
        return (self.num_blocks, self.num_layers, *self.page_shape)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page: one layer's K and V for `block_size` tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's data: every layer's page (padding between pages not counted)."""
        return self.num_layers * self.page_nbytes

    @property
    def total_nbytes(self) -> int:
        """Bytes of KV data in the cache (padding not counted); `region_nbytes` is what it spans."""
        return self.num_blocks * self.block_nbytes

    # ------------------------------------------------------------------ placement

    @property
    def layer_stride_bytes(self) -> int:
        """Bytes from page (l, b) to page (l + 1, b)."""
        return self.layer_stride or self.page_nbytes

    @property
    def block_stride_bytes(self) -> int:
        """Bytes from page (l, b) to page (l, b + 1)."""
        return self.block_stride or self.block_nbytes

    @property
    def region_nbytes(self) -> int:
        """Bytes from the start of page (0, 0) to the end of the last page: the memory to register."""
        last = (self.num_layers - 1) * self.layer_stride_bytes + (self.num_blocks - 1) * self.block_stride_bytes
        return last + self.page_nbytes

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides of the (num_blocks, num_layers, *page_shape) view (torch.as_strided's)."""
        inner, page_strides = 1, []
        for size in reversed(self.page_shape):
            page_strides.insert(0, inner)
            inner *= size
        elt = self.element_size
        return (self.block_stride_bytes // elt, self.layer_stride_bytes // elt, *page_strides)

    @property
    def is_block_contiguous(self) -> bool:
        """Whether each block's pages form one byte range of `block_nbytes` (layer pages adjacent)."""
        return self.num_layers == 1 or self.layer_stride_bytes == self.page_nbytes

    @property
    def is_contiguous(self) -> bool:
        """Whether this is the block-major layout: a contiguous (num_blocks, num_layers, *page_shape) tensor."""
        return self.is_block_contiguous and (self.num_blocks == 1 or self.block_stride_bytes == self.block_nbytes)

    def block_offset(self, block_id: int) -> int:
        """Byte offset of block `block_id`'s first page from page (0, 0). Its `block_nbytes` bytes
        follow as one range only when `is_block_contiguous`."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside [0, {self.num_blocks})")
        return block_id * self.block_stride_bytes

    def block_offsets(self, block_ids):
        """Vectorized `block_offset`: byte offsets (int64 numpy array) of an array of block ids."""
        import numpy as np  # local: this module is imported where numpy may not be wanted

        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = ids[(ids < 0) | (ids >= self.num_blocks)][0]
            raise IndexError(f"block id {int(bad)} outside [0, {self.num_blocks})")
        return ids * self.block_stride_bytes

    def page_dim_strides(self) -> tuple[int, tuple[tuple[int, int, int], tuple[int, int, int]]]:
        """Byte strides inside a page: (K|V, ((token, head, dim) of K, (token, head, dim) of V)).
        ConfigError for an opaque page format, whose interior is not mapped."""
        if self.page_format in OPAQUE_FORMATS:
            raise ConfigError(f"the interior of {self.page_format!r} KV pages is not mapped: they move whole only")
        e = self.element_size
        named = {dim: stride * e for dim, stride in zip(self.page_format[:4], self.strides[2:])}
        v = (named["N"], named["H"], named["D"])
        k = (e, named["H"], self.block_size * e) if self.page_format in K_TRANSPOSED_FORMATS else v
        return named["2"], (k, v)

    def page_offsets(self, block_ids):
        """Byte offsets of every page of the given blocks: [n, num_layers] int64, [i, l] = page (l, block_ids[i])."""
        import numpy as np

        blocks = self.block_offsets(np.asarray(block_ids, dtype=np.int64).reshape(-1))  # [n]
        return blocks[:, None] + np.arange(self.num_layers, dtype=np.int64) * self.layer_stride_bytes

    # ------------------------------------------------------------------ related layouts

    @classmethod
    def per_layer(cls, block_stride: int, **geometry) -> KVCacheLayout:
        """The layout of KV held one layer per allocation (vLLM 0.25's V2 model runner): each layer's
        pages at `block_stride` from each other in a region of its own.

        Offsets stay this module's arithmetic: layer l's region is given the virtual offset
        `l * layer_stride`, with one unused block between layers, so that no run of pages (a
        descriptor) ever spans two layers; `transfer.descriptors.region_addresses` maps an offset to
        the address in its layer's region."""
        return cls(**geometry, layer_stride=(geometry["num_blocks"] + 1) * block_stride, block_stride=block_stride)

    @property
    def layer_region_nbytes(self) -> int:
        """Bytes of one layer's pages, from its first to the end of its last."""
        return (self.num_blocks - 1) * self.block_stride_bytes + self.page_nbytes

    def with_num_blocks(self, num_blocks: int) -> KVCacheLayout:
        """This layout with another block count; the strides are kept. Block-major stays
        block-major; a strided layout describes the same buffer, so a layer-outermost one cannot
        grow past its layer stride (ConfigError). For kvbridge-owned memory use `block_major`."""
        return dataclasses.replace(self, num_blocks=num_blocks)

    def block_major(self, num_blocks: int) -> KVCacheLayout:
        """The block-major layout of this geometry and page format with `num_blocks` blocks: what
        kvbridge allocates itself (e.g. a host tier), whatever the engine's strides."""
        return dataclasses.replace(self, num_blocks=num_blocks, layer_stride=0, block_stride=0)

    def geometry_key(self) -> tuple:
        """Everything two engines must share for one's pages to be valid in the other.

        The block count and the strides are excluded: peers may have different amounts of memory
        and place their pages differently; descriptors translate between placements.
        """
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.page_format)

    def model_hash(self, model_id: str, num_total_kv_heads: int | None = None) -> str:
        """Hex digest over what a layout translator cannot change: the model identity, layers, the
        model's KV heads (`num_total_kv_heads`; None: this layout's, i.e. tensor parallel 1), head_dim
        and dtype. Two engines with equal model hashes exchange KV through a read plan
        (transfer/layout_plan.py) whatever their block sizes, page formats, placements and TP sizes;
        an opaque page format (`OPAQUE_FORMATS`) cannot be translated, so its hash names it too."""
        heads = self.num_kv_heads if num_total_kv_heads is None else num_total_kv_heads
        key = ("kvbridge-model-v1", model_id, self.num_layers, heads, self.head_dim, self.dtype)
        if self.page_format in OPAQUE_FORMATS:
            key += (self.page_format, self.block_size)
        text = repr(key)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def compat_hash(self, model_id: str) -> str:
        """Hex digest over the model identity, the geometry and the page format, compared at handshake
        and in disk-tier files."""
        # "block-major" named the only page format there was (2NHD) before page formats existed:
        # such layouts keep their hash, so older peers and existing disk tiers still match.
        page_format = "block-major" if self.page_format == "2NHD" else self.page_format
        text = repr(("kvbridge-layout-v1", model_id, page_format, self.geometry_key()[:-1]))
        return hashlib.sha256(text.encode()).hexdigest()[:32]
