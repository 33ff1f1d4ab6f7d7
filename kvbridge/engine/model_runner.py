"""The model runner: owns the weights and the KV cache tensor, runs one step of the engine.

`EngineCore` builds one `ModelRunner` and calls `execute(scheduler_output)` once per step. The
runner also hosts the worker side of the KV connector (`attach_connector`) and drives it at the
points that `connectors/base.py` lists. `shutdown()` drops every tensor it holds.

Tensor parallelism (`ModelConfig.tensor_parallel_size` N > 1): the runner EngineCore builds is rank 0.
It starts ranks 1..N-1 (tp_workers.py), each a process holding a `ModelRunner` of its own rank, and
broadcasts each step's inputs to them before its forward; every rank computes its heads and MLP
columns and writes its KV heads into its own cache, the row-parallel layers all-reduce, and rank 0
alone computes logits and samples. At TP 1 none of this exists: no extra process, the same code path.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import NamedTuple

import torch

from kvbridge.config import CacheConfig, KVTransferConfig, ModelConfig
from kvbridge.connectors.base import KVConnectorBase, KVConnectorOutput, SchedulerOutput
from kvbridge.engine import sampler
from kvbridge.engine.attention import PagedAttention, RequestBatch, SeqSpan, build_metadata, decode_kernel
from kvbridge.engine.cuda_graphs import DecodeGraphs
from kvbridge.engine.kv_cache import allocate_kv_cache, make_layout
from kvbridge.engine.model import LayerHook, LlamaForCausalLM
from kvbridge.engine.outputs import ModelRunnerOutput, TokenLogprobs
from kvbridge.engine.request import Request
from kvbridge.engine.step_inputs import StepInputs, copy_to_device, to_device
from kvbridge.engine import tp_connector
from kvbridge.engine.tensor_parallel import make_shard
from kvbridge.engine.tp_connector import RankDriver
from kvbridge.engine.tp_group import TPGroup, check_devices, rank_device
from kvbridge.engine.tp_workers import TPWorkers
from kvbridge.engine.weights import load_model, model_args
from kvbridge.errors import ConfigError
from kvbridge.tp_layout import RankKVLayout, rank_kv_layouts

logger = logging.getLogger(__name__)


def paged_forward(
    model: LlamaForCausalLM,
    kv_cache: torch.Tensor,
    block_size: int,
    input_ids: torch.Tensor,
    requests: list[RequestBatch],
    before_layer: LayerHook | None = None,
    after_layer: LayerHook | None = None,
) -> torch.Tensor:
    """Hidden states [T, hidden] of the step's tokens, writing their K/V into the paged cache."""
    args = model.args
    meta = build_metadata(requests, input_ids.shape[0], block_size, args.num_queries_per_kv, kv_cache.dtype, args.head_dim)
    attention = PagedAttention(kv_cache, meta, scale=args.head_dim**-0.5)
    return model(input_ids, meta.positions, attention, before_layer, after_layer)


def paged_logits(
    model: LlamaForCausalLM,
    kv_cache: torch.Tensor,
    block_size: int,
    input_ids: torch.Tensor,
    requests: list[RequestBatch],
) -> torch.Tensor:
    """Logits [T, vocab] (float32) of every token of the step: what a decode graph captures."""
    return model.compute_logits(paged_forward(model, kv_cache, block_size, input_ids, requests))


def _token_ids(request: Request, start: int, end: int) -> list[int]:
    """request.all_token_ids[start:end] without copying the whole sequence (a decode needs one token)."""
    num_prompt = len(request.prompt_token_ids)
    outputs = request.output_token_ids[max(start - num_prompt, 0) : max(end - num_prompt, 0)]
    return request.prompt_token_ids[start:end] + outputs if start < num_prompt else outputs


class StepLogits(NamedTuple):
    req_ids: list[str]  # requests whose step reached request.num_tokens, in scheduled order
    logits: torch.Tensor  # [len(req_ids), vocab] float32


