"""Log-probabilities in OpenAI's two shapes, from the engine's `TokenLogprobs` (one per token).

    /v1/completions (`logprobs: N`, N in 0..5):
        {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...], "text_offset": [...]}
    /v1/chat/completions (`logprobs: true`, `top_logprobs: N`, N in 0..20):
        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

The figures are the model's raw distribution (engine/sampler.py). A token's text is what it adds to
the choice's text, decoded after the few tokens before it (incremental detokenization, as vLLM does):
the sampled tokens' texts join into the choice's text (before a stop string cuts it), with the
spaces a tokenizer puts between words. A byte-level token that ends inside a UTF-8 character adds
no text; the token that completes the character adds all of it. `bytes` (chat) are a token text's UTF-8 bytes, as vLLM writes them; `text_offset`
(completions) is where each token's text starts in the choice's text. A formatter lives as long as
its choice: when streaming, each chunk's logprobs continue where the previous chunk's ended.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from kvbridge.engine.outputs import TokenLogprobs
from kvbridge.serve.stop_strings import INCOMPLETE_CHAR

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions (chat's is the engine's, MAX_LOGPROBS)
# JSON has no -inf (a token the model rules out); vLLM writes this instead, and so does kvbridge.
LOWEST_LOGPROB = -9999.0

CONTEXT_TOKENS = 4  # a UTF-8 character is at most 4 byte-level tokens; a word's leading space needs 1
Decode = Callable[[Sequence[int]], str]  # the tokenizer's: token ids -> text


class TokenTexts:
    """The text each next token of one choice adds, decoded after the choice's last CONTEXT_TOKENS tokens."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.context: list[int] = []  # the choice's last tokens
        self.before = ""  # their text

    def of(self, token_id: int) -> str:
        """What `token_id` would add now: nothing while it ends inside a character; decoded alone when
        the tokenizer rewrites the context's text."""
        after = self.decode([*self.context, token_id])
        if after.endswith(INCOMPLETE_CHAR):
            return ""
        return after[len(self.before) :] if after.startswith(self.before) else self.decode([token_id])

    def advance(self, token_id: int) -> None:
        self.context = [*self.context, token_id][-CONTEXT_TOKENS:]
        self.before = self.decode(self.context).rstrip(INCOMPLETE_CHAR)  # the next token may complete it

    def entries(self, entries: Sequence[TokenLogprobs]) -> Iterator[tuple[TokenLogprobs, str, list[str]]]:
        """Each entry with its token's text and its alternatives' texts, advancing past its token."""
        for entry in entries:
            yield entry, self.of(entry.token_id), [self.of(t) for t, _ in entry.top]
            self.advance(entry.token_id)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOWEST_LOGPROB


class LogprobsFormatter(Protocol):
    def format(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]: ...


class CompletionLogprobs:
    """`choices[i].logprobs` of /v1/completions."""

    def __init__(self, decode: Decode) -> None:
        self.texts = TokenTexts(decode)
        self.offset = 0  # characters of the choice's tokens formatted so far

    def format(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        body: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry, token, top in self.texts.entries(entries):
            body["tokens"].append(token)
            body["token_logprobs"].append(_finite(entry.logprob))
            body["top_logprobs"].append({text: _finite(lp) for text, (_, lp) in zip(top, entry.top)})
            body["text_offset"].append(self.offset)
            self.offset += len(token)
        return body


class ChatLogprobs:
    """`choices[i].logprobs` of /v1/chat/completions."""

    def __init__(self, decode: Decode) -> None:
        self.texts = TokenTexts(decode)

    def format(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        content = [
            {**_chat_token(token, entry.logprob), "top_logprobs": [_chat_token(t, lp) for t, (_, lp) in zip(top, entry.top)]}
            for entry, token, top in self.texts.entries(entries)
        ]
        return {"content": content, "refusal": None}


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
