"""The KV cache layout, and all block -> byte-offset arithmetic.

One tensor per engine, block-major:

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so one block is one contiguous byte range that holds every layer's K and V. Transfers and
offload move whole blocks; attention reads the strided per-layer view `kv[:, layer]`.

This module imports neither torch nor nixl: the engine, the transfer layer and the connectors
all share it, and bookkeeping code can use it without a device.
"""

from __future__ import annotations

import hashlib
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


@dataclass(frozen=True)
class KVCacheLayout:
    """Geometry of one engine's block-major KV cache tensor."""

    num_blocks: int
    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPE_SIZES

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"KVCacheLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"KVCacheLayout.dtype={self.dtype!r}; expected one of {sorted(DTYPE_SIZES)}")

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return self.shape[1:]

    @property
    def element_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: every layer's K and V for `block_size` tokens."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def total_nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    def block_offset(self, block_id: int) -> int:
        """Byte offset of block `block_id` from the start of the KV tensor."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside [0, {self.num_blocks})")
        return block_id * self.block_nbytes

    def block_offsets(self, block_ids):
        """Vectorized `block_offset`: byte offsets (int64 numpy array) of an array of block ids."""
        import numpy as np  # local: this module is imported where numpy may not be wanted

        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = ids[(ids < 0) | (ids >= self.num_blocks)][0]
            raise IndexError(f"block id {int(bad)} outside [0, {self.num_blocks})")
        return ids * self.block_nbytes

    def with_num_blocks(self, num_blocks: int) -> KVCacheLayout:
        """The same geometry with another block count (a host tier, a peer with more memory)."""
        return KVCacheLayout(num_blocks, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    def geometry_key(self) -> tuple:
        """Everything two engines must share for one's blocks to be valid in the other.

        The block count is excluded: peers may have different amounts of memory.
        """
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    def compat_hash(self, model_id: str) -> str:
        """Hex digest over the model identity and the block geometry, compared at handshake."""
        text = repr(("kvbridge-layout-v1", model_id, "block-major", self.geometry_key()))
        return hashlib.sha256(text.encode()).hexdigest()[:32]
