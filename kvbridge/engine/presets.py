"""Model architecture hyperparameters (`ModelArgs`) and the built-in presets.

A preset is a Llama-style geometry with seeded random weights (`ModelConfig.seed`), so the
engine runs offline on a fresh machine. Hugging Face checkpoints produce a `ModelArgs` from
their config.json (see `weights.py`). This module imports no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from kvbridge.errors import ConfigError, ModelNotFoundError

# The byte-level tokenizer's vocabulary: 256 bytes, then the specials, then reserved ids.
BYTE_VOCAB_SIZE = 384
BYTE_VOCAB_BOS = 256
BYTE_VOCAB_EOS = 257
BYTE_VOCAB_PAD = 258

# The Hugging Face RoPE scaling types kvbridge runs, with the keys each needs (formulas in model.py).
# `rope_scaling` holds them as transformers' `rope_parameters` does, less `rope_theta`.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ModelArgs:
    """Geometry of a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    # None (plain RoPE), or {"rope_type": one of ROPE_SCALING_KEYS, its keys..., optional ones}; see model.py.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelArgs.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelArgs: num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"ModelArgs.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            self._check_rope_scaling(self.rope_scaling)

    @staticmethod
    def _check_rope_scaling(scaling: dict[str, Any]) -> None:
        rope_type = scaling.get("rope_type")
        if rope_type not in ROPE_SCALING_KEYS:
            raise ConfigError(
                f"RoPE scaling type {rope_type!r} is not supported; kvbridge runs {', '.join(ROPE_SCALING_KEYS)} "
                "(or none)"
            )
        missing = [key for key in ROPE_SCALING_KEYS[rope_type] if not isinstance(scaling.get(key), int | float)]
        if missing:
            raise ConfigError(f"RoPE scaling type {rope_type!r} needs numbers for {missing}, got {scaling}")

    @property
    def rope_type(self) -> str:
        """"default" (no scaling) or the key of ROPE_SCALING_KEYS that `rope_scaling` names."""
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token per element byte (multiply by the dtype's size)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim


def _byte_vocab_preset(**geometry: Any) -> ModelArgs:
    """A preset under the byte-level tokenizer: its specials, and its vocabulary unless `geometry`
    gives one (a real model's, to cost what that model costs)."""
    return ModelArgs(
        **{"vocab_size": BYTE_VOCAB_SIZE, **geometry}, bos_token_id=BYTE_VOCAB_BOS, eos_token_id=BYTE_VOCAB_EOS
    )


PRESETS: dict[str, ModelArgs] = {
    # The default: fast enough for CPU tests, big enough to exercise GQA and several layers.
    "tiny": _byte_vocab_preset(
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        max_position=4096,
        rope_theta=10000.0,
    ),
    # For benchmarks: ~95M parameters; 8 KV heads of head_dim 64, i.e. 16 KiB of bf16 KV per token.
    "small": _byte_vocab_preset(
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=2816,
        max_position=8192,
        rope_theta=500000.0,
    ),
    # Llama-3-8B's KV geometry (32 layers x 8 KV heads x head_dim 128: 128 KiB per token in bf16)
    # on a narrower trunk (~0.8B parameters): P/D and offload benchmarks move realistic bytes.
    "kv8b": _byte_vocab_preset(
        hidden_size=2048,
        num_layers=32,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=2048,
        max_position=8192,
        rope_theta=500000.0,
    ),
    # Llama-3-8B's full geometry (~8.0B parameters, ~16 GB in bf16; its 128,256-token vocabulary
    # under the byte tokenizer): TTFT figures where recompute costs what it costs users.
    "llama3-8b": _byte_vocab_preset(
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        max_position=8192,
        rope_theta=500000.0,
    ),
}


def get_preset(name: str) -> ModelArgs:
    """The preset called `name`; raises ConfigError listing the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; built-in presets: {sorted(PRESETS)}") from None


def is_preset(name: str) -> bool:
    return name in PRESETS


def check_model_source(model: str) -> None:
    """Raise ModelNotFoundError unless `model` names a preset or a local directory. Torch-free, so the
    CLI can refuse a bad `--model` before it starts anything."""
    if not is_preset(model) and not os.path.isdir(model):
        raise ModelNotFoundError(
            f"model {model!r} is neither a built-in preset ({', '.join(sorted(PRESETS))}) nor a local directory; "
            "kvbridge fetches nothing at run time: download the checkpoint first "
            "(e.g. `hf download <repo> --local-dir <dir>`) and pass the directory"
        )
    if not is_preset(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise ModelNotFoundError(
            f"model directory {model!r} has no config.json: pass a Hugging Face checkpoint directory "
            "(config.json, *.safetensors and the tokenizer files)"
        )


def with_overrides(args: ModelArgs, **changes: Any) -> ModelArgs:
    """A copy of `args` with some fields changed (tests build odd geometries this way)."""
    return replace(args, **changes)
