"""Which heads a tensor-parallel rank holds: the split arithmetic, and each rank's KV layout.

Tensor parallelism of size N splits a Llama-style decoder the Megatron way: rank r computes query
heads [r * H / N, (r + 1) * H / N), the KV heads those query heads read, and 1 / N of the MLP's
intermediate columns. When the model has at least N KV heads, they are split evenly too (N must
divide them); when it has fewer, each KV head is replicated on the N / num_kv_heads ranks whose
query heads read it (N must then be a multiple of num_kv_heads), so every rank holds exactly one.

A rank's KV cache holds only its own KV heads: its `KVCacheLayout` has `num_kv_heads` of them, and
`RankKVLayout.kv_head_range` says which global heads those are. That pair is what a layout
translator needs to plan a read between engines of different TP sizes.

This module imports neither torch nor nixl: the transfer layer plans with it, the engine shards with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import TensorParallelError
from kvbridge.layout import KVCacheLayout

HeadRange = tuple[int, int]  # [start, stop) of global head indices


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `world_size`'s share of a model with this geometry. Validated on construction."""

    rank: int
    world_size: int
    num_heads: int  # the model's query heads
    num_kv_heads: int  # the model's KV heads
    intermediate_size: int  # the model's MLP width

    def __post_init__(self) -> None:
        check_tp_size(self.world_size, self.num_heads, self.num_kv_heads, self.intermediate_size)
        if not 0 <= self.rank < self.world_size:
            raise TensorParallelError(f"TP rank {self.rank} outside [0, {self.world_size})")

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank holds: num_kv_heads / N, or 1 when they are replicated."""
        return max(self.num_kv_heads // self.world_size, 1)

    @property
    def num_local_intermediate(self) -> int:
        return self.intermediate_size // self.world_size

    @property
    def head_range(self) -> HeadRange:
        """The global query heads this rank computes."""
        return self.rank * self.num_local_heads, (self.rank + 1) * self.num_local_heads

    @property
    def kv_head_range(self) -> HeadRange:
        """The global KV heads this rank holds: the ones its query heads read."""
        group = self.num_heads // self.num_kv_heads  # query heads per KV head
        first = self.head_range[0] // group
        return first, first + self.num_local_kv_heads

    @property
    def intermediate_range(self) -> tuple[int, int]:
        """The MLP columns (gate/up rows, down columns) this rank computes."""
        return self.rank * self.num_local_intermediate, (self.rank + 1) * self.num_local_intermediate

    @property
    def is_kv_replicated(self) -> bool:
        """Each KV head lives on several ranks (the model has fewer KV heads than ranks)."""
        return self.num_kv_heads < self.world_size


@dataclass(frozen=True)
class RankKVLayout:
    """One rank's KV cache: its tensor's layout (its KV heads only) and which global KV heads they are.

    `layout.num_kv_heads == kv_head_range[1] - kv_head_range[0]`. Ranks of one engine share block ids:
    block b of every rank holds the same tokens, each rank its own heads of them.
    """

    rank: int
    world_size: int
    layout: KVCacheLayout
    kv_head_range: HeadRange

    def __post_init__(self) -> None:
        start, stop = self.kv_head_range
        if stop - start != self.layout.num_kv_heads:
            raise TensorParallelError(
                f"rank {self.rank}: kv_head_range {self.kv_head_range} does not match its layout's "
                f"{self.layout.num_kv_heads} KV heads"
            )


def check_tp_size(world_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raise TensorParallelError unless a model of this geometry splits into `world_size` ranks."""
    field = f"ModelConfig.tensor_parallel_size={world_size}"
    if world_size < 1:
        raise TensorParallelError(f"{field} must be at least 1")
    if num_heads % world_size:
        raise TensorParallelError(
            f"{field} must divide the model's {num_heads} attention heads; use one of {_divisors(num_heads)}"
        )
    if num_kv_heads % world_size and world_size % num_kv_heads:
        sizes = [n for n in _divisors(num_heads) if not num_kv_heads % n or not n % num_kv_heads]
        raise TensorParallelError(
            f"{field} must divide the model's {num_kv_heads} KV heads or be a multiple of them (then each KV "
            f"head is replicated); use one of {sizes}"
        )
    if intermediate_size % world_size:
        raise TensorParallelError(f"{field} must divide the model's MLP width {intermediate_size}")


def rank_kv_layouts(
    world_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int, layout: KVCacheLayout
) -> list[RankKVLayout]:
    """Every rank's KV layout, given any one rank's `layout` (all ranks hold the same number of heads)."""
    shards = [TPShard(r, world_size, num_heads, num_kv_heads, intermediate_size) for r in range(world_size)]
    return [RankKVLayout(s.rank, world_size, layout, s.kv_head_range) for s in shards]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if not n % d]
