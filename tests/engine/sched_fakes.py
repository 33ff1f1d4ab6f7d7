"""Torch-free stand-ins for the model runner, used by the scheduler tests.

`FakeRunner` keeps a fake KV cache: per block slot, the (token id, position) written there. Each
step it first checks that every token a request claims as computed is really in its blocks (prefix
hits, loads, rollbacks, preemptions all land there or the check fails), then writes the step's
tokens, then "samples" a token that is a pure function of the whole sequence, so outputs do not
depend on batching, chunking, caching or preemption.
"""

from __future__ import annotations

from kvbridge.config import SchedulerConfig
from kvbridge.connectors.base import KVConnectorOutput, SchedulerOutput
from kvbridge.engine.outputs import ModelRunnerOutput
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.scheduler import Scheduler

EOS = 1


def next_token(token_ids: list[int]) -> int:
    return 3 + sum((i + 1) * t for i, t in enumerate(token_ids)) % 97


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.steps: list[SchedulerOutput] = []

    def slot(self, block_ids: list[int], t: int) -> tuple[int, int] | None:
        return self.kv[block_ids[t // self.block_size]][t % self.block_size]

    def write(self, block_ids: list[int], t: int, token: int) -> None:
        self.kv[block_ids[t // self.block_size]][t % self.block_size] = (token, t)

    def execute(self, out: SchedulerOutput, kv_output: KVConnectorOutput | None = None) -> ModelRunnerOutput:
        self.steps.append(out)
        sampled: dict[str, int] = {}
        for s in out.scheduled:
            req, tokens = s.request, s.request.all_token_ids
            end = s.start + s.num_new_tokens
            assert s.num_new_tokens > 0 and end <= req.num_tokens, (req, s.start, s.num_new_tokens)
            assert len(s.block_ids) * self.block_size >= end, (req, s.block_ids)
            for t in range(s.start):
                assert self.slot(s.block_ids, t) == (tokens[t], t), f"{req.request_id}: token {t} not in its blocks"
            for t in range(s.start, end):
                self.write(s.block_ids, t, tokens[t])
            if end == req.num_tokens:
                sampled[req.request_id] = next_token(tokens)
        return ModelRunnerOutput(sampled, kv_output or KVConnectorOutput())


def make_scheduler(num_blocks=32, block_size=4, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64,
                   connector=None, policy="recompute", chunked=True, prefix_caching=True) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             enable_chunked_prefill=chunked)
    return Scheduler(config, num_blocks, block_size, max_model_len, enable_prefix_caching=prefix_caching,
                     eos_token_ids=(EOS,), connector=connector, load_failure_policy=policy)


def make_request(request_id: str, prompt: list[int], block_size: int = 4, **params) -> Request:
    params.setdefault("max_tokens", 4)
    params.setdefault("temperature", 0.0)
    return Request(request_id, prompt, SamplingParams(**params), block_size)


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(tokens))
        tokens.append(out[-1])
    return out


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 500, kv_outputs=None) -> dict:
    """Step until nothing is left; check integrity every step. Returns {request_id: finished Request}."""
    finished = {}
    for step in range(max_steps):
        if not sched.has_unfinished_requests() and not sched.has_pending_transfers():
            return finished
        out = sched.schedule()
        out.kv_connector_metadata = sched.build_connector_meta(out)
        kv_output = kv_outputs(step, out) if kv_outputs else None
        for update in sched.update_from_output(out, runner.execute(out, kv_output)):
            if update.request.is_finished:
                finished[update.request.request_id] = update.request
        sched.check_integrity()
    raise AssertionError(f"not done after {max_steps} steps: {list(sched.requests.values())}")
