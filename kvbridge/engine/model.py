"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Parameter names match Hugging Face's LlamaForCausalLM (`model.layers.0.self_attn.q_proj.weight`,
...), so a checkpoint's state dict loads as is (see weights.py). Qwen2 (q/k/v biases) and
Mistral are the same graph with other flags in `ModelArgs`.

The model knows nothing about paging: each layer hands its q, k, v to an `attention` callable
given to `forward` (the model runner's paged attention, or the dense reference in tests). The
connector's per-layer hooks are passed the same way, per call, and never stored.

Flattened token batch convention: every tensor has the tokens of all scheduled requests
concatenated along dim 0 (`T` tokens in total).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvbridge.engine.fused_ops import add_rms_norm, rms_norm_eager, rotate_eager, rotate_qk_, silu_and_mul
from kvbridge.engine.presets import ModelArgs
from kvbridge.engine.tensor_parallel import AllReduce, row_linear
from kvbridge.errors import ModelLoadError

LayerHook = Callable[[int], None]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin of the step's positions: [T, 1, head_dim] float32


class AttentionFn(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_eager(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + x), residual + x): the residual stream's sum and the norm in one pass on a GPU."""
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as transformers' `modeling_rope_utils` does.

    "dynamic" (NTK) is plain RoPE for sequences up to `max_position_embeddings`: transformers rescales
    only past it, by the current sequence length, which a KV cache shared across requests cannot
    follow; `RotaryEmbedding` refuses tables past `args.max_position` for it.
    """
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    scaling = args.rope_scaling
    match args.rope_type:
        case "linear":
            inv_freq = inv_freq / scaling["factor"]
        case "llama3":
            inv_freq = _llama3_scaled(inv_freq, scaling)
        case "yarn":
            inv_freq = _yarn_scaled(inv_freq, scaling, args.head_dim, args.rope_theta)
        # "default", and "dynamic" within its context: unscaled
    return inv_freq.float()


def rope_attention_factor(args: ModelArgs) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature, 1 for every other type."""
    if args.rope_type != "yarn":
        return 1.0
    scaling = args.rope_scaling
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all_dim:  # DeepSeek's form
        return mscale(factor, m) / mscale(factor, m_all_dim)
    return mscale(factor)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, out)


