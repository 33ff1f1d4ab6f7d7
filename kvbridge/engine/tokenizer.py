"""Tokenizers: byte-level (built-in presets) and a checkpoint's tokenizer.json.

Both expose the same small interface the engine uses:

    encode(text) -> list[int]      # adds BOS where the tokenizer's own rules say so
    decode(token_ids) -> str       # special tokens skipped
    stream() -> TextStream         # decode a growing output token by token, not all of it again
    bos_token_id, eos_token_id: int | None
    eos_token_ids: tuple[int, ...] # every id that ends generation (generation_config may list several)
    vocab_size: int

Nothing is fetched at run time: `load_tokenizer` reads only files inside the checkpoint directory,
and a checkpoint without tokenizer.json is refused rather than given a tokenizer it was not trained with.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Callable, Sequence

from kvbridge.engine.presets import BYTE_VOCAB_BOS, BYTE_VOCAB_EOS, BYTE_VOCAB_PAD, BYTE_VOCAB_SIZE
from kvbridge.errors import ModelLoadError


class TextStream:
    """A request's output text as its tokens come: `add` decodes only the new ones, so a step costs
    the same at the thousandth token as at the first (decoding the whole output again every step
    made each step's host work grow with the output). `text` may lag by a character whose bytes or
    tokens are not all there yet; `finish` gives exactly `decode(every token)`."""

    def __init__(self, step: Callable[[list[int]], str | None], decode_all: Callable[[list[int]], str]) -> None:
        self._step = step
        self._decode_all = decode_all
        self._parts: list[str] = []
        self.num_tokens = 0  # tokens added so far

    def add(self, token_ids: Sequence[int]) -> None:
        if token_ids:
            piece = self._step(list(token_ids))
            if piece:
                self._parts.append(piece)
            self.num_tokens += len(token_ids)

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def finish(self, token_ids: Sequence[int]) -> str:
        """The whole text of `token_ids` (the tokens added so far): what `decode` gives."""
        return self._decode_all(list(token_ids))


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS/EOS/PAD follow. Ids >= 256 decode to nothing."""

    def __init__(
        self,
        vocab_size: int = BYTE_VOCAB_SIZE,
        bos_token_id: int | None = BYTE_VOCAB_BOS,
        eos_token_ids: Sequence[int] = (BYTE_VOCAB_EOS,),
        add_bos: bool = True,
    ) -> None:
        if vocab_size < 256:
            raise ModelLoadError(f"a byte-level tokenizer needs a vocabulary of at least 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = BYTE_VOCAB_PAD if vocab_size > BYTE_VOCAB_PAD else None
        self.add_bos = add_bos and bos_token_id is not None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def stream(self) -> TextStream:
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds a character's first bytes
        return TextStream(lambda ids: utf8.decode(bytes(t for t in ids if 0 <= t < 256)), self.decode)


class HFTokenizer:
    """A `tokenizers.Tokenizer` read from tokenizer.json."""

    def __init__(self, path: str, bos_token_id: int | None, eos_token_ids: Sequence[int]) -> None:
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as exc:  # the library raises a bare Exception on malformed files
            raise ModelLoadError(f"cannot read tokenizer {path}: {exc}; fix or remove the file") from exc
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def stream(self) -> TextStream:
        from tokenizers.decoders import DecodeStream

        decoder = DecodeStream(skip_special_tokens=True)  # keeps the context a token's text depends on

        def step(ids: list[int]) -> str:  # one id a call: what every tokenizers release since 0.21 takes
            return "".join(piece for i in ids if (piece := decoder.step(self._tokenizer, i)))

        return TextStream(step, self.decode)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)


Tokenizer = ByteTokenizer | HFTokenizer


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot parse {path}: {exc}; fix or remove the file") from exc


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


def special_token_ids(checkpoint_dir: str) -> tuple[int | None, tuple[int, ...]]:
    """(bos id, eos ids): generation_config.json wins over config.json, as in transformers."""
    config = _read_json(os.path.join(checkpoint_dir, "config.json"))
    gen = _read_json(os.path.join(checkpoint_dir, "generation_config.json"))
    bos = gen.get("bos_token_id", config.get("bos_token_id"))
    eos = _as_ids(gen.get("eos_token_id", config.get("eos_token_id")))
    return (bos if isinstance(bos, int) else None), eos


def load_tokenizer(checkpoint_dir: str) -> HFTokenizer:
    """tokenizer.json from `checkpoint_dir`; ModelLoadError saying how to make one when it is missing."""
    path = os.path.join(checkpoint_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise ModelLoadError(_missing_tokenizer_json(checkpoint_dir))
    return HFTokenizer(path, *special_token_ids(checkpoint_dir))


# A "slow" tokenizer's files: transformers converts them to tokenizer.json, the `tokenizers` library cannot.
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt")


def _missing_tokenizer_json(checkpoint_dir: str) -> str:
    found = [name for name in SLOW_TOKENIZER_FILES if os.path.exists(os.path.join(checkpoint_dir, name))]
    has = f" (it has {', '.join(found)})" if found else ""
    sentencepiece = " and the sentencepiece package" if "tokenizer.model" in found else ""
    return (
        f"{checkpoint_dir} has no tokenizer.json{has}; kvbridge reads only tokenizer.json, the fast "
        f"tokenizer file. Write it once with transformers{sentencepiece} installed: python -c \"from "
        f"transformers import AutoTokenizer; AutoTokenizer.from_pretrained('{checkpoint_dir}')"
        f".save_pretrained('{checkpoint_dir}')\", or copy in the tokenizer.json of the model these "
        "weights come from"
    )
