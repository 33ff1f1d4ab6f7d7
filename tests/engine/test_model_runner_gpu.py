"""The paged runner on CUDA equals the dense forward (float32 and bfloat16), and frees its memory."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from dense_reference import dense_logits

from kvbridge.config import CacheConfig, ModelConfig
from kvbridge.connectors.base import ScheduledRequest, SchedulerOutput
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0)
# (max |paged - dense| logit difference, top-2 gap below which an argmax may flip)
TOLERANCE = {"float32": 2e-3, "float16": 0.05, "bfloat16": 0.25}


def teacher_forced_run(runner: ModelRunner, seed: int, num_decode_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Chunked prefill of one request next to a short one, then batched decodes. Each step's
    token is the dense argmax (teacher forcing), so one flipped argmax cannot cascade.
    Returns (paged logits, dense logits) for every sampled position."""
    rng = random.Random(seed)
    free = list(range(runner.layout.num_blocks))
    rng.shuffle(free)
    long = Request("long", [rng.randrange(256) for _ in range(37)], GREEDY, runner.layout.block_size)
    short = Request("short", [rng.randrange(256) for _ in range(5)], GREEDY, runner.layout.block_size)
    blocks = {"long": [], "short": []}

    def sched(req: Request, start: int, n: int) -> ScheduledRequest:
        while len(blocks[req.request_id]) * runner.layout.block_size < start + n:
            blocks[req.request_id].append(free.pop())
        return ScheduledRequest(req, start, n, list(blocks[req.request_id]))

    plan = [[sched(long, 0, 20), sched(short, 0, 5)], [sched(long, 20, 17)]]
    pairs = []
    for i in range(2 + num_decode_steps):
        items = plan[i] if i < len(plan) else [sched(r, r.num_tokens - 1, 1) for r in (long, short)]
        if i == 1:
            items.append(sched(short, short.num_tokens - 1, 1))
        step = runner.forward(SchedulerOutput(items))
        for req_id, logits in zip(step.req_ids, step.logits):
            req = long if req_id == "long" else short
            dense = dense_logits(runner.model, req.all_token_ids)[-1]
            pairs.append((logits, dense))
            req.append_output_token(int(dense.argmax()))
    return pairs


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_paged_equals_dense_on_cuda(dtype):
    seed = 21
    print("seed", seed)
    runner = ModelRunner(ModelConfig(device="cuda", dtype=dtype), CacheConfig(block_size=16, num_blocks=64))
    pairs = teacher_forced_run(runner, seed, num_decode_steps=12)
    tol = TOLERANCE[dtype]
    for i, (paged, dense) in enumerate(pairs):
        assert (paged - dense).abs().max() < tol, f"position {i}: logits differ by {(paged - dense).abs().max()}"
        top2 = dense.topk(2).values
        if top2[0] - top2[1] > tol:
            assert paged.argmax() == dense.argmax(), f"position {i}: greedy token differs"
    runner.shutdown()


def test_execute_greedy_equals_dense_float32_cuda():
    runner = ModelRunner(ModelConfig(device="cuda"), CacheConfig(num_blocks=32))
    req = Request("r", list(range(60, 100)), GREEDY, 16)
    blocks = [17, 3, 29, 8]
    start = 0
    for _ in range(10):
        out = runner.execute(SchedulerOutput([ScheduledRequest(req, start, req.num_tokens - start, blocks)]))
        start = req.num_tokens
        req.append_output_token(out.sampled_token_ids["r"])
    tokens = list(req.prompt_token_ids)
    for _ in range(10):
        tokens.append(int(dense_logits(runner.model, tokens)[-1].argmax()))
    assert req.output_token_ids == tokens[len(req.prompt_token_ids):]
    runner.shutdown()


def test_shutdown_returns_cuda_memory_to_baseline():
    gc.collect()
    torch.cuda.empty_cache()
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for _ in range(3):
        runner = ModelRunner(ModelConfig(device="cuda", dtype="bfloat16"), CacheConfig(num_blocks=64))
        req = Request("r", list(range(40)), SamplingParams(temperature=0.8, seed=1), 16)
        runner.execute(SchedulerOutput([ScheduledRequest(req, 0, 40, [5, 9, 1])]))
        assert torch.cuda.memory_allocated() > base_allocated
        runner.shutdown()
        del runner, req
        gc.collect()
        assert torch.cuda.memory_allocated() == base_allocated
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == base_reserved
