"""EngineCore: one engine. Owns the scheduler, the model runner and both connector halves.

Not thread-safe: one thread calls every method (the `LLM` loop, or the server's engine thread).

    core = EngineCore(EngineConfig(...))
    core.add_request("r1", token_ids, SamplingParams(max_tokens=8))
    backoff = Backoff()                        # kvbridge.transfer.progress
    while core.has_unfinished_requests():
        for out in core.step(): ...            # cumulative RequestOutput per progressed request
        if core.is_idle:                       # nothing computed: waiting on transfers
            core.wait_for_work(backoff.next_s())
        else:
            backoff.reset()
    core.shutdown()
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
import weakref
from typing import NamedTuple

from kvbridge import env
from kvbridge.config import EngineConfig
from kvbridge.connectors.base import ConnectorContext, KVConnectorBase, KVConnectorRole, SchedulerOutput
from kvbridge.connectors.factory import create_connector
from kvbridge.engine.faults import fail_request, fail_step
from kvbridge.engine.kv_events import KVEventStream
from kvbridge.engine.model_runner import ModelRunner, StepInFlight
from kvbridge.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from kvbridge.engine.request import Request, RequestStatus
from kvbridge.engine.request_limits import RequestLimits
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.scheduler import RequestUpdate, Scheduler
from kvbridge.errors import EngineShutdownError, FlushTimeoutError, InvalidRequestError
from kvbridge.transfer.progress import Wakeup, drive_until

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

# Engines still alive at interpreter exit are shut down then. Weak: the registry keeps none alive.
_LIVE_ENGINES: weakref.WeakSet[EngineCore] = weakref.WeakSet()


def _shutdown_live_engines() -> None:
    for engine in list(_LIVE_ENGINES):
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - at exit, keep shutting down the others
            logger.exception("shutting down an engine at exit failed")


atexit.register(_shutdown_live_engines)


class EngineCore:
    """Schedule -> connector metadata -> model runner (load, forward, save, collect) -> update."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._is_shut_down = False
        self.runner = ModelRunner(config.model, config.cache, kv_transfer=config.kv_transfer)
        try:
            self._build(config)
        except BaseException:
            self.runner.shutdown()  # its weights, KV cache and tensor-parallel workers go at once
            raise
        _LIVE_ENGINES.add(self)

    def _build(self, config: EngineConfig) -> None:
        """Everything above the model runner: connectors, scheduler, limits."""
        self.tokenizer = self.runner.tokenizer
        self.model_id = self.runner.model_id
        self.layout = self.runner.layout
        self.hash_namespace = self.model_id
        self.wakeup = Wakeup()  # the connectors ring it; idle waits (wait_for_work) end on it
        self.worker_connector, scheduler_connector = self._build_connectors(config)
        self.scheduler = Scheduler(
            config.scheduler,
            num_blocks=self.layout.num_blocks,
            block_size=self.layout.block_size,
            max_model_len=self.runner.max_model_len,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            eos_token_ids=_eos_ids(self.tokenizer),
            connector=scheduler_connector,
            load_failure_policy=config.kv_transfer.load_failure_policy if config.kv_transfer else "recompute",
        )
        self.scheduler_connector = scheduler_connector
        self.kv_events: KVEventStream | None = None  # vLLM's KV events, when config.kv_events publishes
        if config.kv_events is not None and config.kv_events.is_publishing:
            self.kv_events = KVEventStream(config.kv_events, self.layout.block_size)
            self.scheduler.kv.record_events(self.kv_events.recorder)
        self.runner.capture_decode_graphs(config.scheduler.max_num_seqs)
        chunked = config.scheduler.enable_chunked_prefill
        self.limits = RequestLimits(
            vocab_size=self.runner.model.args.vocab_size,
            max_model_len=self.scheduler.max_model_len,
            max_unchunked_prompt=None if chunked else config.scheduler.max_num_batched_tokens,
        )
        self._pending_outputs: list[RequestOutput] = []  # produced outside step(), returned by the next one
        self._in_flight: StepLaunched | None = None  # asynchronous scheduling: launched, its tokens not read yet
        asked = config.scheduler.async_scheduling
        self.is_async = (asked if asked is not None else self.runner.device.type == "cuda") and self.runner.can_launch
        if asked and not self.is_async:
            logger.warning("async_scheduling is off: it needs TP 1 and no KV connector; every step runs synchronously")
        self.is_idle = False  # the last step computed nothing, and made nothing ready for the next
        self._froze_gc = False
        if not env.disable_gc_freeze():
            # Start-up objects (weights, tables) leave the GC's view: no pauses over them in steps.
            gc.collect()
            gc.freeze()
            self._froze_gc = True

    def _build_connectors(self, config: EngineConfig) -> tuple[KVConnectorBase | None, KVConnectorBase | None]:
        """Both halves; on failure, whatever was built is shut down and the runner released."""
        if config.kv_transfer is None:
            return None, None
        context = ConnectorContext(
            model_id=self.model_id,
            block_size=self.layout.block_size,
            device=str(self.runner.device),
            hash_namespace=self.hash_namespace,
            layout=self.layout,
            wakeup=self.wakeup,
            tp_size=config.model.tensor_parallel_size,
            kv_head_start=self.runner.kv_head_start,
            num_total_kv_heads=self.runner.num_total_kv_heads,
        )
        worker = None
        try:
            worker = create_connector(config.kv_transfer, KVConnectorRole.WORKER, context)
            self.runner.attach_connector(worker)
            scheduler = create_connector(config.kv_transfer, KVConnectorRole.SCHEDULER, context)
        except BaseException:
            if worker is not None:
                worker.shutdown()
            self.runner.shutdown()
            raise
        logger.info("connector %s ready: role %s, engine id %s", config.kv_transfer.connector, config.kv_transfer.role,
                    config.kv_transfer.engine_id)  # fmt: skip
        return worker, scheduler

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> None:
        """Queue a request. Raises InvalidRequestError naming the field this engine cannot serve (see
        RequestLimits: empty or too long prompt, token ids outside the vocabulary, max_tokens) or a live
        duplicate id."""
        self._check_alive()
        if self.scheduler.is_request_id_in_use(request_id):
            raise InvalidRequestError(
                f"request id {request_id!r} is in use (running, or its KV transfer is still in flight); "
                "give each request a unique id"
            )
        self.limits.check(prompt_token_ids, sampling_params)
        self.scheduler.add_request(
            Request(
                request_id,
                prompt_token_ids,
                sampling_params,
                self.layout.block_size,
                kv_transfer_params=kv_transfer_params,
                hash_namespace=self.hash_namespace,
            )
        )

    def abort_request(self, request_id: str) -> None:
        """Finish a request as aborted; its final output comes with the next `step()`. Unknown ids are ignored.

        A step in flight keeps computing a token for it: the device finishes that step before the
        request's blocks are freed, and the token is dropped (its output holds what was returned)."""
        if self._in_flight is not None:
            self.runner.synchronize()
        update = self.scheduler.abort_request(request_id)
        if update is not None:
            self._pending_outputs.append(self._to_output(update))

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One engine step. Returns an output for every request that got a token or finished.

        With asynchronous scheduling a step is launched and left on the device, and the outputs
        returned are those of the step launched by the call before (docs/engine.md).

        A fault while the step works on one request ends that request with the reason (the scheduler
        and the model runner catch their per-request parts); a fault of the step as a whole ends the
        step's requests. Only an engine fault (engine/faults.py) is raised.
        """
        self._check_alive()
        updates = self._step_async() if self.is_async else self._run(self.scheduler.schedule())
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.kv_events is not None:
            self.kv_events.publish()
        return outputs + [self._to_output(u) for u in updates]

    def _run(self, scheduler_output: SchedulerOutput) -> list[RequestUpdate]:
        """Schedule -> connector metadata -> load, forward, save, sample, collect finished -> update."""
        try:
            scheduler_output.kv_connector_metadata = self.scheduler.build_connector_meta(scheduler_output)
            runner_output = self.runner.execute(scheduler_output)
            updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        except Exception as exc:  # noqa: BLE001 - fail_step ends the step's requests, or re-raises an engine fault
            updates = fail_step(self.scheduler, scheduler_output, exc)
        # A load that ended (or landed) in a step that computed nothing makes work for the next step:
        # it runs at once, not after the caller's idle wait.
        self.is_idle = scheduler_output.is_empty and not self.scheduler.has_new_work
        return updates

    def _step_async(self) -> list[RequestUpdate]:
        """Launch the next step, then read the one in flight. When the next step only continues the
        one in flight, it is scheduled and launched first, its tokens taken on the device; otherwise
        the one in flight is read first and the next step scheduled as usual."""
        previous, self._in_flight = self._in_flight, None
        following = self.scheduler.schedule_after(previous.scheduler_output) if previous is not None else None
        if following is not None:
            failed = self._launch(following, previous)
            return self._finish(previous) + failed
        updates = self._finish(previous) if previous is not None else []
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:  # the runner is still called, and admission failures reported
            return updates + self._run(scheduler_output)
        return updates + self._launch(scheduler_output)

    def _launch(self, scheduler_output: SchedulerOutput, previous: StepLaunched | None = None) -> list[RequestUpdate]:
        """Leave the step in flight; the updates of its requests if launching it failed."""
        self.is_idle = False
        try:
            sampling = self.runner.launch(scheduler_output, previous.sampling if previous is not None else None)
        except Exception as exc:  # noqa: BLE001 - as in _run
            return fail_step(self.scheduler, scheduler_output, exc)
        self._in_flight = StepLaunched(scheduler_output, sampling)
        return []

    def _finish(self, launched: StepLaunched) -> list[RequestUpdate]:
        try:
            return self.scheduler.update_from_output(launched.scheduler_output, self.runner.finish(launched.sampling))
        except Exception as exc:  # noqa: BLE001 - as in _run
            return fail_step(self.scheduler, launched.scheduler_output, exc)

    def _settle(self) -> None:
        """Read the step in flight, if any (its outputs come with the next step()): before the prefix
        cache is reset, or the engine shut down, no launched step is left."""
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            self._pending_outputs.extend(self._to_output(u) for u in self._finish(launched))

    def _to_output(self, update: RequestUpdate) -> RequestOutput:
        request = update.request
        token_ids = list(request.output_token_ids)
        try:
            stream = request.text_stream = request.text_stream or self.tokenizer.stream()
            stream.add(token_ids[stream.num_tokens :])
            text = stream.finish(token_ids) if request.is_finished else stream.text
        except Exception as exc:  # noqa: BLE001 - this request's output cannot be read: it alone ends
            text, update = "", fail_request(self.scheduler, update, f"detokenizing raised {type(exc).__name__}: {exc}")
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(0, token_ids, text, FINISH_REASONS.get(request.status), _logprobs(request))],
            finished=request.is_finished,
            kv_transfer_params=update.kv_transfer_params,
            num_cached_tokens=request.num_cached_tokens,
            num_external_tokens=request.num_external_tokens,
            num_failed_load_blocks=request.num_failed_load_blocks,
            kv_load_error=request.kv_load_error,
            kv_external_source=request.kv_external_source,
            error=request.error,
        )

    def has_unfinished_requests(self) -> bool:
        """Requests live, outputs not returned yet, or a step in flight (its outputs are not read yet)."""
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs) or self._in_flight is not None

    def has_pending_transfers(self) -> bool:
        return self.scheduler.has_pending_transfers()

    def wait_for_work(self, timeout_s: float) -> bool:
        """Sleep after a step that computed nothing: until a connector rings (a transfer's answer
        came in on its thread) or `timeout_s` passed. True when rung. Polling stays the caller's
        job, with a backoff: a NIXL read's completion rings nothing."""
        return self.wakeup.wait(timeout_s)

    # ------------------------------------------------------------------ flush, reset, stats

    def _flush(self, timeout_s: float) -> frozenset[str]:
        """Drive every transfer to an end, waiting at most `timeout_s`. Returns the requests still in
        flight at the deadline (empty when all ended).

        Steps that compute nothing hand the scheduler side's pending plan (e.g. saves decided in
        `request_finished`) to the worker and feed what finished back into the scheduler; the
        worker's `flush` waits in between.
        """
        if self.worker_connector is None:
            return frozenset()
        deadline = time.monotonic() + timeout_s
        worker_pending: frozenset[str] = frozenset()
        self._empty_step()

        def advance() -> None:
            nonlocal worker_pending
            worker_pending = self.worker_connector.flush(max(0.0, deadline - time.monotonic())).pending_req_ids
            self._empty_step()  # reports what the worker's flush finished, hands down what comes next

        def has_ended() -> bool:
            return not self.scheduler.has_pending_transfers()

        if has_ended() or drive_until(has_ended, deadline, progress=advance, sleep=self.wakeup.wait):
            return frozenset()
        return worker_pending | self.scheduler.pending_transfer_req_ids()

    def _empty_step(self) -> None:
        empty = self.scheduler.empty_output()
        empty.kv_connector_metadata = self.scheduler.build_connector_meta(empty)
        updates = self.scheduler.update_from_output(empty, self.runner.execute(empty))
        self._pending_outputs.extend(self._to_output(u) for u in updates)

    def reset_prefix_cache(self, timeout_s: float | None = None) -> bool:
        """Forget every cached prefix, after in-flight transfers finished (waits at most `timeout_s`,
        default `kv_transfer.flush_timeout_s`). Returns True; raises FlushTimeoutError naming the
        requests still in flight at the deadline (the cache is then left as it was)."""
        self._check_alive()
        self._settle()
        timeout_s = timeout_s if timeout_s is not None else self.flush_timeout_s
        pending = self._flush(timeout_s)
        if pending:
            raise FlushTimeoutError(
                f"reset_prefix_cache: KV transfers of requests {sorted(pending)} were still in flight after "
                f"{timeout_s} s; retry later, or raise KVTransferConfig.flush_timeout_s",
                pending,
            )
        self.scheduler.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.publish()
        return True

    def try_reset_prefix_cache(self, waiting_on: frozenset[str] | None = None) -> frozenset[str]:
        """`reset_prefix_cache` without waiting, for a caller that must keep the engine serving (the
        HTTP API asks again between steps). One step that computes nothing collects what ended
        (finished transfers, expired leases); then, if none of `waiting_on` (default: every request
        a transfer holds blocks or waits for) is still in flight, the prefix cache is forgotten and
        the empty set returned. Otherwise the cache is left as it was and the requests still in flight
        are returned: pass them as `waiting_on` next time, so that transfers started in between do
        not delay the reset (it forgets only what was cached; blocks in use stay in use)."""
        self._check_alive()
        self._settle()
        if self.worker_connector is not None:
            self._empty_step()
        pending = self.scheduler.pending_transfer_req_ids()
        if waiting_on is not None:
            pending &= waiting_on
        if not pending:
            self.scheduler.reset_prefix_cache()
            if self.kv_events is not None:
                self.kv_events.publish()
        return pending

    @property
    def flush_timeout_s(self) -> float:
        """How long reset_prefix_cache/shutdown wait for transfers: kv_transfer.flush_timeout_s or the env default."""
        return self.config.kv_transfer.flush_timeout_s if self.config.kv_transfer else env.flush_timeout_s()

    def get_stats(self) -> dict:
        """Scheduler and block-pool counters, plus each connector half's own stats."""
        stats = self.scheduler.get_stats()
        if self.kv_events is not None:
            stats["kv_events"] = self.kv_events.get_stats()
        if self.worker_connector is not None:
            stats["connector"] = {
                "scheduler": self.scheduler_connector.get_stats(),
                "worker": self.worker_connector.get_stats(),
            }
        return stats

    def check_integrity(self) -> None:
        """The scheduler's and both connector halves' bookkeeping holds; raises AssertionError."""
        self.scheduler.check_integrity()
        for connector in (self.scheduler_connector, self.worker_connector):
            if connector is not None:
                connector.check_integrity()

    # ------------------------------------------------------------------ shutdown

    @property
    def is_shut_down(self) -> bool:
        return self._is_shut_down

    def _check_alive(self) -> None:
        if self._is_shut_down:
            raise EngineShutdownError("this engine was shut down; build a new one")

    def shutdown(self) -> None:
        """Stop admitting, flush connectors (bounded), shut both connector halves down (the worker
        deregisters the KV tensor before it is freed), drop weights and KV, undo gc.freeze(), give
        cached CUDA memory back. Idempotent; runs at interpreter exit for engines still alive."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        _LIVE_ENGINES.discard(self)
        device = getattr(self.runner, "device", None)
        try:
            self._settle()  # no launched step left computing in the KV cache about to be freed
            self._shutdown_connectors()
        finally:
            if self.kv_events is not None:
                self.kv_events.shutdown()  # what the last steps did goes out first
            self.runner.shutdown()
            self.worker_connector = self.scheduler_connector = None
            self.scheduler.detach_connector()
            self.wakeup.close()  # an AsyncEngine subscribed to it
            self._pending_outputs.clear()
            if self._froze_gc:
                gc.unfreeze()
                self._froze_gc = False
            gc.collect()
            if device is not None and device.type == "cuda":
                import torch

                torch.cuda.empty_cache()

    def _shutdown_connectors(self) -> None:
        if self.worker_connector is None:
            return
        try:
            pending = self._flush(self.flush_timeout_s)
            if pending:
                logger.warning("shutdown: transfers of %s still in flight after the flush deadline", sorted(pending))
        except Exception:  # noqa: BLE001 - a failed flush must not keep memory alive
            logger.exception("shutdown: flushing the connector failed")
        finally:
            for connector in (self.worker_connector, self.scheduler_connector):
                try:
                    connector.shutdown()
                except Exception:  # noqa: BLE001
                    logger.exception("shutdown: %s.shutdown() failed", type(connector).__name__)

    def __repr__(self) -> str:
        return f"EngineCore(model_id={self.model_id!r}, shut_down={self._is_shut_down})"


class StepLaunched(NamedTuple):
    """A step left on the device by asynchronous scheduling."""

    scheduler_output: SchedulerOutput
    sampling: StepInFlight


def _eos_ids(tokenizer) -> tuple[int, ...]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    return tuple(ids)


def _logprobs(request: Request) -> list[TokenLogprobs] | None:
    """The request's logprobs so far, or None when its params did not ask for them."""
    return list(request.output_logprobs) if request.sampling_params.logprobs is not None else None
