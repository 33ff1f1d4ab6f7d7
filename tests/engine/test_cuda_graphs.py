"""Decode steps replayed from CUDA graphs equal the eager forward, and graphs give their memory back."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from kvbridge.config import CacheConfig, ModelConfig
from kvbridge.connectors.base import ScheduledRequest, SchedulerOutput
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.model_runner import paged_logits
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.step_inputs import StepInputs, one_token_rows, to_device

GREEDY = SamplingParams(temperature=0.0)
NUM_BLOCKS = 256
# (max |graph - eager| logit difference, top-2 gap below which an argmax may flip): the padded batch
# may pick other GEMM kernels than the eager one, nothing else differs.
TOLERANCE = {"float32": 2e-3, "bfloat16": 0.25}


def make_runner(dtype: str, enforce_eager: bool, block_size: int = 16) -> ModelRunner:
    return ModelRunner(
        ModelConfig(device="cuda", dtype=dtype, enforce_eager=enforce_eager),
        CacheConfig(block_size=block_size, num_blocks=NUM_BLOCKS),
    )


class Traffic:
    """Requests joining (whole or chunked prefills, next to the decodes) and leaving at random; every
    step is one SchedulerOutput that both runners compute. Tokens are the eager runner's argmax."""

    def __init__(self, seed: int, block_size: int) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.running: dict[str, tuple[Request, list[int], int]] = {}  # id -> (request, blocks, tokens to go)
        self.computed: dict[str, int] = {}
        self.next_id = 0

    def join(self) -> None:
        prompt = [self.rng.randrange(256) for _ in range(self.rng.randrange(3, 70))]
        req = Request(f"r{self.next_id}", prompt, GREEDY, self.block_size)
        self.next_id += 1
        self.running[req.request_id] = (req, [], self.rng.randrange(2, 25))
        self.computed[req.request_id] = 0

    def schedule(self) -> SchedulerOutput:
        items = []
        for req_id, (req, blocks, _) in self.running.items():
            start = self.computed[req_id]
            num_new = min(req.num_tokens - start, self.rng.choice((24, 48)))  # prompts may take two chunks
            while len(blocks) * self.block_size < start + num_new:
                blocks.append(self.free.pop())
            items.append(ScheduledRequest(req, start, num_new, list(blocks)))
        return SchedulerOutput(items)

    def update(self, sched: SchedulerOutput, req_ids: list[str], logits: torch.Tensor) -> None:
        for item in sched.scheduled:
            self.computed[item.request.request_id] = item.start + item.num_new_tokens
        for req_id, row in zip(req_ids, logits):
            req, blocks, to_go = self.running[req_id]
            req.append_output_token(int(row.argmax()))
            if to_go == 1:
                del self.running[req_id]
                self.free.extend(blocks)
            else:
                self.running[req_id] = (req, blocks, to_go - 1)


@pytest.mark.gpu
def test_an_engine_captures_every_graph_at_start_up_and_none_while_serving():
    """No request waits for a capture: the graphs depend on the batch size only, not on the contexts."""
    from kvbridge.config import EngineConfig, SchedulerConfig
    from kvbridge.engine.core import EngineCore

    engine = EngineCore(EngineConfig(
        model=ModelConfig(device="cuda"), cache=CacheConfig(num_blocks=NUM_BLOCKS), scheduler=SchedulerConfig(max_num_seqs=8),
    ))  # fmt: skip
    try:
        assert engine.runner.num_cuda_graphs == 5, "batch buckets 1, 2, 4, 8 and 16 (a block of tokens)"
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for batch, prompt_len in ((1, 20), (3, 300), (8, 40), (5, 900)):  # table widths from 2 to 57 blocks
            for i in range(batch):
                engine.add_request(f"b{batch}-{prompt_len}-{i}", [(i + 7) % 200 + 1] * prompt_len, params)
            finished = 0
            while finished < batch:
                finished += sum(o.finished for o in engine.step())
        assert engine.runner.num_cuda_graphs == 5
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_as_requests_join_and_leave(dtype):
    seed = 31
    print("seed", seed)
    graphs, eager = make_runner(dtype, enforce_eager=False), make_runner(dtype, enforce_eager=True)
    traffic = Traffic(seed, graphs.layout.block_size)
    tol = TOLERANCE[dtype]
    decode_batch_sizes = set()
    for step in range(80):
        if step < 50 and (not traffic.running or traffic.rng.random() < 0.3):
            traffic.join()
        if not traffic.running:
            break
        sched = traffic.schedule()
        if all(s.num_new_tokens == 1 for s in sched.scheduled):
            decode_batch_sizes.add(len(sched.scheduled))
        got, want = graphs.forward(sched), eager.forward(sched)
        assert got.req_ids == want.req_ids
        for req_id, g, w in zip(want.req_ids, got.logits, want.logits):
            assert (g - w).abs().max() < tol, f"step {step}, {req_id}: logits differ by {(g - w).abs().max()}"
            top2 = w.topk(2).values
            if top2[0] - top2[1] > tol:
                assert g.argmax() == w.argmax(), f"step {step}, {req_id}: greedy token differs"
        traffic.update(sched, want.req_ids, want.logits)
    print("decode batch sizes", sorted(decode_batch_sizes), "graphs", graphs.num_cuda_graphs)
    assert len(decode_batch_sizes) >= 4 and graphs.num_cuda_graphs >= 3
    assert eager.num_cuda_graphs == 0
    graphs.shutdown()
    eager.shutdown()


