"""Where the parameters come from: seeded random init for presets, safetensors for checkpoints.

`load_model(model_config)` is what the model runner calls. It resolves `ModelConfig.model`:
a built-in preset name (see presets.py), or a local Hugging Face checkpoint directory holding
config.json and *.safetensors (one file, or shards listed by model.safetensors.index.json).
Nothing is downloaded. Supported architectures: LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM. Every problem with the directory raises `ModelLoadError`.

Under tensor parallelism each rank loads only its shard (tensor_parallel.py): a preset's weights are
drawn whole, in the same order and from the same seed as at TP 1, and sliced; a checkpoint's tensors
are checked against the whole model's shapes, then sliced. Either way every rank holds exactly the
numbers TP 1 would, split.
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

import torch

from kvbridge.config import ModelConfig
from kvbridge.engine.checkpoint_id import checkpoint_id
from kvbridge.engine.model import LlamaForCausalLM
from kvbridge.engine.presets import ModelArgs, check_model_source, get_preset, is_preset
from kvbridge.engine.tensor_parallel import AllReduce, local_args, make_shard, shard_parameter
from kvbridge.engine.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from kvbridge.errors import ConfigError, ModelLoadError
from kvbridge.tp_layout import TPShard

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class LoadedModel(NamedTuple):
    model: LlamaForCausalLM  # on the configured device and dtype, rotary not yet attached
    tokenizer: Tokenizer
    model_id: str  # identity of the weights: "tiny:seed=0", or "<architecture>:<content hash>" (checkpoint_id.py)
    max_position: int  # the model's own context limit
    shard: TPShard | None  # this rank's share under tensor parallelism; None at TP 1


def model_args(model_config: ModelConfig) -> ModelArgs:
    """The whole model's geometry, without loading any weight (to validate a TP size before starting ranks)."""
    if is_preset(model_config.model):
        return get_preset(model_config.model)
    check_model_source(model_config.model)
    return read_hf_config(model_config.model)[0]


def load_model(
    model_config: ModelConfig,
    device: torch.device | None = None,
    rank: int = 0,
    all_reduce: AllReduce | None = None,
) -> LoadedModel:
    """The model, tokenizer and identity that `model_config.model` names, on `device` (default:
    `model_config.device`). With `model_config.tensor_parallel_size` N > 1: rank `rank`'s shard, its
    row-parallel layers summing through `all_reduce`."""
    device = device or torch.device(model_config.device)
    dtype = getattr(torch, model_config.dtype)
    world_size = model_config.tensor_parallel_size
    if is_preset(model_config.model):
        args = get_preset(model_config.model)
        shard = make_shard(args, rank, world_size) if world_size > 1 else None
        model = random_model(args, model_config.seed, device, dtype, shard, all_reduce)
        model.fuse_projections()
        tokenizer = ByteTokenizer(args.vocab_size, args.bos_token_id, (args.eos_token_id,))
        model_id = f"{model_config.model}:seed={model_config.seed}"
        return LoadedModel(model.eval(), tokenizer, model_id, args.max_position, shard)
    path = model_config.model
    check_model_source(path)
    args, max_position = read_hf_config(path)
    shard = make_shard(args, rank, world_size) if world_size > 1 else None
    model = load_checkpoint(path, args, device, dtype, shard, all_reduce)
    model.fuse_projections()
    model_id = checkpoint_id(os.path.join(path, "config.json"), safetensors_files(path))  # pages cached by the load
    return LoadedModel(model.eval(), load_tokenizer(path), model_id, max_position, shard)


def _build_on_meta(args: ModelArgs, shard: TPShard | None, all_reduce: AllReduce | None) -> LlamaForCausalLM:
    """The module tree (TP 1's, or one rank's) with parameters on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return LlamaForCausalLM(args if shard is None else local_args(args, shard), all_reduce)


def _whole_model(args: ModelArgs, model: LlamaForCausalLM, shard: TPShard | None) -> LlamaForCausalLM:
    """The whole (TP 1) model's module tree, for its parameter names and shapes: `model` itself at TP 1."""
    return model if shard is None else _build_on_meta(args, None, None)


def random_model(
    args: ModelArgs,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    shard: TPShard | None = None,
    all_reduce: AllReduce | None = None,
) -> LlamaForCausalLM:
    """A model with weights drawn from a CPU generator seeded with `seed`, on `device` in `dtype`.

    Linear weights ~ N(0, 1/fan_in) keep activations at unit scale through the residual stream,
    so logits differ from token to token and greedy decoding does not collapse to one token.
    Every tensor is drawn in float32 on the CPU, shaped (`shape_byte_level_head`), then cast into
    its place on `device`: the same seed gives the same weights on every device and dtype, and
    the host never holds more than one float32 tensor (an 8B preset never needs 32 GB of RAM).
    With a `shard`, each whole tensor is drawn as above and this rank's part of it kept: the
    same seed gives the same model at every TP size.
    """
    gen = torch.Generator().manual_seed(seed)
    model = _build_on_meta(args, shard, all_reduce)
    # Drawn in the whole model's order and shapes (tied parameters once), before `model` is materialised.
    whole_shapes = {name: param.shape for name, param in _whole_model(args, model, shard).named_parameters()}
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty gives tied parameters separate storage
    with torch.no_grad():
        for name, shape in whole_shapes.items():
            param = model.get_parameter(name)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            drawn = torch.empty(shape, dtype=torch.float32)
            if len(shape) == 1:  # biases
                drawn.normal_(0.0, 0.02, generator=gen)
            elif "embed_tokens" in name:
                drawn.normal_(0.0, 1.0, generator=gen)
            else:
                drawn.normal_(0.0, 1.0 / math.sqrt(shape[1]), generator=gen)
            if name == "lm_head.weight":
                shape_byte_level_head(drawn)
            param.copy_(drawn if shard is None else shard_parameter(name, drawn, shard, args.head_dim))
    return model


