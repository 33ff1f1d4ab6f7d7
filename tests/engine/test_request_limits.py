"""RequestLimits: what add_request refuses knowing the model, each error naming the field."""

from __future__ import annotations

import pytest

from kvbridge.engine.request_limits import RequestLimits
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import InvalidRequestError

LIMITS = RequestLimits(vocab_size=384, max_model_len=256)
OK = SamplingParams(max_tokens=4)


def test_a_request_within_every_limit_passes():
    LIMITS.check([0, 383] + [1] * 253, SamplingParams(max_tokens=256, stop_token_ids=(0, 383)))


@pytest.mark.parametrize(
    "prompt, params, param, words",
    [
        ([], OK, "prompt", "empty"),
        ([1] * 256, OK, "prompt", "256 tokens"),
        ([1, 384], OK, "prompt", "384 (position 1)"),  # reached the embedding and killed the engine
        ([1, -1], OK, "prompt", "-1"),
        ([1, 2**64], OK, "prompt", str(2**64)),
        ([1], SamplingParams(max_tokens=257), "max_tokens", "max_model_len=256"),
        ([1], SamplingParams(stop_token_ids=(5, 384)), "stop_token_ids", "384"),
    ],
)
def test_what_the_engine_cannot_serve_raises_naming_the_field(prompt, params, param, words):
    with pytest.raises(InvalidRequestError) as info:
        LIMITS.check(prompt, params)
    assert info.value.param == param and words in str(info.value), str(info.value)


def test_without_chunked_prefill_a_prompt_over_the_budget_is_refused():
    limits = RequestLimits(vocab_size=384, max_model_len=256, max_unchunked_prompt=8)
    limits.check([1] * 8, OK)
    with pytest.raises(InvalidRequestError, match="chunked prefill"):
        limits.check([1] * 9, OK)
