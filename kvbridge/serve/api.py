"""The node's HTTP API: an aiohttp application around one AsyncEngine.

Routes (see docs/serving.md):
    POST /v1/completions               OpenAI-compatible completions, `stream: true` for SSE
    POST /v1/chat/completions          OpenAI-compatible chat, the model's chat template (serve/chat.py)
    GET  /v1/models                    the one served model
    POST /tokenize                     vLLM's: the token ids of a prompt or of chat messages (for routers)
    GET  /health                       200 once the engine is built, 503 before or after a failure
    GET  /metrics                      Prometheus text format
    GET  /v1/kvbridge/state            admin: engine stats, check_integrity() result, in-flight counts
    POST /v1/kvbridge/reset_prefix_cache   admin: drop the local prefix cache
The admin endpoints (serve/admin.py) can require a bearer token.

`create_app` is called by serve/server.py (the CLI) and by tests with an engine of their own.
Run the app with `handler_cancellation=True` so a client that hangs up aborts its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from contextlib import AsyncExitStack, aclosing
from typing import Any, NamedTuple

from aiohttp import web

from kvbridge.errors import InvalidRequestError
from kvbridge.kv_transfer_params import wants_remote_decode
from kvbridge.serve import chat_protocol, protocol
from kvbridge.serve.admin import AdminAPI, AdminAuth
from kvbridge.engine.sampling_params import MAX_SEED, SamplingParams
from kvbridge.serve.answers import CHAT, COMPLETIONS, AnswerWriter, ChoiceRun, RequestRun, Wire
from kvbridge.serve.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from kvbridge.serve.http_errors import error_response, openai_errors
from kvbridge.serve.lease_quota import LeaseQuota
from kvbridge.serve.chat import ChatTemplate, ChatTemplateError, load_chat_template
from kvbridge.serve.metrics import CONTENT_TYPE, ServerMetrics
from kvbridge.serve.stop_strings import ChoiceText

logger = logging.getLogger(__name__)


class _Job(NamedTuple):
    """A validated request, ready for the engine."""

    fields: protocol.CommonFields
    prompts: list[list[int]]  # token ids of each prompt; each gets `fields.n` choices


def _choice_params(params: SamplingParams, sample: int) -> SamplingParams:
    """The sampling of a prompt's choice `sample` (0 to n - 1): with a seed, each of the n draws from a
    seed of its own (seed + sample), or all n would be the same."""
    if params.seed is None or sample == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + sample) % (MAX_SEED + 1))


class CompletionsAPI:
    """Handlers bound to one engine, its served model name and its metrics."""

    def __init__(self, engine: AsyncEngine, model_name: str, role: str, lease_quota: LeaseQuota | None = None) -> None:
        self.engine = engine
        self.lease_quota = lease_quota or LeaseQuota()  # do_remote_decode requests: bounded by default
        self.model_name = model_name
        self.role = role
        self.metrics = ServerMetrics(role, model_name)
        self.answers = AnswerWriter(model_name, self._kvbridge_stats)
        self._chat_template: ChatTemplate | ChatTemplateError | None = None  # loaded on the first chat request

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._completion_job, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._chat_job, CHAT)

    async def _completion_job(self, body: Any) -> _Job:
        req = protocol.parse_completion_request(body)
        tokenizer = self.engine.engine.tokenizer
        try:
            prompts = [p.token_ids or list(tokenizer.encode(p.text)) for p in req.prompts]
        except ValueError as exc:  # UnicodeEncodeError: JSON may carry a lone surrogate ("\ud800")
            raise InvalidRequestError(f"'prompt' cannot be tokenized: {exc}", "prompt") from None
        return _Job(req.fields, prompts)

    async def _chat_job(self, body: Any) -> _Job:
        req = chat_protocol.parse_chat_request(body, default_max_tokens=self.engine.engine.limits.max_model_len)
        template = await self._template()
        try:  # off the event loop: a 16 MiB conversation takes a while to render and tokenize
            prompt_ids = await asyncio.to_thread(
                lambda: template.encode(template.render(req.messages, req.add_generation_prompt))
            )
        except ValueError as exc:  # UnicodeEncodeError: JSON may carry a lone surrogate ("\ud800")
            raise InvalidRequestError(f"'messages' cannot be tokenized: {exc}", "messages") from None
        return _Job(req.fields, [prompt_ids])

    async def _template(self) -> ChatTemplate:
        """The model's chat template, read from its checkpoint once; raises ChatTemplateError if it has none."""
        if self._chat_template is None:
            try:
                checkpoint = self.engine.engine.config.model.model
                self._chat_template = await asyncio.to_thread(load_chat_template, checkpoint)
            except ChatTemplateError as exc:
                self._chat_template = exc
        if isinstance(self._chat_template, ChatTemplateError):
            raise self._chat_template
        return self._chat_template

    async def _parse(self, request: web.Request, make_job, wire: Wire) -> _Job | web.Response:
        try:
            job = await make_job(protocol.decode_body(await request.read()))
        except InvalidRequestError as exc:
            return error_response(400, str(exc), "invalid_request_error", exc.param)
        except web.HTTPRequestEntityTooLarge as exc:
            return error_response(413, f"the request body is too large: {exc.text}", "invalid_request_error")
        model = job.fields.model
        if model is not None and model != self.model_name:
            message = f"model {model!r} is not served here; use {self.model_name!r}"
            return error_response(404, message, "model_not_found")
        if not all(job.prompts):
            return error_response(400, "the prompt encodes to no tokens", "invalid_request_error", wire.prompt_param)
        return job

    async def _serve(self, request: web.Request, make_job, wire: Wire) -> web.StreamResponse:
        if not self.engine.is_ready:
            return error_response(503, "the engine is not ready; poll GET /health", "service_unavailable")
        job = await self._parse(request, make_job, wire)
        if isinstance(job, web.Response):
            self.metrics.observe_rejected()
            return job
        fields = job.fields
        request_id, created = f"{wire.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        num_choices = len(job.prompts) * fields.n
        run_ids = [request_id if num_choices == 1 else f"{request_id}-{index}" for index in range(num_choices)]
        if (refusal := self._admit_leases(request, job, run_ids)) is not None:
            return refusal
        self.metrics.running.inc()
        choices: list[ChoiceRun] = []
        try:
            # Closing the outputs aborts what is still running: the client is gone, a stop string matched.
            async with AsyncExitStack() as stack:
                for index in range(num_choices):
                    prompt_ids, sample = job.prompts[index // fields.n], index % fields.n  # OpenAI's order
                    run_id = run_ids[index]
                    run = RequestRun(run_id, created, time.monotonic())
                    params = _choice_params(fields.sampling_params, sample)
                    outputs = self.engine.generate(run_id, prompt_ids, params, fields.kv_transfer_params)
                    await stack.enter_async_context(aclosing(outputs))
                    text = ChoiceText(fields.stop, params.min_tokens)
                    logprobs = None if params.logprobs is None else wire.logprobs(self.engine.engine.tokenizer.decode)
                    choices.append(ChoiceRun(index, run, text, outputs, counts_prompt=sample == 0, logprobs=logprobs))
                if (refusal := await self._first_outputs(choices, wire)) is not None:
                    return refusal
                self.lease_quota.mark_started(run_ids)
                if fields.stream:
                    return await self.answers.stream(request, request_id, created, choices, wire, fields.include_usage)
                return await self.answers.collect(request_id, created, choices, wire)
        except ConnectionResetError:
            logger.info("the client of %s hung up; request aborted", request_id)
            return web.Response(status=499)
        finally:
            self.lease_quota.forget(run_ids)  # those the engine never started
            self.metrics.running.dec()
            for choice in choices:
                self._observe(choice.run)

    def _admit_leases(self, request: web.Request, job: _Job, run_ids: list[str]) -> web.Response | None:
        """HTTP 429 for a do_remote_decode request the lease quota refuses (serve/lease_quota.py), else None."""
        occupancy = self.engine.occupancy
        layout = getattr(self.engine.engine, "layout", None)
        if not wants_remote_decode(job.fields.kv_transfer_params) or occupancy is None or layout is None:
            return None
        num_blocks = max(len(p) for p in job.prompts) // layout.block_size + 1  # what it holds once finished
        refusal = self.lease_quota.admit(request.remote or "unknown", run_ids, num_blocks, occupancy)
        if refusal is None:
            return None
        self.metrics.pd_refused.labels(scope=refusal.scope).inc()
        self.metrics.observe_rejected("lease_quota")
        response = error_response(429, refusal.message, "rate_limit_error")
        response.headers["Retry-After"] = "1"
        return response

    async def _first_outputs(self, choices: list[ChoiceRun], wire: Wire) -> web.Response | None:
        """Wait for each choice's first output; the error response if the engine refused a choice."""
        firsts = await asyncio.gather(*(anext(c.outputs) for c in choices), return_exceptions=True)
        for choice, first in zip(choices, firsts):
            if not isinstance(first, BaseException):
                choice.run.saw(first)
        for choice, first in zip(choices, firsts):
            match first:
                case ValueError():  # the engine rejected the input
                    choice.run.outcome = "bad_request"
                    param = getattr(first, "param", None)
                    param = wire.prompt_param if param == "prompt" else param  # chat: the messages made it
                    return error_response(400, str(first), "invalid_request_error", param)
                case RequestFailedError():
                    choice.run.outcome = "error"
                    return error_response(500, str(first), "engine_error")
                case EngineDeadError():
                    choice.run.outcome = "error"
                    return error_response(503, str(first), "service_unavailable")
                case BaseException():
                    raise first
        return None

    def _observe(self, run: RequestRun) -> None:
        last = run.last
        if run.outcome not in ("ok", "error") or last is None:
            self.metrics.observe_rejected(run.outcome)
            return
        timings = run.timings()
        if "ttft_s" in timings:
            self.metrics.ttft.observe(timings["ttft_s"])
        self.metrics.e2e.observe(timings["e2e_s"])
        generated = len(last.outputs[0].token_ids) if last.outputs else 0
        self.metrics.observe_finished(
            run.outcome, len(last.prompt_token_ids), generated, last.num_cached_tokens, last.num_external_tokens
        )

    def _kvbridge_stats(self, run: RequestRun) -> dict[str, Any]:
        layout = getattr(self.engine.engine, "layout", None)
        block_size, block_nbytes = (layout.block_size, layout.block_nbytes) if layout is not None else (0, 0)
        return protocol.kvbridge_stats(run.last, run.timings(), block_size, block_nbytes)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `POST /tokenize`: the token ids this node serves a `prompt` (or chat `messages`) with.
        Routers that score nodes by the blocks they cache (vllm-router's kv_aware) hash these ids."""
        if not self.engine.is_ready:
            return error_response(503, "the engine is not ready; poll GET /health", "service_unavailable")
        try:
            body = protocol.decode_body(await request.read())  # to tell the two forms apart; _parse checks it
        except InvalidRequestError as exc:
            return error_response(400, str(exc), "invalid_request_error", exc.param)
        is_chat = isinstance(body, dict) and "messages" in body
        job = await self._parse(request, self._chat_job if is_chat else self._completion_job, CHAT if is_chat else COMPLETIONS)
        if isinstance(job, web.Response):
            return job
        if len(job.prompts) != 1:
            return error_response(400, "/tokenize takes one prompt", "invalid_request_error", "prompt")
        tokens = list(job.prompts[0])
        max_model_len = self.engine.engine.limits.max_model_len
        return web.json_response({"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": None})

    # ------------------------------------------------------------ health, metrics

    async def health(self, request: web.Request) -> web.Response:
        status = {"model": self.model_name, "role": self.role, "running": self.engine.num_running}
        if self.engine.is_ready:
            return web.json_response({"status": "ok", **status})
        if self.engine.error is not None:
            return web.json_response({"status": "failed", "error": str(self.engine.error), **status}, status=503)
        return web.json_response({"status": "starting", **status}, status=503)

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "owned_by": "kvbridge"}
        return web.json_response({"object": "list", "data": [model]})

    async def metrics_text(self, request: web.Request) -> web.Response:
        if self.engine.is_ready:
            try:
                self.metrics.set_engine_stats(await self.engine.call(lambda core: core.get_stats()))
            except EngineDeadError:
                pass  # serve the request counters anyway
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


ROUTES = (
    "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /metrics",
    "GET /v1/kvbridge/state", "POST /v1/kvbridge/reset_prefix_cache", "POST /tokenize",
)  # fmt: skip
API_KEY = web.AppKey("api", CompletionsAPI)


def create_app(
    engine: AsyncEngine, model_name: str, role: str = "both", admin_token: str | None = None,
    lease_quota: LeaseQuota | None = None,
) -> web.Application:  # fmt: skip
    """The node's aiohttp application; `app[API_KEY]` is the CompletionsAPI (tests read its metrics).
    With `admin_token`, the admin endpoints need it as a bearer token (serve/admin.py); `lease_quota`
    bounds do_remote_decode requests (default: LeaseQuota's defaults)."""
    api = CompletionsAPI(engine, model_name, role, lease_quota)
    admin, auth = AdminAPI(engine, role), AdminAuth(admin_token)
    app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[openai_errors(f"this node serves {', '.join(ROUTES)}", catch_handler_errors=True)])
    app[API_KEY] = api
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics_text)
    app.router.add_get("/v1/kvbridge/state", auth.guard(admin.state))
    app.router.add_post("/v1/kvbridge/reset_prefix_cache", auth.guard(admin.reset_prefix_cache))
    return app
