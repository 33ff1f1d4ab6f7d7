"""What one request may ask of an engine: the checks `EngineCore.add_request` runs knowing the model.

The HTTP API range-checks every field by itself (serve/protocol.py, SamplingParams); these checks
need the engine's vocabulary size and max_model_len. Each raises InvalidRequestError naming the
field, which the server answers with a 400. A prompt token id past the vocabulary once reached the
embedding and killed the engine; on a GPU it is a device-side assert that kills the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import InvalidRequestError


def _first_outside(token_ids: Sequence[int], vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first token id outside [0, vocab_size), or None. Vectorized: a Python
    loop over a 4,096-token prompt cost ~0.4 ms of every request's admission."""
    try:
        ids = np.asarray(token_ids, dtype=np.int64)
    except OverflowError:  # an id past 64 bits, outside any vocabulary: find it the slow way
        return next(((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size), None)
    outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    return (int(outside[0]), int(ids[outside[0]])) if len(outside) else None


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int  # prompt + output tokens of one request
    max_unchunked_prompt: int | None = None  # max_num_batched_tokens when chunked prefill is off

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError naming the first field this engine cannot serve."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty; give at least one token", param="prompt")
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens, but this engine serves at most {self.max_model_len} "
                "tokens per request (prompt + output); shorten the prompt or raise max_model_len / the KV cache size",
                param="prompt",
            )
        if self.max_unchunked_prompt is not None and num_prompt > self.max_unchunked_prompt:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens, more than max_num_batched_tokens="
                f"{self.max_unchunked_prompt} with chunked prefill off; enable chunked prefill",
                param="prompt",
            )
        if params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} exceeds this engine's max_model_len={self.max_model_len}; a "
                "completion ends with finish_reason 'length' once prompt + output reach max_model_len",
                param="max_tokens",
            )
        if (bad := _first_outside(prompt_token_ids, self.vocab_size)) is not None:
            raise InvalidRequestError(
                f"prompt token id {bad[1]} (position {bad[0]}) is outside the vocabulary [0, {self.vocab_size})",
                param="prompt",
            )
        if (bad := _first_outside(params.stop_token_ids, self.vocab_size)) is not None:
            raise InvalidRequestError(
                f"stop token id {bad[1]} is outside the vocabulary [0, {self.vocab_size})", param="stop_token_ids"
            )