@pytest.mark.gpu
def test_graph_hooks_run_around_the_replay():
    runner = make_runner("float32", enforce_eager=False)
    req = Request("r", list(range(40, 60)), GREEDY, 16)
    runner.execute(SchedulerOutput([ScheduledRequest(req, 0, 20, [7, 2])]))
    req.append_output_token(1)
    calls = []
    runner.forward(
        SchedulerOutput([ScheduledRequest(req, 20, 1, [7, 2])]),
        before_layer=lambda i: calls.append(("load", i)),
        after_layer=lambda i: calls.append(("save", i)),
    )
    assert runner.num_cuda_graphs == 1
    num_layers = runner.layout.num_layers
    assert calls == [("load", i) for i in range(num_layers)] + [("save", i) for i in range(num_layers)]
    runner.shutdown()


def decode_a_few_steps(runner: ModelRunner, batch: int) -> None:
    reqs = [Request(f"r{i}", [i + 1] * 20, GREEDY, 16) for i in range(batch)]
    blocks = {r.request_id: [2 * i, 2 * i + 1] for i, r in enumerate(reqs)}
    out = runner.execute(SchedulerOutput([ScheduledRequest(r, 0, 20, blocks[r.request_id]) for r in reqs]))
    for _ in range(3):
        for r in reqs:
            r.append_output_token(out.sampled_token_ids[r.request_id])
        items = [ScheduledRequest(r, r.num_tokens - 1, 1, blocks[r.request_id]) for r in reqs]
        out = runner.execute(SchedulerOutput(items))


@pytest.mark.gpu
def test_shutdown_frees_the_graphs():
    # The first runner creates per-process state (the capture stream's cuBLAS workspace).
    runner = make_runner("bfloat16", enforce_eager=False)
    decode_a_few_steps(runner, batch=5)
    runner.shutdown()
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for _ in range(3):
        runner = make_runner("bfloat16", enforce_eager=False)
        decode_a_few_steps(runner, batch=5)
        assert runner.num_cuda_graphs == 1
        runner.shutdown()
        del runner
        gc.collect()
        assert torch.cuda.memory_allocated() == base_allocated
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == base_reserved


@pytest.mark.gpu
def test_llm_enforce_eager_captures_no_graph_and_answers_the_same():
    from kvbridge import LLM

    prompt = [{"prompt_token_ids": list(range(1, 40))}]
    answers = {}
    for eager in (False, True):
        llm = LLM(device="cuda", enforce_eager=eager)
        try:
            answers[eager] = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].token_ids
            assert (llm.engine.runner.num_cuda_graphs == 0) == eager
        finally:
            llm.shutdown()
    assert answers[True] == answers[False]


def mixed_step(runner: ModelRunner) -> SchedulerOutput:
    """Three requests with their contexts in the cache, then one step of 7 + 1 + 5 tokens: a prefix
    hit's last tokens after 40 cached, a decode after 20, a short prompt from position 0."""
    hit, decode, short = (Request(n, [(7 * i + k) % 250 + 1 for i in range(p)], GREEDY, 16)
                          for k, (n, p) in enumerate((("hit", 47), ("decode", 20), ("short", 5))))  # fmt: skip
    blocks = {"hit": [3, 9, 5], "decode": [12, 1], "short": [20]}
    runner.execute(SchedulerOutput([ScheduledRequest(hit, 0, 40, blocks["hit"]), ScheduledRequest(decode, 0, 20, blocks["decode"])]))
    decode.append_output_token(17)
    return SchedulerOutput([
        ScheduledRequest(hit, 40, 7, blocks["hit"]),
        ScheduledRequest(decode, 20, 1, blocks["decode"]),
        ScheduledRequest(short, 0, 5, blocks["short"]),
    ])  # fmt: skip


