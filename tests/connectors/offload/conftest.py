from __future__ import annotations

import pytest
from offload_helpers import GREEDY, make_prompts, token_ids

from kvbridge import LLM


@pytest.fixture(scope="session")
def reference_outputs():
    """Greedy outputs of an engine without offload and with room for everything, per prompt set."""
    cache: dict[tuple, list[list[int]]] = {}

    def get(seed: int, num: int, length: int) -> list[list[int]]:
        key = (seed, num, length)
        if key not in cache:
            with LLM(num_blocks=256) as llm:
                cache[key] = token_ids(llm.generate(make_prompts(seed, num, length), GREEDY))
        return cache[key]

    return get
