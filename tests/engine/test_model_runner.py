"""The paged ModelRunner equals a dense, cache-free forward of the same weights, token for token.

SchedulerOutputs are built by hand here (the scheduler is tested elsewhere), with block ids
drawn from a shuffled pool so that no request's blocks are contiguous or in order.
"""

from __future__ import annotations

import random

import pytest
import torch
from dense_reference import dense_greedy, dense_logits

from kvbridge.config import CacheConfig, ModelConfig
from kvbridge.connectors.base import ScheduledRequest, SchedulerOutput
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
NUM_BLOCKS = 96


class BlockPool:
    """Hands out block ids from a seeded shuffle: never contiguous, never in order."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, block_ids: list[int], num_tokens: int, block_size: int) -> list[int]:
        while len(block_ids) * block_size < num_tokens:
            block_ids.append(self.free.pop())
        return block_ids


def make_runner(block_size: int = 16, **model_kwargs) -> ModelRunner:
    return ModelRunner(ModelConfig(**model_kwargs), CacheConfig(block_size=block_size, num_blocks=NUM_BLOCKS))


def prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def step(runner: ModelRunner, items: list[tuple[Request, int, int, list[int]]], finished=()) -> dict[str, int]:
    out = SchedulerOutput([ScheduledRequest(r, s, n, list(b)) for r, s, n, b in items], finished_req_ids=set(finished))
    return runner.execute(out).sampled_token_ids


def run_to_completion(runner: ModelRunner, pool: BlockPool, reqs: list[Request], num_tokens: int, blocks: dict) -> None:
    """Decode every request in one batch until each has `num_tokens` outputs."""
    bs = runner.layout.block_size
    while any(r.num_output_tokens < num_tokens for r in reqs):
        live = [r for r in reqs if r.num_output_tokens < num_tokens]
        items = []
        for r in live:
            start = r.num_tokens - 1
            items.append((r, start, 1, pool.grow(blocks[r.request_id], r.num_tokens, bs)))
        sampled = step(runner, items)
        for r in live:
            r.append_output_token(sampled[r.request_id])


@pytest.fixture(scope="module")
def runner16() -> ModelRunner:
    runner = make_runner(16)
    yield runner
    runner.shutdown()


@pytest.mark.parametrize("block_size", [4, 16])
def test_single_request_matches_dense(block_size):
    seed = 11
    print("seed", seed)
    runner = make_runner(block_size)
    pool = BlockPool(NUM_BLOCKS, seed)
    req = Request("a", prompt(seed, 21), GREEDY, block_size)
    blocks = pool.grow([], req.num_tokens, block_size)
    req.append_output_token(step(runner, [(req, 0, req.num_tokens, blocks)])["a"])
    run_to_completion(runner, pool, [req], 12, {"a": blocks})
    assert req.output_token_ids == dense_greedy(runner.model, req.prompt_token_ids, 12)
    assert len(set(req.output_token_ids)) > 3, "random weights should not collapse to one token"
    runner.shutdown()


def test_logits_match_dense_each_step(runner16):
    seed = 5
    print("seed", seed)
    pool = BlockPool(NUM_BLOCKS, seed)
    req = Request("logits", prompt(seed, 19), GREEDY, 16)
    blocks = pool.grow([], req.num_tokens, 16)
    start, num_new = 0, req.num_tokens
    for _ in range(8):
        out = runner16.forward(SchedulerOutput([ScheduledRequest(req, start, num_new, list(blocks))]))
        assert out.req_ids == ["logits"]
        expected = dense_logits(runner16.model, req.all_token_ids)[-1]
        torch.testing.assert_close(out.logits[0], expected, atol=1e-4, rtol=1e-4)
        start += num_new
        req.append_output_token(int(out.logits[0].argmax()))
        num_new = 1
        pool.grow(blocks, req.num_tokens, 16)


def test_batch_of_different_lengths_and_a_late_joiner(runner16):
    seed = 7
    print("seed", seed)
    pool = BlockPool(NUM_BLOCKS, seed)
    reqs = [Request(f"r{i}", prompt(seed + i, n), GREEDY, 16) for i, n in enumerate((5, 17, 33))]
    blocks = {r.request_id: pool.grow([], r.num_tokens, 16) for r in reqs}
    first = reqs[:2]
    sampled = step(runner16, [(r, 0, r.num_tokens, blocks[r.request_id]) for r in first])
    for r in first:
        r.append_output_token(sampled[r.request_id])
    run_to_completion(runner16, pool, first, 3, blocks)
    # A mixed step: two decodes and one full prefill in the same batch.
    late = reqs[2]
    items = [(r, r.num_tokens - 1, 1, pool.grow(blocks[r.request_id], r.num_tokens, 16)) for r in first]
    sampled = step(runner16, [*items, (late, 0, late.num_tokens, blocks[late.request_id])])
    for r in reqs:
        r.append_output_token(sampled[r.request_id])
    run_to_completion(runner16, pool, reqs, 10, blocks)
    for r in reqs:
        assert r.output_token_ids == dense_greedy(runner16.model, r.prompt_token_ids, 10), r.request_id


@pytest.mark.parametrize("chunks", [(7, 16, 17), (16, 16, 8), (1, 39)])
def test_chunked_prefill_matches_dense(runner16, chunks):
    seed = 3
    print("seed", seed)
    pool = BlockPool(NUM_BLOCKS, seed)
    req = Request("chunked", prompt(seed, sum(chunks)), GREEDY, 16)
    blocks: list[int] = []
    start = 0
    for i, n in enumerate(chunks):
        sampled = step(runner16, [(req, start, n, pool.grow(blocks, start + n, 16))])
        is_last = i == len(chunks) - 1
        assert ("chunked" in sampled) == is_last, "only the chunk that reaches the end samples"
        start += n
    req.append_output_token(sampled["chunked"])
    run_to_completion(runner16, pool, [req], 8, {"chunked": blocks})
    assert req.output_token_ids == dense_greedy(runner16.model, req.prompt_token_ids, 8)


def test_chunked_prefill_next_to_decodes(runner16):
    seed = 9
    print("seed", seed)
    pool = BlockPool(NUM_BLOCKS, seed)
    dec = Request("dec", prompt(seed, 12), GREEDY, 16)
    big = Request("big", prompt(seed + 1, 45), GREEDY, 16)
    blocks = {"dec": pool.grow([], 12, 16), "big": []}
    dec.append_output_token(step(runner16, [(dec, 0, 12, blocks["dec"])])["dec"])
    for start, n in ((0, 20), (20, 20), (40, 5)):
        items = [
            (dec, dec.num_tokens - 1, 1, pool.grow(blocks["dec"], dec.num_tokens, 16)),
            (big, start, n, pool.grow(blocks["big"], start + n, 16)),
        ]
        sampled = step(runner16, items)
        dec.append_output_token(sampled["dec"])
    big.append_output_token(sampled["big"])
    run_to_completion(runner16, pool, [dec, big], 6, blocks)
    assert dec.output_token_ids == dense_greedy(runner16.model, dec.prompt_token_ids, 6)
    assert big.output_token_ids == dense_greedy(runner16.model, big.prompt_token_ids, 6)


def test_prefix_hit_reuses_cached_blocks(runner16):
    seed = 13
    print("seed", seed)
    pool = BlockPool(NUM_BLOCKS, seed)
    shared = prompt(seed, 32)  # two full blocks
    first = Request("first", shared + prompt(seed + 1, 9), GREEDY, 16)
    second = Request("second", shared + prompt(seed + 2, 14), GREEDY, 16)
    blocks = {"first": pool.grow([], first.num_tokens, 16)}
    first.append_output_token(step(runner16, [(first, 0, first.num_tokens, blocks["first"])])["first"])
    # The second request's first two blocks are the first request's: only its suffix is computed,
    # while the first request decodes in the same batch (and writes into its own third block).
    blocks["second"] = pool.grow(blocks["first"][:2], second.num_tokens, 16)
    items = [
        (first, first.num_tokens - 1, 1, pool.grow(blocks["first"], first.num_tokens, 16)),
        (second, 32, second.num_tokens - 32, blocks["second"]),
    ]
    sampled = step(runner16, items)
    for r in (first, second):
        r.append_output_token(sampled[r.request_id])
    run_to_completion(runner16, pool, [first, second], 8, blocks)
    assert second.output_token_ids == dense_greedy(runner16.model, second.prompt_token_ids, 8)
    assert first.output_token_ids == dense_greedy(runner16.model, first.prompt_token_ids, 8)


def test_invalid_schedule_is_named(runner16):
    req = Request("bad", prompt(1, 20), GREEDY, 16)
    with pytest.raises(ValueError, match="cannot hold"):
        step(runner16, [(req, 0, 20, [3])])
    with pytest.raises(ValueError, match="outside"):
        step(runner16, [(req, 0, 20, [3, NUM_BLOCKS])])
    with pytest.raises(ValueError, match="outside its"):
        step(runner16, [(req, 10, 20, [3, 4])])


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.25), ("float16", 0.05)])
def test_half_precision_paged_close_to_dense(dtype, tol):
    """Low precision: logits within `tol` of the dense forward in the same dtype (teacher forced),
    greedy tokens equal wherever the dense top two differ by more than `tol`."""
    seed = 17
    print("seed", seed)
    runner = make_runner(16, dtype=dtype)
    assert runner.kv_cache.dtype == getattr(torch, dtype)
    pool = BlockPool(NUM_BLOCKS, seed)
    req = Request("half", prompt(seed, 23), GREEDY, 16)
    blocks = pool.grow([], req.num_tokens, 16)
    start = 0
    for _ in range(8):
        out = runner.forward(SchedulerOutput([ScheduledRequest(req, start, req.num_tokens - start, list(blocks))]))
        dense = dense_logits(runner.model, req.all_token_ids)[-1]
        assert (out.logits[0] - dense).abs().max() < tol
        top2 = dense.topk(2).values
        if top2[0] - top2[1] > tol:
            assert out.logits[0].argmax() == dense.argmax()
        start = req.num_tokens
        req.append_output_token(int(dense.argmax()))
        pool.grow(blocks, req.num_tokens, 16)
    runner.shutdown()
