"""`KVShard`: one tensor-parallel rank's KV cache, as the layout translator sees it. Pure.

A rank's `KVCacheLayout` says how its pages lie; the shard adds which of the model's KV heads
they hold and how many the model has, so that TP N -> M reads can be planned and another model
refused (transfer/layout_plan.py). A whole engine is the shard of every head (`KVShard(layout)`);
an engine rank's `tp_layout.RankKVLayout` becomes one with `KVShard.of_rank`. `head_spans` says
which prefill shard a decode shard reads each of its heads from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvbridge.errors import ConfigError
from kvbridge.layout import KVCacheLayout
from kvbridge.tp_layout import RankKVLayout


@dataclass(frozen=True)
class KVShard:
    """One rank's KV cache: its layout holds KV heads [head_start, head_start + layout.num_kv_heads)
    of the model's `num_total_kv_heads` (None: all of them, i.e. tensor parallel 1)."""

    layout: KVCacheLayout
    head_start: int = 0
    num_total_kv_heads: int | None = None

    def __post_init__(self) -> None:
        if self.head_start < 0 or self.head_end > self.total_kv_heads:
            raise ConfigError(
                f"KVShard heads [{self.head_start}, {self.head_end}) lie outside the model's {self.total_kv_heads} KV heads"
            )

    @classmethod
    def of_rank(cls, rank: RankKVLayout, num_total_kv_heads: int) -> KVShard:
        """The shard of a TP rank's KV (tp_layout.py), with the model's KV head count, which the rank's
        layout alone cannot tell (a replicated head is one of how many?)."""
        return cls(rank.layout, rank.kv_head_range[0], num_total_kv_heads)

    @property
    def total_kv_heads(self) -> int:
        return self.layout.num_kv_heads if self.num_total_kv_heads is None else self.num_total_kv_heads

    @property
    def head_end(self) -> int:
        return self.head_start + self.layout.num_kv_heads

    def describe(self) -> str:
        """e.g. "2NHD pages, 16-token blocks, KV heads [0, 4) of 8, 2 layers x head_dim 64, bfloat16, block-major"."""
        lay = self.layout
        placement = "block-major" if lay.is_contiguous else f"strides layer {lay.layer_stride_bytes} B / block {lay.block_stride_bytes} B"
        return (
            f"{lay.page_format} pages, {lay.block_size}-token blocks, KV heads [{self.head_start}, {self.head_end}) of "
            f"{self.total_kv_heads}, {lay.num_layers} layers x head_dim {lay.head_dim}, {lay.dtype}, {placement}"
        )


class HeadSpan(NamedTuple):
    """KV heads [head_start, head_end) (the model's numbering) that a decode reads from prefill shard `source`."""

    source: int
    head_start: int
    head_end: int

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


def head_spans(decode: KVShard, prefills: Sequence[KVShard]) -> list[HeadSpan]:
    """One span per prefill shard read from, in shard order: each head the decode holds is read from the
    first shard that holds it (a replicated head from one rank). The caller has checked that some shard does."""
    owner = [next(i for i, s in enumerate(prefills) if s.head_start <= h < s.head_end)
             for h in range(decode.head_start, decode.head_end)]  # fmt: skip
    spans = []
    for i in sorted(set(owner)):
        heads = [decode.head_start + k for k, o in enumerate(owner) if o == i]
        spans.append(HeadSpan(i, heads[0], heads[-1] + 1))  # a rank's heads are a range, so its share is too
    return spans