def _yarn_scaled(inv_freq: torch.Tensor, scaling: dict, head_dim: int, theta: float) -> torch.Tensor:
    # YaRN (arXiv 2309.00071): dimensions turning more than `beta_fast` times over the original context
    # are kept, those turning fewer than `beta_slow` times are divided by `factor`, a linear ramp between.
    factor = float(scaling["factor"])
    original_len = scaling["original_max_position_embeddings"]

    def dim_of(num_rotations: float) -> float:  # the dimension that turns `num_rotations` times
        return head_dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # 1: interpolate
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_len). Plain attributes (not buffers): `release()` drops them.

    Rotate-half, written as a roll: rotate_half(x) * sin == roll(x, head_dim / 2) * signed_sin, where
    `signed_sin` is sin with the first half negated. `lookup` once per step, `rotate` per tensor.
    """

    def __init__(self, args: ModelArgs, max_len: int, device: torch.device | str) -> None:
        if args.rope_type == "dynamic" and max_len > args.max_position:
            raise ModelLoadError(
                f"dynamic RoPE scaling is exact only up to {args.max_position} positions (past them transformers "
                f"rescales by the sequence length); asked for {max_len}"
            )
        inv_freq = rope_inv_freq(args).to(device)  # [head_dim // 2]
        scale = rope_attention_factor(args)
        freqs = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
        self.cos: torch.Tensor | None = torch.cat((freqs, freqs), dim=-1).cos() * scale  # [max_len, head_dim]
        self.signed_sin: torch.Tensor | None = torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * scale
        self.max_len = max_len

    def lookup(self, positions: torch.Tensor) -> Rope:
        """positions [T] -> (cos, signed_sin), each [T, 1, head_dim] float32."""
        if self.cos is None or self.signed_sin is None:
            raise RuntimeError("RotaryEmbedding was released (the model runner was shut down)")
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by `lookup`'s tables, same dtype."""
        return rotate_eager(x, *rope)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim], positions [T] -> x rotated, same dtype."""
        return self.rotate(x, self.lookup(positions))

    def release(self) -> None:
        self.cos = None
        self.signed_sin = None


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = row_linear(args.num_heads * args.head_dim, args.hidden_size, False, all_reduce)
        self.qkv: FusedLinear | None = None  # `fuse()`: q, k and v in one matmul

    def fuse(self) -> None:
        self.qkv = FusedLinear.of(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, rope: Rope, attention: AttentionFn) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv is not None:
            qkv = self.qkv(x)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)  # [T, (Hq + 2 Hkv) * D]
        rotate_qk_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, *rope)  # queries and keys, one pass
        q, k, v = qkv.view(num_tokens, -1, self.head_dim).split((self.num_heads, self.num_kv_heads, self.num_kv_heads), 1)
        out = attention(self.layer, q, k, v)  # [T, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = row_linear(args.intermediate_size, args.hidden_size, args.mlp_bias, all_reduce)
        self.gate_up: FusedLinear | None = None  # `fuse()`: gate and up in one matmul

    def fuse(self) -> None:
        self.gate_up = FusedLinear.of(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x) if self.gate_up is not None else torch.cat((self.gate_proj(x), self.up_proj(x)), -1)
        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = SelfAttention(args, layer, all_reduce)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, all_reduce)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, attention: AttentionFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): the stream is
        x_in + attn(norm(x_in)) + mlp(norm(...)), summed where the next norm reads it.
        `residual` None: x is the embeddings (the first layer)."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, rope, attention), residual)
        return self.mlp(h), residual


class FusedLinear(NamedTuple):
    """Several linear layers over the same input as one matmul: their weights stacked by output row.
    The layers' own parameters become views into the stacked weight, so the memory is counted once
    and the module keeps its Hugging Face names."""

    weight: torch.Tensor  # [sum of out_features, in_features]
    bias: torch.Tensor | None

    @classmethod
    def of(cls, *layers: nn.Linear) -> FusedLinear:
        with torch.no_grad():
            weight = torch.cat([layer.weight for layer in layers])
            bias = torch.cat([layer.bias for layer in layers]) if layers[0].bias is not None else None
            first = 0
            for layer in layers:
                rows = layer.out_features
                layer.weight = nn.Parameter(weight[first : first + rows], requires_grad=False)
                if bias is not None:
                    layer.bias = nn.Parameter(bias[first : first + rows], requires_grad=False)
                first += rows
        return cls(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class DecoderStack(nn.Module):
    """HF's `model.*`: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        # Left uninitialised (weights.py fills every parameter): nn.Embedding's own init would run
        # torch's reference normal_ on the meta device, whose first call imports torch._dynamo, 1-1.5 s
        # of every process's start-up.
        unset = torch.empty(args.vocab_size, args.hidden_size)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=unset)
        self.layers = nn.ModuleList(DecoderLayer(args, i, all_reduce) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head. `rotary` is attached by the builder (`attach_rotary`).

    Under tensor parallelism `args` is one rank's geometry (tensor_parallel.local_args: its heads and
    MLP columns) and `all_reduce` sums the row-parallel layers' partial outputs over the ranks.
    """

    def __init__(self, args: ModelArgs, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderStack(args, all_reduce)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.tie_weights()

    def fuse_projections(self) -> None:
        """Stack q/k/v and gate/up into one matmul each (after the weights are loaded): fewer, larger
        matmuls read the same bytes faster, and the layer launches fewer kernels."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attach_rotary(self, max_len: int) -> None:
        """Build the cos/sin tables on the weights' device for positions [0, max_len)."""
        self.rotary = RotaryEmbedding(self.args, max_len, self.lm_head.weight.device)

    def release(self) -> None:
        """Drop the rope tables (the parameters go with the module)."""
        if self.rotary is not None:
            self.rotary.release()
        self.rotary = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attention: AttentionFn,
        before_layer: LayerHook | None = None,
        after_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. Hooks run around each layer i."""
        if self.rotary is None:
            raise RuntimeError("LlamaForCausalLM.forward before attach_rotary() (or after release())")
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions)  # once per step, shared by every layer
        residual = None
        for i, layer in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(i)
            x, residual = layer(x, residual, rope, attention)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm.add_forward(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden).float()
