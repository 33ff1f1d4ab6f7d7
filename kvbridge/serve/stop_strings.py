"""Stop strings: a completion ends where its decoded text first contains one, the string cut off.

The engine stops on token ids only; stop strings are matched here, on the text the engine decodes,
the way OpenAI's API defines them: the returned text ends just before the earliest match, and the
request is then aborted in the engine (serve/api.py). While streaming, text that may still turn
out to be the start of a stop string is held back until the next tokens settle it, so no chunk
ever carries text that a later match cuts off.

    choice = ChoiceText(stop=("\\n\\n",))
    for output in outputs:                      # the engine's cumulative RequestOutputs
        delta = choice.update(output.outputs[0], output.finished)
        send(delta.text, delta.token_ids)       # streaming: text safe to show now
        if choice.is_finished: break            # a stop string matched, or the engine finished
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvbridge.engine.outputs import CompletionOutput, TokenLogprobs

MAX_STOP_STRINGS = 16  # OpenAI allows 4; LangChain-style clients send a handful
MAX_STOP_STRING_CHARS = 1000  # each is searched for in every step's new text
INCOMPLETE_CHAR = "\ufffd"  # what decoding half a UTF-8 character gives


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """Index in `text` of the earliest occurrence of any stop string at or after `start`, or None."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits, default=None)


def partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that begins some stop string (and could grow into it)."""
    longest = 0
    for s in stop:
        # Only a tail shorter than `s` that starts with its first character can begin it.
        i = text.find(s[0], max(len(text) - len(s) + 1, 0))
        while i != -1:
            if s.startswith(text[i:]):
                longest = max(longest, len(text) - i)  # the earliest such start is the longest tail
                break
            i = text.find(s[0], i + 1)
    return longest


class Delta(NamedTuple):
    """What a choice gained since the previous update: text safe to send, new token ids, and, in the
    last update, why the choice finished."""

    text: str
    token_ids: list[int]
    is_last: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # of `token_ids`, when the request asked for them


class ChoiceText:
    """One choice's visible text: the engine's decoded text, cut at the first stop string.

    `update` takes the engine's cumulative output and returns what is new and final; after the
    update that sets `finish_reason`, `text` and `token_ids` hold the whole answer.
    """

    def __init__(self, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self.stop = tuple(stop)
        self.min_tokens = min_tokens  # no stop string ends a completion shorter than this (as in vLLM)
        self._max_stop_len = max(map(len, self.stop), default=0)
        self._num_searched = 0  # characters of settled text already searched for stop strings
        self.text = ""  # every character handed out so far
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked
        self.num_sent_tokens = 0
        self.finish_reason: str | None = None
        self.is_finished = False  # the engine finished the request, or a stop string matched
        self.is_stopped = False  # a stop string matched: the engine request must be aborted

    def update(self, completion: CompletionOutput, finished: bool) -> Delta:
        # A trailing U+FFFD may be half a character the next token completes: not settled yet.
        settled = completion.text if finished else completion.text.rstrip(INCOMPLETE_CHAR)
        hit = self._search(settled, len(completion.token_ids))
        if hit is not None:
            settled, self.is_stopped, self.finish_reason = settled[:hit], True, "stop"
        elif finished:
            self.finish_reason = completion.finish_reason
        self.is_finished = finished or self.is_stopped
        self.token_ids = list(completion.token_ids)
        self.logprobs = completion.logprobs
        visible = settled
        if not self.is_finished and self.stop:
            visible = settled[: len(settled) - partial_stop_len(settled, self.stop)]
        # Decoding more tokens only appends to a settled text; should a tokenizer rewrite it, wait.
        new_text = visible[len(self.text) :] if visible.startswith(self.text) else ""
        self.text += new_text
        new_logprobs = None if self.logprobs is None else self.logprobs[self.num_sent_tokens :]
        delta = Delta(
            new_text, self.token_ids[self.num_sent_tokens :], self.is_finished, self.finish_reason, new_logprobs
        )
        self.num_sent_tokens = len(self.token_ids)
        return delta

    def _search(self, settled: str, num_tokens: int) -> int | None:
        """Where a stop string first starts, searching only text that could hold a new match."""
        if not self.stop:
            return None
        start = max(self._num_searched - self._max_stop_len + 1, 0)
        self._num_searched = len(settled)
        return find_stop(settled, self.stop, start) if num_tokens >= self.min_tokens else None
