"""vLLM's real `Scheduler` with `KVBridgeConnector` inside, driven without an engine or a worker.

    harness = SchedulerHarness.build(model_dir, role="kv_producer", connector="NixlConnector")
    harness.add_request("r0", prompt, kv_transfer_params={"do_remote_decode": True})
    step = harness.step()                                  # schedule -> fake model run -> update_from_output
    step.scheduler_output.kv_connector_metadata.inner      # what the kvbridge half planned for its worker
    step.finished["r0"].kv_transfer_params                 # what vLLM returns to the client
    harness.step(finished_sending={"r0"})                  # what a worker would report

Everything vLLM's EngineCore does around its scheduler is done here the way EngineCore does it:
the `VllmConfig` (CPU, float32, a KV connector loaded through `kv_connector_module_path`), a
`KVCacheConfig` laid out as vLLM's CPU backend lays it out (one group of full attention, one
`KVCacheTensor`, layers outermost), requests with vLLM's own prefix-cache block hasher and
`kv_transfer_params` in `sampling_params.extra_args`, the workers' handshake metadata handed to
the scheduler's connector, and one `update_from_output` per `schedule`. The model runner is
faked: it samples the token it is told for every request whose scheduled tokens reach the end of
its known tokens, and reports what the test says a worker finished, or what a worker model
(`NixlWorkerModel`, `OffloadWorkerModel`: when kvbridge's worker halves report what) reports for
each step's plan: `harness.step(worker)`.

No NIXL agent, no engine process, no KV tensor: the scheduler half of kvbridge connectors does no I/O.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvbridge.integrations.vllm import KVBridgeConnector
from kvbridge.integrations.vllm.metadata import KVBridgeHandshake, KVBridgeWorkerMeta
from kvbridge.integrations.vllm.scheduler_side import SchedulerSide

BLOCK_SIZE = 16  # tokens per block: small, so short prompts span several blocks
NUM_BLOCKS = 256  # blocks in vLLM's pool (block 0 is vLLM's null block)
MAX_MODEL_LEN = 4096
DEFAULT_TOKEN = 7  # what the fake model runner samples unless told otherwise


def make_vllm_config(
    model_dir: str,
    *,
    role: str,
    connector: str = "NixlConnector",
    options: dict[str, Any] | None = None,
    engine_id: str = "engine-0",
    load_failure_policy: str = "recompute",
    block_size: int = BLOCK_SIZE,
    num_blocks: int = NUM_BLOCKS,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = MAX_MODEL_LEN,
) -> VllmConfig:
    """vLLM's config for `model_dir` on CPU in float32, with `KVBridgeConnector` running kvbridge's `connector`.

    `options` are the kvbridge connector's own (`kv_connector_extra_config` minus "connector").
    `num_blocks` is what vLLM's start-up profiling would have written into `cache_config`.
    """
    model_config = ModelConfig(
        model=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0, skip_tokenizer_init=True,
        enforce_eager=True,
    )  # fmt: skip
    kv_transfer_config = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_connector_module_path="kvbridge.integrations.vllm",
        kv_role=role,
        engine_id=engine_id,
        kv_load_failure_policy=load_failure_policy,
        kv_connector_extra_config={"connector": connector, **(options or {})},
    )
    config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),  # fmt: skip
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def make_kv_cache_config(vllm_config: VllmConfig, num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """One group of full attention over every layer, in one `KVCacheTensor` laid out as vLLM's CPU backend
    lays it out: layers outermost, each layer's blocks contiguous (layer_stride = num_blocks * page)."""
    model = vllm_config.model_config
    num_layers = model.hf_text_config.num_hidden_layers
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model.get_head_size(),
        dtype=torch.float32,
    )
    page = spec.page_size_bytes  # [kv_heads, K|V, block_size, head_dim] float32
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    tensor = KVCacheTensor(
        size=num_layers * num_blocks * page, layers=layer_names, layer_stride=num_blocks * page, block_stride=page
    )
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)]
    )


