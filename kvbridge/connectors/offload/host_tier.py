"""The host tier's memory: one pool tensor, block-major in the KV cache's page format.

    pool[num_slots, num_layers, *page_shape]   contiguous, e.g. "2NHD": [.., 2, block_size, H, D]

The KV cache itself may be strided (vLLM's layer-outermost buffer); the pool is kvbridge's own
memory and always block-major, so a slot is one byte range (`slot_bytes`, disk files).

Owned by the worker side. Which hash lives in which slot, visibility and pins are decided by the
scheduler side (`host_index.py`); this object only holds the bytes. It is page-locked (pinned)
when the KV cache is on CUDA, so host<->GPU copies are true asynchronous DMAs, and plain memory on
CPU-only machines.
"""

from __future__ import annotations

import torch

from kvbridge.layout import KVCacheLayout
from kvbridge.transfer.digest import BlockDigest


class HostTier:
    def __init__(self, layout: KVCacheLayout, num_slots: int, pin_memory: bool) -> None:
        self.layout = layout.block_major(num_slots)
        self.num_slots = num_slots
        self.is_pinned = pin_memory
        # [num_slots, L, *page_shape]
        self.pool: torch.Tensor | None = torch.empty(
            self.layout.shape, dtype=getattr(torch, layout.dtype), device="cpu", pin_memory=pin_memory
        )
        self.poisoned_slots: set[int] = set()  # a store into them failed; loads from them fail
        # slot -> the digest of the block stored in it (a store's, or the file's it was read from):
        # what a load out of the slot must find in the bytes it copied (verify_kv_digest)
        self.digests: dict[int, BlockDigest] = {}

    @property
    def nbytes(self) -> int:
        return self.layout.total_nbytes

    def slot_bytes(self, slot: int) -> torch.Tensor:
        """Slot `slot` as flat uint8: [block_nbytes]. A view: reads and writes go to the pool."""
        assert self.pool is not None, "host tier used after free()"
        return self.pool[slot].reshape(-1).view(torch.uint8)

    def free(self) -> None:
        """Drop the pool (after every transfer that touches it has finished)."""
        self.pool = None
        self.poisoned_slots.clear()
        self.digests.clear()

    def check_integrity(self) -> None:
        if self.pool is not None:
            if tuple(self.pool.shape) != self.layout.shape:
                raise AssertionError("host tier: pool shape differs from its layout")
            if not all(0 <= s < self.num_slots for s in self.poisoned_slots):
                raise AssertionError("host tier: a poisoned slot is out of range")
            if not all(0 <= s < self.num_slots for s in self.digests):
                raise AssertionError("host tier: a digest of a slot out of range")
