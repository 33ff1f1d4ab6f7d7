"""SamplingParams: every value range-checked, the error naming its field."""

from __future__ import annotations

import math

import pytest

from kvbridge.engine.sampling_params import MAX_STOP_TOKEN_IDS, MAX_TOP_K, SamplingParams
from kvbridge.errors import ConfigError, SamplingParamsError


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 0.01},
        {"temperature": 100.0},
        {"top_p": 1e-300},
        {"top_k": MAX_TOP_K},
        {"seed": 0},
        {"seed": 2**64 - 1},
        {"stop_token_ids": [0] * MAX_STOP_TOKEN_IDS},
        {"max_tokens": 1},
    ],
)
def test_values_at_the_edges_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1e-300}, "temperature"),  # logits / t overflow: softmax gave NaN and killed the engine
        ({"temperature": 0.009}, "temperature"),
        ({"temperature": 100.5}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.0000001}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": MAX_TOP_K + 1}, "top_k"),
        ({"seed": 2**64}, "seed"),  # torch.Generator.manual_seed raised and killed the engine
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"stop_token_ids": [5, -1]}, "stop_token_ids"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ],
)
def test_out_of_range_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and f"SamplingParams.{field}" in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_stop_token_ids_become_a_tuple():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