def worker_handshake(incarnation: str, step_stats: dict[str, Any] | None = None) -> dict[tuple[int, int], Any]:
    """What EngineCore collects from its one worker at start-up, keyed (pp_rank, tp_rank)."""
    return {(0, 0): KVBridgeHandshake(incarnation=incarnation, step_stats=dict(step_stats or {}))}


@dataclass
class Step:
    """One engine step: what the scheduler planned and what it returned to clients."""

    scheduler_output: SchedulerOutput
    outputs: list[EngineCoreOutput]

    @property
    def metadata(self) -> Any:
        """The kvbridge connector's plan for its worker this step (`KVBridgeMetadata.inner`)."""
        meta = self.scheduler_output.kv_connector_metadata
        return meta.inner if meta is not None else None

    @property
    def finished(self) -> dict[str, EngineCoreOutput]:
        return {o.request_id: o for o in self.outputs if o.finish_reason is not None}

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return dict(self.scheduler_output.num_scheduled_tokens)


@dataclass
class SchedulerHarness:
    """A real vLLM `Scheduler` with `KVBridgeConnector` as its KV connector, and a fake model runner."""

    scheduler: Scheduler
    block_size: int
    block_hasher: Callable[[Request], list[Any]]
    steps: list[Step] = field(default_factory=list)
    # What the connector answered vLLM, per request id, in call order (recorded by `_spy`).
    matches: dict[str, list[tuple[int | None, bool]]] = field(default_factory=dict)
    finishes: dict[str, list[tuple[bool, dict[str, Any] | None]]] = field(default_factory=dict)
    _arrivals: Iterator[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self._spy()

    def _spy(self) -> None:
        """Record the connector's answers to vLLM's admission and finish calls (vLLM calls the instance)."""
        connector = self.connector
        match, finish = connector.get_num_new_matched_tokens, connector.request_finished

        def get_num_new_matched_tokens(request: Request, num_computed_tokens: int):
            result = match(request, num_computed_tokens)
            self.matches.setdefault(request.request_id, []).append(tuple(result))
            return result

        def request_finished(request: Request, block_ids: list[int]):
            result = finish(request, block_ids)
            self.finishes.setdefault(request.request_id, []).append(tuple(result))
            return result

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        connector.request_finished = request_finished

    @classmethod
    def build(
        cls,
        model_dir: str,
        *,
        incarnation: str | None = "0123456789abcdef0123456789abcdef",
        step_stats: dict[str, Any] | None = None,
        **config: Any,
    ) -> SchedulerHarness:
        """A scheduler for `make_vllm_config(model_dir, **config)`. Unless `incarnation` is None, the
        connector gets the worker's handshake metadata (that incarnation, `step_stats`) as EngineCore
        hands it over after the workers registered their KV caches."""
        vllm_config = make_vllm_config(model_dir, **config)
        kv_cache_config = make_kv_cache_config(vllm_config, vllm_config.cache_config.num_gpu_blocks)
        block_size = vllm_config.cache_config.block_size
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            hash_block_size=block_size,
        )
        if incarnation is not None:
            scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware(worker_handshake(incarnation, step_stats))
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        return cls(scheduler, block_size, get_request_block_hasher(block_size, hash_fn))

    # ------------------------------------------------------------------ the parts

    @property
    def connector(self) -> KVBridgeConnector:
        return self.scheduler.get_kv_connector()

    @property
    def adapter(self) -> SchedulerSide:
        """The adapter's scheduler half (its bookkeeping is what the tests inspect)."""
        return self.connector.scheduler

    @property
    def inner(self) -> Any:
        """The kvbridge connector's scheduler half (e.g. `NixlScheduler`, `OffloadScheduler`)."""
        return self.adapter.inner.scheduler

    @property
    def num_free_blocks(self) -> int:
        """Blocks in vLLM's free queue (prefix-cached blocks no request holds count as free)."""
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds: all but the free ones and vLLM's null block."""
        return self.scheduler.cache_config.num_gpu_blocks - 1 - self.num_free_blocks

    def block_ids(self, req_id: str) -> list[int]:
        (ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        return list(ids)

    # ------------------------------------------------------------------ requests

    def make_request(
        self, req_id: str, prompt: list[int], *, max_tokens: int = 1, kv_transfer_params: dict[str, Any] | None = None,
        **request_fields: Any,
    ) -> Request:
        """A vLLM request as EngineCore builds one; `kv_transfer_params` travel in sampling_params.extra_args;
        `request_fields` are other `Request` arguments (cache_salt, lora_request, ...)."""
        extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
        return Request(
            request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
            arrival_time=float(next(self._arrivals)), block_hasher=self.block_hasher, **request_fields,
        )  # fmt: skip

    def add_request(self, req_id: str, prompt: list[int], **kwargs: Any) -> Request:
        request = self.make_request(req_id, prompt, **kwargs)
        self.scheduler.add_request(request)
        return request

    def abort(self, *req_ids: str) -> None:
        """What EngineCore does when a client goes away."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ steps

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def run(
        self,
        scheduler_output: SchedulerOutput,
        *,
        sampled: dict[str, int] | None = None,
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
        worker_stats: dict[str, Any] | None = None,
    ) -> Step:
        """The model runner's answer to `scheduler_output`, handed to `update_from_output`."""
        output = fake_model_runner_output(
            scheduler_output, self.scheduler.requests, sampled or {},
            KVConnectorOutput(
                finished_sending=set(finished_sending) or None,
                finished_recving=set(finished_recving) or None,
                invalid_block_ids=set(invalid_block_ids),
                kv_connector_worker_meta=KVBridgeWorkerMeta(dict(worker_stats)) if worker_stats else None,
            ),
        )  # fmt: skip
        outputs = self.scheduler.update_from_output(scheduler_output, output)
        step = Step(scheduler_output, [o for engine in outputs.values() for o in engine.outputs])
        self.steps.append(step)
        return step

    def step(self, worker: WorkerModel | None = None, **report: Any) -> Step:
        """schedule -> fake forward -> update_from_output, as EngineCore.step. The worker's report is
        `report` (as in `run`), or what `worker` reports for this step's plan."""
        scheduler_output = self.schedule()
        if worker is not None:
            report = worker.report(scheduler_output)
        return self.run(scheduler_output, **report)


def fake_model_runner_output(
    scheduler_output: SchedulerOutput,
    requests: dict[str, Request],
    sampled: dict[str, int],
    kv_connector_output: KVConnectorOutput,
) -> ModelRunnerOutput:
    """One sampled token (`sampled[req_id]`, else DEFAULT_TOKEN) for each scheduled request whose
    tokens are all computed after this step; nothing for a prefill chunk that stops short."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    tokens = []
    for req_id in req_ids:
        request = requests[req_id]  # num_computed_tokens already counts this step's tokens
        is_last_chunk = request.num_computed_tokens >= request.num_tokens
        tokens.append([sampled.get(req_id, DEFAULT_TOKEN)] if is_last_chunk else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=tokens,
        kv_connector_output=kv_connector_output,
    )


# ---------------------------------------------------------------------- worker models
#
# Long scenarios need a worker that reports by the rules of kvbridge's real worker halves, at
# random times; these model only *when* a worker reports *what*, and move no bytes.


class WorkerModel:
    """Turns each step's plan into the report a kvbridge worker half would give for that step."""

    def __init__(self, rng: random.Random, max_delay: int = 3) -> None:
        self.rng = rng
        self.max_delay = max_delay
        self.num_steps = 0
        self._due: dict[int, dict[str, set]] = {}  # step -> what is reported then

    def report(self, scheduler_output: SchedulerOutput) -> dict[str, set]:
        step = self.num_steps
        self.num_steps += 1
        meta = scheduler_output.kv_connector_metadata
        self.plan(step, meta.inner if meta is not None else None, set(scheduler_output.finished_req_ids))
        return self.collect(step)

    def plan(self, step: int, metadata: Any, finished_req_ids: set[str]) -> None:
        raise NotImplementedError

    def collect(self, step: int) -> dict[str, set]:
        return self._due.pop(step, {})

    def later(self, step: int, kind: str, *values: Any, delay: int | None = None) -> None:
        """Report `values` under `kind` (a `run` keyword) `delay` steps from `step` (random if None)."""
        at = step + (self.rng.randint(0, self.max_delay) if delay is None else delay)
        self._due.setdefault(at, {}).setdefault(kind, set()).update(values)

    @property
    def is_idle(self) -> bool:
        return not self._due


class NixlWorkerModel(WorkerModel):
    """As NixlConnector's worker half (kvbridge/connectors/nixl/worker.py): a lease granted by a step's
    plan ends (read or expired) in finished_sending; a read ends in finished_recving, in the same step
    when it has no block to read; a read in `failing` also names its blocks in invalid_block_ids."""

    def __init__(self, rng: random.Random, max_delay: int = 3) -> None:
        super().__init__(rng, max_delay)
        self.failing: set[str] = set()

    def plan(self, step: int, metadata: Any, finished_req_ids: set[str]) -> None:
        if metadata is None:
            return
        for req_id in metadata.leases:
            self.later(step, "finished_sending", req_id)
        for req_id, job in metadata.recvs.items():
            delay = self.rng.randint(0, self.max_delay) if job.local_block_ids else 0
            self.later(step, "finished_recving", req_id, delay=delay)
            if req_id in self.failing and job.local_block_ids:
                self.later(step, "invalid_block_ids", *job.local_block_ids, delay=delay)


class OffloadWorkerModel(WorkerModel):
    """As OffloadingConnector's worker half (kvbridge/connectors/offload/worker.py, `get_finished`): a
    load ends in finished_recving unless its request finished before the load ended; a finished
    request that had any job is in finished_sending once none of its copies is in flight; a load in
    `failing` names its blocks in invalid_block_ids when it ends."""

    def __init__(self, rng: random.Random, max_delay: int = 3) -> None:
        super().__init__(rng, max_delay)
        self.failing: set[str] = set()
        self._seen: set[str] = set()  # requests that had a job
        self._finished: set[str] = set()  # finished requests not yet reported
        self._copies_until: dict[str, int] = {}  # req id -> step its last copy ends
        self._loads_until: dict[str, tuple[int, list[int]]] = {}  # req id -> (step the load ends, GPU blocks)

    def plan(self, step: int, metadata: Any, finished_req_ids: set[str]) -> None:
        for job in metadata.stores if metadata is not None else ():
            self._seen.add(job.req_id)
            end = step + self.rng.randint(0, self.max_delay)
            self._copies_until[job.req_id] = max(end, self._copies_until.get(job.req_id, 0))
        for job in metadata.loads if metadata is not None else ():
            self._seen.add(job.req_id)
            end = step + self.rng.randint(0, self.max_delay)
            self._loads_until[job.req_id] = (end, list(job.gpu_block_ids) + list(job.failed_gpu_block_ids))
            self._copies_until[job.req_id] = max(end, self._copies_until.get(job.req_id, 0))
        self._finished |= finished_req_ids & self._seen
        recving_done: set[str] = set()
        for req_id, (end, gpu_blocks) in list(self._loads_until.items()):
            if end <= step:
                del self._loads_until[req_id]
                recving_done.add(req_id)
                if req_id in self.failing:
                    self.later(step, "invalid_block_ids", *gpu_blocks, delay=0)
        recving = recving_done - self._finished
        sending = {r for r in self._finished if self._copies_until.get(r, -1) <= step and r not in self._loads_until}
        self._finished -= sending
        self._seen -= sending
        for req_id in sending:
            self._copies_until.pop(req_id, None)
        if recving:
            self.later(step, "finished_recving", *recving, delay=0)
        if sending:
            self.later(step, "finished_sending", *sending, delay=0)

    @property
    def is_idle(self) -> bool:
        return super().is_idle and not (self._seen or self._finished or self._loads_until)
