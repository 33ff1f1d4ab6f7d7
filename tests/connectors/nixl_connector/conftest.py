"""Fixtures shared by the P/D tests of this directory."""

from __future__ import annotations

import pytest
from prefill_node import BLOCK_SIZE

from kvbridge import LLM


@pytest.fixture(scope="module")
def reference() -> LLM:
    """A colocated engine (no connector) whose greedy tokens the P/D decodes must equal."""
    llm = LLM(num_blocks=96, block_size=BLOCK_SIZE)
    yield llm
    llm.shutdown()