def test_a_step_as_one_token_rows_computes_what_the_step_computes():
    """What a graph replay of a few-token step relies on: its tokens as one-token decodes give the same
    logits for every token and write the same K/V (CPU, float32, no graph involved)."""
    runner = ModelRunner(ModelConfig(dtype="float32"), CacheConfig(block_size=16, num_blocks=32))
    inputs = runner._prepare(mixed_step(runner))
    before = runner.kv_cache.clone()
    rows = StepInputs(inputs.token_ids, one_token_rows(inputs.spans), inputs.sample_rows, inputs.sample_req_ids)
    assert [(r.start, r.num_new) for r in rows.spans[:8]] == [(40 + i, 1) for i in range(7)] + [(20, 1)]
    results = []
    for step in (inputs, rows):
        runner.kv_cache.copy_(before)
        dev = to_device(step, 16, runner.device)
        with torch.inference_mode():
            logits = paged_logits(runner.model, runner.kv_cache, 16, dev.input_ids, dev.requests)
        results.append((logits, runner.kv_cache.clone()))
    (want, want_kv), (got, got_kv) = results
    assert len(rows.spans) == want.shape[0] == 13
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)  # later layers: other attention kernels
    runner.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_few_token_step_replays_a_captured_graph_and_equals_eager(dtype):
    graphs, eager = make_runner(dtype, enforce_eager=False), make_runner(dtype, enforce_eager=True)
    graphs.capture_decode_graphs(max_num_seqs=1)  # buckets 1 to 16: a block of tokens
    num_graphs = graphs.num_cuda_graphs
    tol = TOLERANCE[dtype]
    got, want = graphs.forward(mixed_step(graphs)), eager.forward(mixed_step(eager))
    assert graphs.num_cuda_graphs == num_graphs == 5, "the 13-token step used the bucket-16 graph, no new capture"
    assert got.req_ids == want.req_ids == ["hit", "decode", "short"]
    assert (got.logits - want.logits).abs().max() < tol
    graphs.shutdown()
    eager.shutdown()


def hit_step(runner: ModelRunner) -> SchedulerOutput:
    """A prefix hit's last 16 tokens after 100 cached (positions 100 to 115, across a block boundary)."""
    hit = Request("hit16", [(5 * i) % 250 + 1 for i in range(116)], GREEDY, 16)
    blocks = list(range(30, 38))
    runner.execute(SchedulerOutput([ScheduledRequest(hit, 0, 100, blocks)]))
    return SchedulerOutput([ScheduledRequest(hit, 100, 16, blocks)])


def decodes_step(runner: ModelRunner) -> SchedulerOutput:
    """16 requests decoding one token each after prompts of 20 to 35 tokens."""
    reqs = [Request(f"d{i}", [(3 * i + k) % 250 + 1 for k in range(20 + i)], GREEDY, 16) for i in range(16)]
    blocks = {r.request_id: [40 + 3 * i, 41 + 3 * i, 42 + 3 * i] for i, r in enumerate(reqs)}
    runner.execute(SchedulerOutput([ScheduledRequest(r, 0, r.num_tokens, blocks[r.request_id]) for r in reqs]))
    for r in reqs:
        r.append_output_token(11)
    return SchedulerOutput([ScheduledRequest(r, r.num_tokens - 1, 1, blocks[r.request_id]) for r in reqs])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_captured_graph_replays_every_grouping_of_its_rows(dtype):
    """The bucket-16 graph, captured once, replays a run of 16 rows (a hit's last block), runs of 7, 1
    and 5 rows with 3 padding rows (the mixed step), and 16 rows of their own (decodes): each equals eager."""
    graphs, eager = make_runner(dtype, enforce_eager=False), make_runner(dtype, enforce_eager=True)
    graphs.capture_decode_graphs(max_num_seqs=1)  # buckets 1 to 16
    tol = TOLERANCE[dtype]
    for make_step in (hit_step, mixed_step, decodes_step):
        got, want = graphs.forward(make_step(graphs)), eager.forward(make_step(eager))
        assert got.req_ids == want.req_ids
        for req_id, g, w in zip(want.req_ids, got.logits, want.logits):
            assert (g - w).abs().max() < tol, f"{make_step.__name__}, {req_id}: logits differ by {(g - w).abs().max()}"
    assert graphs.num_cuda_graphs == 5, "every step replayed a graph captured at start-up"
    graphs.shutdown()
    eager.shutdown()
