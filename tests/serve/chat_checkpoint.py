"""A tiny chat checkpoint on disk: a random Llama (safetensors), a word-level tokenizer.json made with
the `tokenizers` library, and a tokenizer_config.json with a chat template and special tokens.

    path = write_chat_checkpoint(tmp_path)          # a directory `kvbridge serve --model` loads
    with chat_node() as (url, path): ...            # a `kvbridge serve` process over one
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator

from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvbridge.engine.presets import ModelArgs
from kvbridge.engine.weights import random_model
from kvbridge.serve.launcher import start_node, wait_healthy

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS = ["hello", "world", "how", "are", "you", "fine", "thanks", "the", "a", "is", "cat", "dog", "END", "."]
WORDS += [f"w{i}" for i in range(64 - len(SPECIAL_TOKENS) - len(WORDS))]
VOCAB = {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS)}  # 64 ids
BOS_ID, EOS_ID = VOCAB["<s>"], VOCAB["</s>"]

# Shaped like Zephyr's: BOS, one role marker per message, the generation prompt, raise_exception.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + ' ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)

ARGS = ModelArgs(vocab_size=len(VOCAB), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                 intermediate_size=48, max_position=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID)  # fmt: skip


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def write_chat_checkpoint(path, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0) -> str:
    """Write the checkpoint into directory `path`; without `chat_template` the config has none."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    model = random_model(ARGS, seed)
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              os.path.join(path, "model.safetensors"))  # fmt: skip
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": ARGS.vocab_size,
        "hidden_size": ARGS.hidden_size, "num_hidden_layers": ARGS.num_layers,
        "num_attention_heads": ARGS.num_heads, "num_key_value_heads": ARGS.num_kv_heads, "head_dim": ARGS.head_dim,
        "intermediate_size": ARGS.intermediate_size, "max_position_embeddings": ARGS.max_position,
        "rope_theta": ARGS.rope_theta, "rms_norm_eps": ARGS.rms_norm_eps, "tie_word_embeddings": False,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "torch_dtype": "float32",
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    _tokenizer().save(os.path.join(path, "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "unk_token": "<unk>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
    }  # fmt: skip
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f)
    return path


SERVED_NAME = "tiny-chat"
MAX_MODEL_LEN = 128


@contextlib.contextmanager
def chat_node(before_healthy=lambda url, path: None) -> Iterator[tuple[str, str]]:
    """(url, checkpoint) of a plain `kvbridge serve` node over a fresh chat checkpoint, served as
    SERVED_NAME; `before_healthy(url, path)` runs while it boots. Always stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="kvbridge-chat-") as tmp:
        path = write_chat_checkpoint(os.path.join(tmp, "model"))
        args = ["--no-connector", "--served-model-name", SERVED_NAME, "--num-threads", "1", "--num-blocks", "64",
                "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
        proc = start_node("node", "both", tmp, model=path, extra_args=args)
        try:
            before_healthy(proc.url, path)
            wait_healthy([proc], timeout_s=120)
            yield proc.url, path
        finally:
            proc.stop()
