"""A tiny random Llama checkpoint with a locally trained BPE tokenizer, for tests against real engines.

    path = make_tiny_checkpoint(tmp / "model", num_layers=4, hidden_size=128, num_heads=2,
                                num_kv_heads=2, head_dim=64, vocab_size=1024, seed=0)

vLLM, transformers and kvbridge's engine (`LLM(model=path)`) load the directory; in float32 their
greedy tokens agree. Nothing is downloaded. Importing this module needs neither torch nor
transformers: `make_tiny_checkpoint` imports them.
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


def train_tokenizer(vocab_size: int, seed: int):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` ids that prepends BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(training_text(seed), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"BPE learned {tok.get_vocab_size()} ids, not {vocab_size}; ask for a vocabulary of 300..4096")
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return tok


def make_tiny_checkpoint(
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
) -> str:
    """A random float32 LlamaForCausalLM and its BPE tokenizer, saved with `save_pretrained` in `path`.

    vLLM, transformers and kvbridge's engine all load the directory. vLLM's CPU attention accepts
    head_dim in {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}. Weights are drawn as kvbridge's
    presets draw theirs (linear ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms 1), so activations keep
    unit scale and greedy tokens are decided by clear margins rather than float rounding; the LM head
    rows of BOS/EOS/PAD are zero, so greedy decoding never stops early or emits a special token.
    Returns `path` as a string.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = str(path)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:  # [out, in]
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
        model.lm_head.weight[:NUM_SPECIAL_TOKENS] = 0.0
    model.save_pretrained(path)
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
