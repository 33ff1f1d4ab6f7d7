"""A random Llama checkpoint with a locally trained BPE tokenizer, for tests and benchmarks against real
engines: tiny for the tests, of a real model's geometry (llama3-8b) for GPU benchmarks.

    path = make_random_llama_checkpoint(tmp / "model", num_layers=4, hidden_size=128, num_heads=2,
                                        num_kv_heads=2, head_dim=64, vocab_size=1024, seed=0)

vLLM, transformers and kvbridge's engine (`LLM(model=path)`) load the directory; in float32 their
greedy tokens agree. Nothing is downloaded. Importing this module needs neither torch nor
transformers: `make_random_llama_checkpoint` imports them.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator

BOS, EOS, PAD = "<s>", "</s>", "<pad>"  # ids 0, 1, 2 of the tokenizer
NUM_SPECIAL_TOKENS = 3


def training_text(seed: int, num_lines: int = 4000) -> Iterator[str]:
    """Lines of made-up words: enough distinct character pairs for BPE to learn a few thousand merges."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + list("aeiou")
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    for _ in range(num_lines):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 24)))
        yield line.capitalize() + rng.choice(".,;!?")


MAX_TRAINED_VOCAB = 4096  # what BPE learns from `training_text`; larger vocabularies are padded


def train_tokenizer(vocab_size: int, seed: int):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` ids that prepends BOS. Past
    `MAX_TRAINED_VOCAB` the vocabulary is padded with ids no text encodes to (`<unused_i>`), so a
    checkpoint can have a real model's vocabulary size (128,256 for Llama 3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 300:
        raise ValueError(f"a vocabulary of {vocab_size} ids cannot hold the 256 bytes and the special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, MAX_TRAINED_VOCAB), special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(training_text(seed), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    if vocab_size > tok.get_vocab_size():
        spec = json.loads(tok.to_str())
        learned = len(spec["model"]["vocab"])
        spec["model"]["vocab"].update((f"<unused_{i}>", i) for i in range(learned, vocab_size))
        tok = Tokenizer.from_str(json.dumps(spec))
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"BPE learned {tok.get_vocab_size()} ids, not {vocab_size}")
    return tok


def random_llama_weights(config, seed: int, dtype, device: str) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(name, CPU tensor) of a LlamaForCausalLM's parameters under Hugging Face names, drawn on
    `device` (a GPU draws an 8B model in seconds) and cast to `dtype`: linear ~ N(0, 1/fan_in),
    embeddings ~ N(0, 1), norms 1, the LM head rows of BOS/EOS/PAD zero."""
    import torch

    gen = torch.Generator(device).manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        w = torch.randn(out_features, in_features, generator=gen, device=device) / in_features**0.5
        return w.to(dtype).cpu()

    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    yield "model.embed_tokens.weight", torch.randn(config.vocab_size, h, generator=gen, device=device).to(dtype).cpu()
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):  # fmt: skip
            yield prefix + name + ".weight", linear(*shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield prefix + norm + ".weight", torch.ones(h, dtype=dtype)
    yield "model.norm.weight", torch.ones(h, dtype=dtype)
    head = linear(config.vocab_size, h)
    head[:NUM_SPECIAL_TOKENS] = 0.0
    yield "lm_head.weight", head


def save_sharded(path: str, tensors: Iterator[tuple[str, "torch.Tensor"]], shard_nbytes: int = 4 << 30) -> None:
    """`tensors` as safetensors shards of about `shard_nbytes`: one model.safetensors, or
    model-0000i-of-0000n.safetensors and their model.safetensors.index.json."""
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    sizes = [0]
    for name, tensor in tensors:
        if sizes[-1] and sizes[-1] + tensor.nbytes > shard_nbytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += tensor.nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def make_random_llama_checkpoint(
    path: str | os.PathLike,
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    seed: int,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 8192,
    dtype: str = "float32",
    device: str = "cpu",
) -> str:
    """A random LlamaForCausalLM (in `dtype`, drawn on `device`) and its BPE tokenizer, saved as
    Hugging Face saves one in `path`. Tiny in tests; the benchmarks write full-size ones with it.

    vLLM, transformers and kvbridge's engine all load the directory. vLLM's CPU attention accepts
    head_dim in {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}. Weights are drawn as kvbridge's
    presets draw theirs (linear ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms 1), so activations keep
    unit scale and greedy tokens are decided by clear margins rather than float rounding; the LM head
    rows of BOS/EOS/PAD are zero, so greedy decoding never stops early or emits a special token.
    Returns `path` as a string.
    """
    import torch
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path = str(path)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False, torch_dtype=dtype,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    save_sharded(path, random_llama_weights(config, seed, getattr(torch, dtype), device))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(vocab_size, seed), bos_token=BOS,
                                        eos_token=EOS, pad_token=PAD)  # fmt: skip
    tokenizer.save_pretrained(path)
    return path


def kv_bytes_per_token(model_dir: str, dtype_nbytes: int = 4) -> int:
    """Bytes of K and V per token over all layers, from the checkpoint's config.json (float32: 4)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    num_kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * num_kv_heads * head_dim * dtype_nbytes
