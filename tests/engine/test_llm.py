"""LLM end to end (tiny model, float32, CPU): greedy output equals a dense forward of the same weights."""

from __future__ import annotations

import random

import pytest
from dense_reference import dense_greedy

from kvbridge import LLM, SamplingParams
from kvbridge.errors import ConfigError, EngineShutdownError, InvalidRequestError

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def token_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def reference(llm: LLM, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return dense_greedy(llm.engine.runner.model, prompt, max_tokens)


@pytest.fixture(scope="module")
def llm():
    with LLM(block_size=16, num_blocks=64) as engine:
        yield engine


def test_single_request_matches_dense(llm):
    prompt = token_prompt(1, 37)
    [out] = llm.generate({"prompt_token_ids": prompt}, GREEDY)
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == reference(llm, prompt)
    llm.engine.check_integrity()


def test_batched_requests_match_dense_in_input_order(llm):
    prompts = [token_prompt(10 + i, n) for i, n in enumerate((3, 16, 17, 45, 64))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.prompt_token_ids for o in outs] == prompts
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == reference(llm, prompt), len(prompt)
    llm.engine.check_integrity()


def test_text_prompts_and_per_prompt_params(llm):
    outs = llm.generate(["Hello", "kvbridge!"], [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), GREEDY])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, MAX_TOKENS]
    hello = llm.tokenizer.encode("Hello")
    assert outs[0].prompt_token_ids == hello
    assert outs[0].outputs[0].token_ids == reference(llm, hello, 3)
    assert outs[0].outputs[0].text == llm.tokenizer.decode(outs[0].outputs[0].token_ids)
    with pytest.raises(ConfigError, match="one per prompt"):
        llm.generate(["a", "b"], [GREEDY])


def test_prefix_cache_hits_keep_outputs_exact(llm):
    shared = token_prompt(20, 48)
    prompts = [shared + token_prompt(21 + i, 5) for i in range(3)]
    first = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]
    before = llm.get_stats()["num_prefix_hit_tokens"]
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY)
    assert all(o.num_cached_tokens == 48 for o in rest)
    assert llm.get_stats()["num_prefix_hit_tokens"] - before == 96
    for out, prompt in zip([first, *rest], prompts):
        assert out.outputs[0].token_ids == reference(llm, prompt)
    again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]  # whole prompt cached but one block
    assert again.num_cached_tokens == 48 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache() is True
    cold = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first.outputs[0].token_ids
    llm.engine.check_integrity()


def test_chunked_prefill_matches_dense():
    prompts = [token_prompt(30 + i, n) for i, n in enumerate((50, 23, 9))]
    with LLM(num_blocks=64, max_num_batched_tokens=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        for out, prompt in zip(outs, prompts):
            assert out.outputs[0].token_ids == reference(llm, prompt)
        assert llm.get_stats()["num_steps"] >= (50 + 23 + 9) // 8
        llm.engine.check_integrity()


def test_runs_after_preemption_match_dense():
    # 10 blocks of 8 tokens for 4 requests that each grow to 30+ tokens: some must be preempted.
    prompts = [token_prompt(40 + i, 14 + i) for i in range(4)]
    params = SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True)
    with LLM(block_size=8, num_blocks=10) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0, stats
        for out, prompt in zip(outs, prompts):
            assert out.outputs[0].token_ids == reference(llm, prompt, 18)
        assert stats["num_free_blocks"] == 10
        llm.engine.check_integrity()


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=1234)
    a = llm.generate("Once upon", params)[0].outputs[0].token_ids
    b = llm.generate("Once upon", params)[0].outputs[0].token_ids
    assert a == b and len(a) == 8


def test_stop_tokens_and_eos(llm):
    prompt = token_prompt(50, 20)
    expected = reference(llm, prompt)
    stop = expected[3]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop]))
    cut = expected.index(stop) + 1
    assert out[0].outputs[0].token_ids == expected[:cut] and out[0].outputs[0].finish_reason == "stop"


def test_bad_prompts_raise_named_errors(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(InvalidRequestError, match="at most"):
        llm.generate({"prompt_token_ids": [1] * 5000})
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate([{"tokens": [1]}])
    assert not llm.engine.has_unfinished_requests()


def test_shutdown_is_idempotent_and_final():
    llm = LLM(num_blocks=8)
    llm.shutdown()
    llm.shutdown()
    with pytest.raises(EngineShutdownError, match="shut down"):
        llm.generate("x")


def test_kv_transfer_config_dict_is_accepted():
    with pytest.raises(ConfigError, match="unknown connector"):
        LLM(num_blocks=8, kv_transfer_config={"connector": "NoSuchConnector"})