class StepInFlight(NamedTuple):
    """A step's sampling, launched on the device and not waited for (`ModelRunner.finish` reads it)."""

    req_ids: list[str]  # the sampling requests, in scheduled order
    token_ids: torch.Tensor  # [len(req_ids)] int64 on the device: the next step's input
    # On CUDA, host copies in flight, readable once `copied` passed: waiting for a later step is not needed.
    samples: sampler.DeviceSamples
    logprob_rows: list[int]  # rows whose request asked for logprobs
    logprobs: sampler.DeviceLogprobs | None  # of those rows
    copied: torch.cuda.Event | None  # recorded after the copies (CUDA)


class Sampled(NamedTuple):
    """What sampling a step gave, per request id."""

    tokens: dict[str, int]
    errors: dict[str, str]  # why a request's sampling failed
    logprobs: dict[str, TokenLogprobs]  # for the requests that asked


class ModelRunner:
    """Weights, tokenizer and the one KV cache tensor of an engine.

    Attributes others read: `layout` (KVCacheLayout of this rank's cache), `kv_cache` ([*layout.shape]
    tensor), `kv_layouts` (every rank's layout and KV head range), `tokenizer`, `model_id`,
    `max_model_len`, `device`, `model` (LlamaForCausalLM, this rank's shard), `worker_pids`.

    `rank` and `group` are given only to the runners of ranks > 0 (tp_worker_main.py).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        rank: int = 0,
        group: TPGroup | None = None,
        kv_transfer: KVTransferConfig | None = None,  # rank 0 under TP: the workers build their connector halves from it
    ) -> None:
        self.model_config = model_config
        self.rank = rank
        self._group = group
        self.cache_config = cache_config
        self.device = rank_device(model_config.device, rank)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"ModelConfig.device={model_config.device!r} but CUDA is not available; use 'cpu'")
        self._workers: TPWorkers | None = None
        world_size = model_config.tensor_parallel_size
        if world_size > 1 and rank == 0:
            make_shard(model_args(model_config), 0, world_size)  # a bad size is refused before any process starts
            check_devices(model_config.device, world_size)
            self._workers = TPWorkers(model_config, cache_config, kv_transfer)
            group = self._workers.group
            self._group = group
        try:
            self._build(rank, group)
        except BaseException:
            self._stop_workers(kill=True)  # they may wait in a start-up collective this rank never joins
            raise

    def _build(self, rank: int, group: TPGroup | None) -> None:
        model_config, cache_config = self.model_config, self.cache_config
        started = time.monotonic()
        loaded = load_model(model_config, self.device, rank, group.all_reduce if group else None)
        logger.info("weights loaded: %s (%s, %s on %s) in %.1f s", model_config.model, loaded.model_id,
                    model_config.dtype, self.device, time.monotonic() - started)  # fmt: skip
        self.model: LlamaForCausalLM | None = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_id = loaded.model_id
        self.layout = make_layout(loaded.model.args, cache_config, model_config.dtype, self.device)
        if group is not None:  # block ids are shared by every rank: the cache is as large as the smallest fits
            self.layout = self.layout.with_num_blocks(group.min_int(self.layout.num_blocks))
        shard = loaded.shard
        self.num_total_kv_heads = shard.num_kv_heads if shard is not None else self.layout.num_kv_heads  # the model's
        self.kv_layouts: list[RankKVLayout] = (
            [RankKVLayout(0, 1, self.layout, (0, self.layout.num_kv_heads))] if shard is None else
            rank_kv_layouts(shard.world_size, shard.num_heads, shard.num_kv_heads, shard.intermediate_size, self.layout)
        )  # fmt: skip
        self.max_model_len = self._resolve_max_model_len(loaded.max_position)
        self.kv_cache: torch.Tensor | None = allocate_kv_cache(self.layout, self.device)
        loaded.model.attach_rotary(self.max_model_len)
        self._graphs: DecodeGraphs | None = None
        # Under TP every rank runs each step eagerly: a graph would need every rank to replay in lockstep.
        # The graphs serve every context through paged_decode, whose grid depends on the batch alone;
        # without it (no Triton, a head size it cannot tile) decodes run eagerly.
        if (
            self.device.type == "cuda" and not model_config.enforce_eager and group is None
            and decode_kernel(self.layout.block_size, loaded.model.args.head_dim) is not None
        ):  # fmt: skip
            logits_fn = functools.partial(paged_logits, loaded.model, self.kv_cache, self.layout.block_size)
            self._graphs = DecodeGraphs(logits_fn, self.layout.block_size, self.max_model_len, self.device)
        self._generators: dict[str, torch.Generator] = {}  # seeded requests only
        self._connector: KVConnectorBase | None = None
        self._tp_kv: RankDriver | None = None  # rank 0 under TP with a connector: drives the other ranks' halves
        self._is_shut_down = False

    def _resolve_max_model_len(self, model_limit: int) -> int:
        requested = self.model_config.max_model_len
        if requested is not None and requested > model_limit:
            raise ConfigError(f"ModelConfig.max_model_len={requested} exceeds the model's limit of {model_limit}")
        capacity = self.layout.num_blocks * self.layout.block_size
        wanted = requested or model_limit
        if wanted > capacity:
            # A request longer than the whole cache could never finish; cap instead of failing late.
            log = logger.warning if requested is not None else logger.info
            log("max_model_len %d capped to the KV cache capacity of %d tokens", wanted, capacity)
        return min(wanted, capacity)

    # ------------------------------------------------------------------ connector

    def attach_connector(self, connector: KVConnectorBase) -> None:
        """Host the worker side of a connector; registers the KV cache with it. Called once by EngineCore."""
        self._check_alive()
        self._connector = connector
        try:
            connector.register_kv_caches(self.kv_cache, self.layout)
            if self._group is not None:  # every rank registered its own heads' cache: rank 0 learns theirs
                tp_connector.join(self._group, connector)
        except BaseException:
            # the other ranks may wait in `join` for this one, which will never come: no SHUTDOWN can reach them
            self._stop_workers(kill=True)
            raise
        if self._group is not None and self.rank == 0:
            self._tp_kv = RankDriver(self._group, connector)

    @property
    def kv_head_start(self) -> int:
        """The first of the model's KV heads this rank's cache holds (0 at TP 1)."""
        return self.kv_layouts[self.rank].kv_head_range[0]

    # ------------------------------------------------------------------ one step

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Load (connector), forward every scheduled request, save (connector), sample, report.

        Called by EngineCore once per step, also when nothing is scheduled (the connector is still
        polled for finished transfers then).
        """
        self._forget_finished(scheduler_output)
        connector = self._connector
        sampled = Sampled({}, {}, {})
        kv_output = KVConnectorOutput()
        try:
            if connector is not None:
                if self._tp_kv is not None:  # the other ranks' halves start this step's loads too
                    self._tp_kv.begin(scheduler_output.kv_connector_metadata, scheduler_output.finished_req_ids)
                if scheduler_output.kv_connector_metadata is not None:
                    connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
                connector.start_load_kv()
            if scheduler_output.scheduled:
                hooks = (connector.wait_for_layer_load, connector.save_kv_layer) if connector else (None, None)
                step = self.forward(scheduler_output, *hooks)
                sampled = self._to_host(self._sample(scheduler_output, step))
            if connector is not None:
                connector.wait_for_save()
                others = self._tp_kv.collect() if self._tp_kv is not None else []
                sending, recving = connector.get_finished(scheduler_output.finished_req_ids)
                kv_output = KVConnectorOutput(
                    finished_sending=set(sending),
                    finished_recving=set(recving),
                    invalid_block_ids=set(connector.get_block_ids_with_load_errors()),
                    load_errors=dict(connector.get_load_errors()),
                    stats=dict(connector.get_step_stats()),
                    landed_recving=set(connector.get_landed_recving()),
                )
                if self._tp_kv is not None:  # the node's answer: every rank's (no landed reads: see merge)
                    kv_output = self._tp_kv.merge(kv_output, others)
        finally:
            if connector is not None:
                connector.clear_connector_metadata()
        return ModelRunnerOutput(sampled.tokens, kv_output, sampled.errors, sampled.logprobs)

    @property
    def can_launch(self) -> bool:
        """`launch` may run steps: no connector (its hooks and reports frame every step) and TP 1
        (the other ranks take each step's token ids from the host)."""
        return self._connector is None and self._workers is None

    def launch(self, scheduler_output: SchedulerOutput, previous: StepInFlight | None = None) -> StepInFlight:
        """Forward and sample a step without waiting for the device (`can_launch` only); `finish`
        reads its result. With `previous`, a step still in flight, every scheduled request decodes
        the token `previous` sampled for it, read on the device (the scheduler's `schedule_after`).
        Called by EngineCore."""
        self._forget_finished(scheduler_output)
        if not self.can_launch:
            raise RuntimeError("ModelRunner.launch needs TP 1 and no connector; use execute")
        input_ids = None
        if previous is not None:
            input_ids = self._tokens_in_flight(scheduler_output, previous)
        return self._sample(scheduler_output, self.forward(scheduler_output, input_ids=input_ids))

    def _tokens_in_flight(self, scheduler_output: SchedulerOutput, previous: StepInFlight) -> torch.Tensor:
        """[num_scheduled] on the device: the token `previous` sampled for each scheduled request."""
        rows = {req_id: row for row, req_id in enumerate(previous.req_ids)}
        try:
            index = [rows[s.request.request_id] for s in scheduler_output.scheduled]
        except KeyError as missing:
            raise ValueError(f"request {missing} decodes a token that the step in flight does not sample") from None
        if index == list(range(len(previous.req_ids))):
            return previous.token_ids
        return previous.token_ids[copy_to_device([index], self.device)[0]]

    def finish(self, step: StepInFlight) -> ModelRunnerOutput:
        """Wait for a launched step's tokens and report them."""
        sampled = self._to_host(step)
        return ModelRunnerOutput(sampled.tokens, KVConnectorOutput(), sampled.errors, sampled.logprobs)

    def synchronize(self) -> None:
        """Wait until the device has run every step launched so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forget_finished(self, scheduler_output: SchedulerOutput) -> None:
        self._check_alive()
        # Finished since the last step: their state goes first (a request id may be reused).
        for req_id in scheduler_output.finished_req_ids:
            self._generators.pop(req_id, None)

    def forward(
        self,
        scheduler_output: SchedulerOutput,
        before_layer: LayerHook | None = None,
        after_layer: LayerHook | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> StepLogits:
        """Write the scheduled tokens' KV into their blocks and return the logits of sampling requests.

        `input_ids` ([num_scheduled] on the device): the token each request decodes, not yet among
        its tokens (asynchronous scheduling); otherwise the tokens come from the requests.
        `execute` uses it; tests call it to compare logits. Does not touch the connector or sample.
        """
        self._check_alive()
        inputs = self._prepare(scheduler_output, num_in_flight=0 if input_ids is None else 1)
        with torch.inference_mode():
            bucket = self._graphs.bucket_for(inputs) if self._graphs is not None else None
            if bucket is None:
                logits = self._forward_eager(inputs, before_layer, after_layer, input_ids)
            else:
                # A graph cannot call Python between layers: each layer's hook runs before / after all of them.
                self._call_per_layer(before_layer)
                logits = self._graphs.run(inputs, bucket, input_ids)
                self._call_per_layer(after_layer)
        return StepLogits(inputs.sample_req_ids, logits)

    def _call_per_layer(self, hook: LayerHook | None) -> None:
        if hook is not None:
            for layer in range(self.layout.num_layers):
                hook(layer)

    def _forward_eager(
        self,
        inputs: StepInputs,
        before_layer: LayerHook | None,
        after_layer: LayerHook | None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dev = to_device(inputs, self.layout.block_size, self.device)
        if input_ids is not None:
            dev = dev._replace(input_ids=input_ids)
        forward = functools.partial(
            paged_forward, self.model, self.kv_cache, self.layout.block_size, dev.input_ids, dev.requests
        )
        if self._workers is None:
            hidden = forward(before_layer, after_layer)
        else:  # the workers run the same step on their shards
            hidden = self._workers.run_step(inputs, lambda: forward(before_layer, after_layer))
        return self.model.compute_logits(hidden[dev.sample_rows])  # [S, vocab]

    def run_shard_step(self, inputs: StepInputs) -> None:
        """Ranks > 0: rank 0's step on this rank's shard. Writes this rank's KV heads of the step's
        tokens into its cache and joins the step's all-reduces; computes no logits."""
        self._check_alive()
        dev = to_device(inputs, self.layout.block_size, self.device)
        connector = self._connector
        hooks = (connector.wait_for_layer_load, connector.save_kv_layer) if connector else (None, None)
        with torch.inference_mode():
            paged_forward(self.model, self.kv_cache, self.layout.block_size, dev.input_ids, dev.requests, *hooks)

    def _prepare(self, scheduler_output: SchedulerOutput, num_in_flight: int = 0) -> StepInputs:
        """The step's host inputs; each request has `num_in_flight` more tokens than it holds (sampled
        by a step still on the device), whose ids stand as 0 here."""
        token_ids: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        sample_req_ids: list[str] = []
        for sched in scheduler_output.scheduled:
            req, start, num_new = sched.request, sched.start, sched.num_new_tokens
            end, num_tokens = start + num_new, req.num_tokens + num_in_flight
            self._validate(req.request_id, start, num_new, num_tokens, sched.block_ids)
            spans.append(SeqSpan(len(token_ids), start, num_new, tuple(sched.block_ids)))
            known = _token_ids(req, start, end)
            token_ids.extend(known + [0] * (num_new - len(known)))
            if end == num_tokens:
                sample_rows.append(len(token_ids) - 1)
                sample_req_ids.append(req.request_id)
        return StepInputs(token_ids, spans, sample_rows, sample_req_ids)

    def _validate(self, req_id: str, start: int, num_new: int, num_tokens: int, block_ids: list[int]) -> None:
        # The scheduler's contract; a violation is a bug there, named here rather than a CUDA assert.
        end = start + num_new
        if num_new <= 0 or start < 0 or end > num_tokens:
            raise ValueError(f"request {req_id}: tokens [{start}, {end}) outside its {num_tokens} tokens")
        if end > self.max_model_len:
            raise ValueError(f"request {req_id}: {end} tokens exceed max_model_len={self.max_model_len}")
        if len(block_ids) * self.layout.block_size < end:
            raise ValueError(f"request {req_id}: {len(block_ids)} blocks cannot hold {end} tokens")
        if min(block_ids) < 0 or max(block_ids) >= self.layout.num_blocks:
            raise ValueError(f"request {req_id}: block ids {block_ids} outside [0, {self.layout.num_blocks})")

    def _sample(self, scheduler_output: SchedulerOutput, step: StepLogits) -> StepInFlight:
        requests = {s.request.request_id: s.request for s in scheduler_output.scheduled}
        params = [requests[r].sampling_params for r in step.req_ids]
        generators = [self._generator_for(r, p) for r, p in zip(step.req_ids, params)]
        # Penalties and min_tokens read each request's tokens (references: nothing is copied).
        histories = [
            sampler.TokenHistory(requests[r].prompt_token_ids, requests[r].output_token_ids) for r in step.req_ids
        ]
        samples = sampler.sample_on_device(step.logits, params, generators, histories, self.tokenizer.eos_token_ids)
        # Only the rows that asked: a request without `logprobs` costs nothing.
        rows = [i for i, p in enumerate(params) if p.logprobs is not None and i not in samples.errors]
        logprobs = None
        if rows:
            # Indexing with a list would wait for the device (a blocking host -> device copy).
            index = slice(None) if len(rows) == len(params) else copy_to_device([rows], self.device)[0]
            logprobs = sampler.token_logprobs(step.logits[index], samples.token_ids[index], [params[i].logprobs for i in rows])
            logprobs = logprobs.start_host_copy()
        host_samples = samples.start_host_copy()
        copied = None
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.device))
        return StepInFlight(step.req_ids, samples.token_ids, host_samples, rows, logprobs, copied)

    def _to_host(self, step: StepInFlight) -> Sampled:
        if step.copied is not None:
            step.copied.synchronize()  # this step's copies only, not the steps launched after it
        sampled = Sampled({}, {}, {})
        tokens = sampler.to_host(step.samples)
        for req_id, token in zip(step.req_ids, tokens):
            if isinstance(token, Exception):
                sampled.errors[req_id] = f"request {req_id} failed: sampling raised {type(token).__name__}: {token}"
            else:
                sampled.tokens[req_id] = token
        if step.logprobs is not None:
            entries = sampler.logprobs_to_host(step.logprobs, [tokens[i] for i in step.logprob_rows])
            sampled.logprobs.update(
                (step.req_ids[i], entry) for i, entry in zip(step.logprob_rows, entries) if step.req_ids[i] in sampled.tokens
            )
        return sampled

    def _generator_for(self, req_id: str, params) -> torch.Generator | None:
        if params.seed is None or params.is_greedy:
            return None
        if req_id not in self._generators:
            self._generators[req_id] = sampler.make_generator(params.seed, self.device)
        return self._generators[req_id]

    # ------------------------------------------------------------------ lifecycle

    def capture_decode_graphs(self, max_num_seqs: int) -> None:
        """Capture the decode graphs of every batch size up to `max_num_seqs` now (start-up), so that
        no request waits for one; and up to a block of tokens, what a prefix hit computes (its last
        partial block), so that a hit's step replays a graph too. Without graphs (CPU,
        `enforce_eager`, TP), nothing."""
        self._check_alive()
        if self._graphs is not None:
            started = time.monotonic()
            with torch.inference_mode():
                self._graphs.capture(max(max_num_seqs, self.layout.block_size))
            logger.info("%d decode graphs captured in %.1f s", self._graphs.num_graphs, time.monotonic() - started)

    @property
    def num_cuda_graphs(self) -> int:
        """Decode graphs captured so far (0 on CPU and with `ModelConfig.enforce_eager`)."""
        return self._graphs.num_graphs if self._graphs is not None else 0

    @property
    def is_shut_down(self) -> bool:
        return self._is_shut_down

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of tensor-parallel ranks 1..N-1 (empty at TP 1, and after shutdown)."""
        return self._workers.pids if self._workers is not None else []

    def _stop_workers(self, kill: bool = False) -> None:
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.stop(kill)

    def _check_alive(self) -> None:
        if self._is_shut_down:
            raise RuntimeError("ModelRunner was shut down; build a new engine")

    def shutdown(self) -> None:
        """Drop the weights, the KV cache, the rope tables, the generators and the connector reference.

        Called by EngineCore after the connector was flushed and shut down. Idempotent. The
        connector itself is shut down by its owner (EngineCore), not here.
        """
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._stop_workers()  # first: they wait on this rank, and hold nothing it needs
        self._connector = None
        self._tp_kv = None
        self._generators.clear()
        if self._graphs is not None:
            self._graphs.release()  # before the KV cache and weights they were captured on go
        self._graphs = None
        if self.model is not None:
            self.model.release()
        self.model = None
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