def shape_byte_level_head(head: torch.Tensor) -> None:
    """Shape a random preset's untied LM head [vocab, hidden] for its byte-level tokenizer (cosmetic).

    Rows of ids >= 256 (BOS/EOS/PAD and reserved ids) are zeroed: their logit is 0 while the
    best byte's is well above, so greedy decoding never stops or emits undecodable ids at once
    (EOS can still be sampled at temperature > 0). Rows of printable ASCII are scaled by 1.5,
    so greedy output mostly prints.
    """
    if head.shape[0] <= 256:
        return  # nothing to shape
    head[256:] = 0.0
    head[[*range(32, 127), 10]] *= 1.5


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ModelLoadError(f"{path} has no config.json; pass a Hugging Face checkpoint directory")
    try:
        with open(config_path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot parse {config_path}: {exc}") from exc


def read_hf_config(path: str) -> tuple[ModelArgs, int]:
    """(ModelArgs, max positions) from a checkpoint's config.json."""
    cfg = _read_config(path)
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{path}: architectures={archs} is not supported; kvbridge runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}/config.json: hidden_act={cfg['hidden_act']!r}; kvbridge's MLP is SwiGLU (silu)")
    try:
        num_heads = cfg["num_attention_heads"]
        rope = read_rope_config(cfg)
        max_position = rope.max_position
        sliding = cfg.get("sliding_window")
        if sliding and (arch != "Qwen2ForCausalLM" or cfg.get("use_sliding_window")):
            # Attention here is always full; capping the context at the window keeps it exact.
            max_position = min(max_position, int(sliding))
        args = ModelArgs(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            intermediate_size=cfg["intermediate_size"],
            max_position=max_position,
            rope_theta=rope.theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope.scaling,
            bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
            eos_token_id=cfg.get("eos_token_id") if isinstance(cfg.get("eos_token_id"), int) else None,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path}/config.json lacks {exc.args[0]!r}") from None
    except ConfigError as exc:
        raise ModelLoadError(f"{path}/config.json: {exc}") from None
    return args, max_position


class RopeConfig(NamedTuple):
    theta: float
    scaling: dict | None  # ModelArgs.rope_scaling
    max_position: int  # the context the scaling is made for


def read_rope_config(cfg: dict) -> RopeConfig:
    """RoPE from either form of config.json, resolved as transformers resolves it.

    transformers < 5 writes a top-level `rope_theta` and `rope_scaling` ({"type" or "rope_type",
    ...}); transformers >= 5 writes `rope_parameters` ({"rope_type", "rope_theta", ...}).
    `rope_scaling` wins over `rope_parameters`; a `rope_theta` inside wins over the top-level one.
    Raises ConfigError (unsupported forms) or KeyError (missing keys).
    """
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ConfigError(f"per-layer-type RoPE parameters are not supported: {params}")
    partial = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor={partial}: kvbridge rotates whole heads")
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    max_position = int(cfg["max_position_embeddings"])
    if rope_type == "default":
        return RopeConfig(theta, None, max_position)
    if rope_type in ("llama3", "yarn"):
        original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or max_position
    if rope_type == "yarn":
        # YaRN stretches the original context by `factor` (derived from the two lengths when null).
        original = params["original_max_position_embeddings"]
        if params.get("factor") is None:
            params["factor"] = max_position / original
        max_position = max(max_position, int(params["factor"] * original))
    return RopeConfig(theta, {"rope_type": rope_type, **params}, max_position)


def safetensors_files(path: str) -> list[str]:
    """The shard files of a checkpoint: from model.safetensors.index.json, else every *.safetensors."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ModelLoadError(f"{path} holds no *.safetensors files; kvbridge loads safetensors checkpoints only")
    files = [os.path.join(path, n) for n in names]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise ModelLoadError(f"{path}: shards listed in model.safetensors.index.json are missing: {missing}")
    return files


def load_checkpoint(
    path: str,
    args: ModelArgs,
    device: torch.device,
    dtype: torch.dtype,
    shard: TPShard | None = None,
    all_reduce: AllReduce | None = None,
) -> LlamaForCausalLM:
    """Build the model on the meta device and assign the checkpoint's tensors (this rank's part of
    them under TP), cast and moved."""
    from safetensors.torch import load_file

    model = _build_on_meta(args, shard, all_reduce)
    whole_shapes = {name: tensor.shape for name, tensor in _whole_model(args, model, shard).state_dict().items()}
    expected = set(whole_shapes)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in safetensors_files(path):
        for name, tensor in load_file(file, device="cpu").items():
            if name in expected:
                want = tuple(whole_shapes[name])
                if tuple(tensor.shape) != want:
                    raise ModelLoadError(f"{path}: {name} has shape {tuple(tensor.shape)}, config.json implies {want}")
                if shard is not None:
                    tensor = shard_parameter(name, tensor, shard, args.head_dim)
                state[name] = tensor.to(device=device, dtype=dtype)
            elif not name.endswith("rotary_emb.inv_freq"):  # old exports saved this derived buffer
                unexpected.append(name)
    if unexpected:
        raise ModelLoadError(
            f"{path}: checkpoint has {len(unexpected)} tensors kvbridge's model has no place for, e.g. "
            f"{sorted(unexpected)[:3]} (an o_proj bias from Llama's attention_bias, say); dropping them would "
            "change the model"
        )
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model
