"""Log-probabilities (SamplingParams.logprobs): the raw model distribution of each sampled token,
checked against a dense recomputation of the same weights; nothing is computed unless asked."""

from __future__ import annotations

import pytest
import torch
from dense_reference import dense_logits

from kvbridge import LLM, SamplingParams
from kvbridge.engine import sampler
from kvbridge.errors import SamplingParamsError

PROMPT = [7, 99, 3, 42, 250, 18, 64, 5, 120, 31, 77, 200, 9, 14, 150, 33, 8]  # 17 tokens: past one block
NUM_TOP = 5


@pytest.fixture(scope="module")
def llm():
    with LLM(block_size=16, num_blocks=64) as engine:
        yield engine


def _recomputed(llm: LLM, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Log-probabilities [len(output), V] of each output position, from a dense forward of prompt + output."""
    logits = dense_logits(llm.engine.runner.model, prompt + output)
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)].float().log_softmax(-1)


def test_greedy_logprobs_are_the_max_and_match_a_recomputation(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP)
    [out] = llm.generate({"prompt_token_ids": PROMPT}, params)
    completion = out.outputs[0]
    assert [e.token_id for e in completion.logprobs] == completion.token_ids
    expected = _recomputed(llm, PROMPT, completion.token_ids)
    for position, entry in enumerate(completion.logprobs):
        top_ids = [t for t, _ in entry.top]
        top_values = [v for _, v in entry.top]
        assert len(entry.top) == NUM_TOP and top_values == sorted(top_values, reverse=True)
        assert top_ids[0] == entry.token_id and entry.logprob == max(top_values)  # greedy took the max
        assert entry.logprob == pytest.approx(float(expected[position, entry.token_id]), abs=1e-4)
        reference_top = expected[position].topk(NUM_TOP)
        assert top_values == pytest.approx(reference_top.values.tolist(), abs=1e-4)


def test_sampled_tokens_get_raw_logprobs_whatever_the_temperature(llm):
    """The figures describe the model: temperature, top-k and penalties change the draw, not them."""
    params = SamplingParams(
        max_tokens=5, temperature=1.7, top_k=20, seed=3, ignore_eos=True, presence_penalty=1.0, logprobs=0
    )
    [out] = llm.generate({"prompt_token_ids": PROMPT}, params)
    completion = out.outputs[0]
    expected = _recomputed(llm, PROMPT, completion.token_ids)
    for position, entry in enumerate(completion.logprobs):
        assert entry.top == []
        assert entry.logprob == pytest.approx(float(expected[position, entry.token_id]), abs=1e-4)


def test_no_logprobs_unless_asked(llm, monkeypatch):
    calls = []
    monkeypatch.setattr(sampler, "token_logprobs", lambda *a: calls.append(a))
    [out] = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=3, temperature=0.0))
    assert out.outputs[0].logprobs is None and calls == []


def test_a_batch_mixes_requests_with_and_without_logprobs(llm):
    asking = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:9]}], [plain, asking])
    assert outs[0].outputs[0].logprobs is None
    assert [e.token_id for e in outs[1].outputs[0].logprobs] == outs[1].outputs[0].token_ids
    assert all(len(e.top) == 2 for e in outs[1].outputs[0].logprobs)


@pytest.mark.parametrize("value", [-1, 21])
def test_logprobs_out_of_range_is_refused(value):
    with pytest.raises(SamplingParamsError, match="logprobs"):
        SamplingParams(logprobs=value)
