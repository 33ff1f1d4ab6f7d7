"""Presence, frequency and repetition penalties and min_tokens: the sampler sees each request's tokens."""

from __future__ import annotations

import pytest
import torch

from kvbridge import LLM
from kvbridge.engine import sampler
from kvbridge.engine.sampler import TokenHistory
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.errors import SamplingParamsError

HISTORY = TokenHistory(prompt_token_ids=[0, 1], output_token_ids=[2, 2, 3])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = sampler.apply_penalties(logits, params, HISTORY)
    # token 2: twice (0.5 + 2 * 0.25), token 3: once (0.5 + 0.25); prompt tokens 0, 1 untouched
    assert got.tolist() == [0.0, 0.0, -1.0, -0.75, 0.0]


def test_repetition_penalty_shrinks_every_seen_token_toward_unlikely():
    logits = torch.tensor([2.0, -2.0, 4.0, -1.0, 3.0])
    got = sampler.apply_penalties(logits, SamplingParams(repetition_penalty=2.0), HISTORY)
    assert got.tolist() == [1.0, -4.0, 2.0, -2.0, 3.0]  # prompt and output tokens; token 4 unseen


def test_min_tokens_keeps_eos_and_stop_tokens_out_until_reached():
    logits = torch.zeros(6)
    params = SamplingParams(min_tokens=4, stop_token_ids=(5,))
    short = sampler.adjust_logits(logits, params, HISTORY, eos_token_ids=(4, 99))  # 99: past the vocabulary
    assert torch.isinf(short).tolist() == [False, False, False, False, True, True]
    ignore_eos = SamplingParams(min_tokens=4, stop_token_ids=(5,), ignore_eos=True)
    assert torch.isinf(sampler.adjust_logits(logits, ignore_eos, HISTORY, (4,))).tolist()[4:] == [False, True]
    reached = SamplingParams(min_tokens=3, stop_token_ids=(5,))
    assert not torch.isinf(sampler.adjust_logits(logits, reached, HISTORY, (4,))).any()


def test_a_greedy_row_with_penalties_is_penalized_and_the_others_are_not():
    logits = torch.tensor([[-5.0, -5.0, 1.0, 0.5], [-5.0, -5.0, 1.0, 0.5]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0), SamplingParams(temperature=0.0)]
    assert sampler.sample(logits, params, [None, None], [HISTORY, HISTORY]) == [3, 2]


def test_a_row_that_needs_its_tokens_without_them_fails_alone():
    params = [SamplingParams(temperature=0.0, min_tokens=1), SamplingParams(temperature=0.0)]
    failed, ok = sampler.sample(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), params, [None, None])
    assert isinstance(failed, ValueError) and ok == 0


@pytest.mark.parametrize(
    "field, value",
    [("presence_penalty", 2.5), ("frequency_penalty", float("nan")), ("repetition_penalty", 0.0),
     ("repetition_penalty", 101.0), ("min_tokens", -1), ("min_tokens", 17)],
)  # fmt: skip
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


def test_the_engine_honours_min_tokens_over_a_stop_token():
    with LLM(max_model_len=64) as llm:
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        first = llm.generate("min tokens", greedy)[0].outputs[0].token_ids[0]
        stop_at_first = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(first,))
        assert llm.generate("min tokens", stop_at_first)[0].outputs[0].token_ids == [first]
        held = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(first,), min_tokens=3)
        out = llm.generate("min tokens", held)[0].outputs[0]
        assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]


def test_the_engine_applies_penalties_to_greedy_requests():
    with LLM(max_model_len=64) as llm:
        plain = llm.generate("penalties", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        banned = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
                                presence_penalty=2.0, repetition_penalty=100.0)  # fmt: skip
        penalized = llm.generate("penalties", banned)[0].outputs[0].token_ids
    unpenalized = plain[0].outputs[0].token_ids
    assert len(set(unpenalized)) < len(unpenalized), unpenalized  # the random model repeats itself...
    assert len(set(penalized)) == len(penalized), penalized  # ...and with penalties never does
