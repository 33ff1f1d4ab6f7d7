"""A checkpoint's chat template, rendered the way transformers' `apply_chat_template` renders it.

The template comes from the checkpoint directory: `chat_template.jinja` if present, else the
`chat_template` entry of `tokenizer_config.json` (a string, or a list of named templates of which
`default` is used), as transformers reads them. It is rendered with jinja2 in an immutable
sandbox with transformers' conventions: `trim_blocks`, `lstrip_blocks`, the `loopcontrols`
extension, `raise_exception(message)`, `strftime_now(format)`, a `tojson` that keeps non-ASCII
text; the variables are `messages`, `add_generation_prompt` and the special tokens
(`bos_token`, `eos_token`, `unk_token`, `pad_token`, ... from `tokenizer_config.json`, else
`special_tokens_map.json`). The rendered text is tokenized with the checkpoint's `tokenizer.json`
without adding special tokens (the template writes them itself), as transformers does.

    template = load_chat_template("/models/llama")          # ChatTemplateError if it has none
    prompt_ids = template.encode(template.render(messages, add_generation_prompt=True))
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from collections.abc import Callable
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvbridge.errors import InvalidRequestError

# The special tokens transformers hands to a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(InvalidRequestError):
    """The model has no usable chat template, or its template refused the messages (HTTP 400)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not, and templates rely on it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"cannot read {path}: {exc}", "messages") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(checkpoint_dir: str, config: dict[str, Any]) -> str | None:
    path = os.path.join(checkpoint_dir, "chat_template.jinja")
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, ValueError) as exc:  # ValueError: not UTF-8
            raise ChatTemplateError(f"cannot read {path}: {exc}", "messages") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) else None


# The built-in presets' chat template. Their tokenizer is byte-level (ids 0-255 are UTF-8 bytes, then
# BOS/EOS), so the turn markers are plain text: "<|user|>\nHello\n<|assistant|>\n". Their weights
# are random: this lets chat be tried end to end (the route, streaming, the openai client, P/D),
# it does not make the answers sensible.
PRESET_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplate:
    """A compiled chat template, the special tokens it sees, and the tokenizer of its text: the
    checkpoint's `tokenizer.json` (`tokenizer_path`), or an `encode` function."""

    def __init__(
        self, source: str, special_tokens: dict[str, str], tokenizer_path: str | None = None,
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:  # fmt: skip
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}", "messages") from None
        if encode is None:
            from tokenizers import Tokenizer

            try:
                tokenizer = Tokenizer.from_file(tokenizer_path)
            except Exception as exc:  # the library raises a bare Exception on malformed files
                raise ChatTemplateError(f"cannot read {tokenizer_path}: {exc}", "messages") from None
            encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
        self._encode = encode
        self.special_tokens = special_tokens

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text. Raises ChatTemplateError when the template refuses the messages (its
        `raise_exception`, e.g. roles that do not alternate) or fails on them."""
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template refused the messages: {exc}", "messages") from None
        except Exception as exc:  # noqa: BLE001 - the template is code from the checkpoint, run on client data
            message = f"the model's chat template failed on the messages: {type(exc).__name__}: {exc}"
            raise ChatTemplateError(message, "messages") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text; special tokens are the template's to write (a preset's BOS id,
        which no text can write, is added by its encoder)."""
        return self._encode(text)


def load_chat_template(checkpoint_dir: str) -> ChatTemplate:
    """The chat template of a checkpoint directory, or of a built-in preset (PRESET_CHAT_TEMPLATE).
    Raises ChatTemplateError saying why there is none."""
    from kvbridge.engine.presets import is_preset

    if is_preset(checkpoint_dir):
        from kvbridge.engine.tokenizer import ByteTokenizer

        return ChatTemplate(PRESET_CHAT_TEMPLATE, {}, encode=ByteTokenizer().encode)
    if not os.path.isdir(checkpoint_dir):
        raise ChatTemplateError(f"model {checkpoint_dir!r} is neither a built-in preset nor a checkpoint directory", "messages")
    config = _read_json(os.path.join(checkpoint_dir, "tokenizer_config.json"))
    source = _template_source(checkpoint_dir, config)
    if source is None:
        raise ChatTemplateError(
            f"the checkpoint {checkpoint_dir} has no chat template (no chat_template in tokenizer_config.json, "
            "no chat_template.jinja); use /v1/completions with a prompt you format yourself",
            "messages",
        )
    tokenizer_path = os.path.join(checkpoint_dir, "tokenizer.json")
    if not os.path.exists(tokenizer_path):
        message = f"the checkpoint {checkpoint_dir} has a chat template but no tokenizer.json"
        raise ChatTemplateError(message, "messages")
    fallback = _read_json(os.path.join(checkpoint_dir, "special_tokens_map.json"))
    special_tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name)) or _token_text(fallback.get(name))
        if text is not None:
            special_tokens[name] = text
    return ChatTemplate(source, special_tokens, tokenizer_path)
