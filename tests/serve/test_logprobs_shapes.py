"""OpenAI's two logprobs shapes from the engine's TokenLogprobs (serve/logprobs.py)."""

from __future__ import annotations

import math

from kvbridge.engine.outputs import TokenLogprobs
from kvbridge.serve.logprobs import LOWEST_LOGPROB, ChatLogprobs, CompletionLogprobs


def byte_decode(token_ids) -> str:
    """A byte-level tokenizer: token id = byte."""
    return bytes(token_ids).decode("utf-8", errors="replace")


EURO = list("€".encode())  # three tokens, one character
ENTRIES = [TokenLogprobs(t, -0.5, [(t, -0.5), (ord("x"), -math.inf)]) for t in [ord("a"), *EURO, ord("b")]]


def test_completion_texts_join_into_the_answer_and_offsets_continue_across_chunks():
    formatter = CompletionLogprobs(byte_decode)
    first, second = formatter.format(ENTRIES[:2]), formatter.format(ENTRIES[2:])
    tokens = first["tokens"] + second["tokens"]
    assert tokens == ["a", "", "", "€", "b"]  # the character's last byte adds all of it
    assert first["text_offset"] + second["text_offset"] == [0, 1, 1, 1, 2]
    assert first["top_logprobs"][0] == {"a": -0.5, "x": LOWEST_LOGPROB}  # JSON has no -inf


def test_chat_entries_carry_bytes_and_alternatives():
    [entry] = ChatLogprobs(byte_decode).format(ENTRIES[:1])["content"]
    assert entry == {
        "token": "a", "logprob": -0.5, "bytes": [97],
        "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                         {"token": "x", "logprob": LOWEST_LOGPROB, "bytes": [120]}],
    }  # fmt: skip
