"""Megatron-style sharding of the Llama decoder for tensor parallelism (torch side).

Which heads and columns a rank holds is arithmetic in `kvbridge/tp_layout.py`; this module applies
it to the model:

- column-parallel (split along the output rows, no communication): q_proj, k_proj, v_proj (by head),
  gate_proj and up_proj (by intermediate column), biases included;
- row-parallel (split along the input columns, one all-reduce of the partial sums): o_proj and
  down_proj, as `RowParallelLinear`; a bias is added once, after the sum;
- replicated: embeddings, norms and the LM head. Rank 0 alone computes logits and samples, so a
  vocabulary-split head would only add an all-gather of every step's logits; the reference
  engine's vocabularies are small enough that a whole copy per rank costs little.

Per decoder layer that is two all-reduces of [T, hidden], the minimum for this split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvbridge.engine.presets import ModelArgs, with_overrides
from kvbridge.tp_layout import TPShard

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the ranks in place, returns it


class RowParallelLinear(nn.Linear):
    """A Linear whose input features are split over the ranks: each computes its partial product,
    `all_reduce` sums them, then the (whole, replicated) bias is added once. Parameter names are
    nn.Linear's, so checkpoints load by the same names."""

    def __init__(self, in_features: int, out_features: int, bias: bool, all_reduce: AllReduce) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.all_reduce(F.linear(x, self.weight))  # [T, out_features], summed over the ranks
        return out if self.bias is None else out + self.bias


def row_linear(in_features: int, out_features: int, bias: bool, all_reduce: AllReduce | None) -> nn.Linear:
    """nn.Linear at TP 1 (the same module and speed as ever), RowParallelLinear under TP."""
    if all_reduce is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, all_reduce)


def make_shard(args: ModelArgs, rank: int, world_size: int) -> TPShard:
    """Rank `rank`'s share of `args`; raises TensorParallelError when `world_size` does not split it."""
    return TPShard(rank, world_size, args.num_heads, args.num_kv_heads, args.intermediate_size)


def local_args(args: ModelArgs, shard: TPShard) -> ModelArgs:
    """The geometry one rank's modules are built with: its heads, KV heads and MLP columns."""
    return with_overrides(
        args,
        num_heads=shard.num_local_heads,
        num_kv_heads=shard.num_local_kv_heads,
        intermediate_size=shard.num_local_intermediate,
    )


def shard_parameter(name: str, full: torch.Tensor, shard: TPShard, head_dim: int) -> torch.Tensor:
    """This rank's part of the whole parameter `name` (Hugging Face naming), a fresh contiguous tensor
    when split, `full` itself when replicated."""
    module, _, kind = name.rpartition(".")  # "model.layers.0.self_attn.q_proj", "weight" | "bias"
    projection = module.rpartition(".")[2]
    heads = lambda r: (r[0] * head_dim, r[1] * head_dim)  # noqa: E731 - head range -> row range
    match projection:
        case "q_proj":
            dim, (start, stop) = 0, heads(shard.head_range)
        case "k_proj" | "v_proj":
            dim, (start, stop) = 0, heads(shard.kv_head_range)
        case "gate_proj" | "up_proj":
            dim, (start, stop) = 0, shard.intermediate_range
        case "o_proj" if kind == "weight":
            dim, (start, stop) = 1, heads(shard.head_range)
        case "down_proj" if kind == "weight":
            dim, (start, stop) = 1, shard.intermediate_range
        case _:  # embeddings, norms, LM head, row-parallel biases: whole on every rank
            return full
    return full.narrow(dim, start, stop - start).clone(memory_format=torch.contiguous_format)
