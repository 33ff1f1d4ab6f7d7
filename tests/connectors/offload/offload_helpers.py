"""Helpers shared by the offload end-to-end tests."""

from __future__ import annotations

import random

from kvbridge import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def make_prompts(seed: int, num: int, length: int) -> list[dict]:
    print("prompt seed", seed)
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(256) for _ in range(length)]} for _ in range(num)]


def offload_llm(extra: dict | None = None, *, num_blocks: int = 12, max_num_seqs: int = 1, **kwargs) -> LLM:
    """An engine whose GPU-side cache (num_blocks x 16 tokens) is smaller than the test's working set."""
    config = {"connector": "OffloadingConnector", "flush_timeout_s": 20.0,
              "extra": {"host_num_blocks": 64, **(extra or {})}}  # fmt: skip
    return LLM(num_blocks=num_blocks, max_num_seqs=max_num_seqs, kv_transfer_config=config, **kwargs)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def check_integrity(llm: LLM) -> None:
    """Engine invariants, plus both connector halves' tier invariants."""
    llm.engine.check_integrity()
    llm.engine.scheduler_connector.check_integrity()
    llm.engine.worker_connector.check_integrity()


_REFERENCE: dict[tuple, list[list[int]]] = {}


def reference_outputs(seed: int, num: int, length: int) -> list[list[int]]:
    """Greedy outputs of an engine without offload and with room for everything (cached per prompt set)."""
    key = (seed, num, length)
    if key not in _REFERENCE:
        with LLM(num_blocks=256) as llm:
            _REFERENCE[key] = token_ids(llm.generate(make_prompts(seed, num, length), GREEDY))
    return _REFERENCE[key]
