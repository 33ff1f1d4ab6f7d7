"""Seeded sampling in the runner does not depend on batching, and per-request state is dropped."""

from __future__ import annotations

import pytest

from kvbridge.config import CacheConfig, ModelConfig
from kvbridge.connectors.base import ScheduledRequest, SchedulerOutput
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams

SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=1234)
UNSEEDED = SamplingParams(max_tokens=8, temperature=1.5)


@pytest.fixture(scope="module")
def runner():
    runner = ModelRunner(ModelConfig(), CacheConfig(num_blocks=32))
    yield runner
    runner.shutdown()


def generate(runner: ModelRunner, reqs: list[Request], blocks: dict[str, list[int]], num_tokens: int, finished=()):
    """Prefill then decode all `reqs` together for `num_tokens` tokens; the first step reports `finished`."""
    starts = {r.request_id: 0 for r in reqs}
    for i in range(num_tokens):
        items = [ScheduledRequest(r, starts[r.request_id], r.num_tokens - starts[r.request_id], blocks[r.request_id])
                 for r in reqs]  # fmt: skip
        out = runner.execute(SchedulerOutput(items, finished_req_ids=set(finished) if i == 0 else set()))
        for r in reqs:
            starts[r.request_id] = r.num_tokens
            r.append_output_token(out.sampled_token_ids[r.request_id])
    return [r.output_token_ids for r in reqs]


def test_seeded_request_is_independent_of_its_batch(runner):
    prompt = list(range(40, 60))
    alone = generate(runner, [Request("s", prompt, SEEDED, 16)], {"s": [0, 1]}, 8, finished=())[0]
    others = [Request(f"o{i}", list(range(i, i + 9 + i)), UNSEEDED, 16) for i in range(3)]
    blocks = {"s2": [9, 4], "o0": [2, 20], "o1": [3, 21], "o2": [5, 22]}
    batched = generate(runner, [others[0], Request("s2", prompt, SEEDED, 16), *others[1:]], blocks, 8, {"s"})
    assert batched[1] == alone
    assert len(set(alone)) > 1


def test_finished_request_drops_its_generator(runner):
    """A request id reused after `finished_req_ids` named it starts from a fresh generator."""
    prompt = list(range(100, 112))
    first = generate(runner, [Request("again", prompt, SEEDED, 16)], {"again": [7]}, 4)[0]
    continued = generate(runner, [Request("again", prompt, SEEDED, 16)], {"again": [7]}, 4)[0]
    assert continued != first, "without a finish the generator continues where it was"
    fresh = generate(runner, [Request("again", prompt, SEEDED, 16)], {"again": [7]}, 4, finished={"again"})[0]
    assert fresh == first
