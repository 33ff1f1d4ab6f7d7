"""The block copier's contract: `BlockCopier` moves whole blocks between the KV cache and the host
pool and returns a `CopyHandle` per copy (copier.py: the CPU copier and `make_copier`; cuda_copier.py:
the CUDA one)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kvbridge.transfer.digest import DigestJob

# KV block ids -> their digests, started on the calling thread (CPU: computed there; CUDA: queued on
# the current stream). transfer/digest.py's `BlockDigester` (`start_block_digests` bound to a region and a layout).
DigestFn = Callable[[list[int]], DigestJob]

class CopyHandle(ABC):
    """One asynchronous copy. `error` is set when it failed."""

    error: BaseException | None = None

    def digests(self) -> dict[int, int]:
        """KV block id -> the digest of its bytes as copied; empty for a copier without `digest`.
        Called once the copy is done and did not fail."""
        return {}

    @abstractmethod
    def is_done(self) -> bool: ...

    @abstractmethod
    def wait(self, timeout_s: float) -> bool:
        """Block until done or `timeout_s` passed; True when done."""

    def device_seconds(self) -> float | None:
        """The copy's own time on the device, from the moment the work it waits for (the step's forward
        pass) ended to its end; None where the copier cannot time it (CPU copies: their wall time is
        theirs). Called once the copy is done and did not fail."""
        return None

    def on_done(self, callback: Callable[[], object]) -> None:
        """Call `callback()` once the copy ended, on a copier thread (the owner still polls: this
        only wakes it early). A copier that cannot tell ends without polling never calls it."""


class BlockCopier(ABC):
    """Copies blocks `kv[gpu_ids] <-> host[slots]` off the engine thread."""

    def __init__(self, kv_cache: torch.Tensor, host_pool: torch.Tensor, digest: DigestFn | None = None) -> None:
        self.kv_cache = kv_cache  # [num_blocks, L, *page_shape], possibly a strided view
        self.host_pool = host_pool  # [num_slots, L, *page_shape], contiguous
        self.digest = digest  # digests of the KV-cache side of each copy, or None

    @abstractmethod
    def store(self, gpu_ids: list[int], slots: list[int], before: Callable[[], None] | None = None) -> CopyHandle:
        """kv_cache[gpu_ids] -> host_pool[slots], after this step's forward pass."""

    @abstractmethod
    def load(self, slots: list[int], gpu_ids: list[int], before: Callable[[], None] | None = None) -> CopyHandle:
        """host_pool[slots] -> kv_cache[gpu_ids]."""

    def close(self) -> None:
        """Stop threads; drop tensor references. In-flight copies must be finished first."""
        self.kv_cache = self.host_pool = None
