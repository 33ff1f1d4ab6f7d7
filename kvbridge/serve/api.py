"""The node's HTTP API: an aiohttp application around one AsyncEngine.

Routes (see docs/serving.md):
    POST /v1/completions               OpenAI-compatible completions, `stream: true` for SSE
    GET  /v1/models                    the one served model
    GET  /health                       200 once the engine is built, 503 before or after a failure
    GET  /metrics                      Prometheus text format
    GET  /v1/kvbridge/state            admin: engine stats, check_integrity() result, in-flight counts
    POST /v1/kvbridge/reset_prefix_cache   admin: drop the local prefix cache
The admin endpoints (serve/admin.py) can require a bearer token.

`create_app` is called by serve/server.py (the CLI) and by tests with an engine of their own.
Run the app with `handler_cancellation=True` so a client that hangs up aborts its request.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvbridge.engine.outputs import RequestOutput
from kvbridge.errors import InvalidRequestError
from kvbridge.serve import protocol
from kvbridge.serve.admin import AdminAPI, AdminAuth
from kvbridge.serve.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from kvbridge.serve.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger(__name__)


def _error(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    return web.json_response(protocol.error_body(message, err_type, status, param), status=status)


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass
class _Run:
    """One request's progress as the handler sees it."""

    request_id: str
    created: int
    arrival: float
    ttft_at: float | None = None
    last: RequestOutput | None = None
    outcome: str = "aborted"  # until it finishes: cancellation and hang-ups land here

    def saw(self, output: RequestOutput) -> None:
        self.last = output
        if self.ttft_at is None and output.outputs and output.outputs[0].token_ids:
            self.ttft_at = time.monotonic()

    def timings(self) -> dict[str, float]:
        timings = {"e2e_s": time.monotonic() - self.arrival}
        if self.ttft_at is not None:
            timings["ttft_s"] = self.ttft_at - self.arrival
        return timings

    @property
    def failure(self) -> str | None:
        """The engine's error message if the request ended in error, else None."""
        last = self.last
        if last is not None and (last.error or protocol.finish_reason(last) == "error"):
            error = last.error or "engine error"
            return error if self.request_id in error else f"request {self.request_id} failed: {error}"
        return None


class CompletionsAPI:
    """Handlers bound to one engine, its served model name and its metrics."""

    def __init__(self, engine: AsyncEngine, model_name: str, role: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.role = role
        self.metrics = ServerMetrics(role)

    async def _parse(self, request: web.Request) -> tuple[protocol.CompletionRequest, list[int]] | web.Response:
        try:
            req = protocol.parse_completion_request(protocol.decode_body(await request.read()))
        except InvalidRequestError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.param)
        except web.HTTPRequestEntityTooLarge as exc:
            return _error(413, f"the request body is too large: {exc.text}", "invalid_request_error")
        if req.model is not None and req.model != self.model_name:
            return _error(404, f"model {req.model!r} is not served here; use {self.model_name!r}", "model_not_found")
        try:
            prompt_ids = req.prompt_token_ids or list(self.engine.engine.tokenizer.encode(req.prompt_text))
        except ValueError as exc:  # UnicodeEncodeError: JSON may carry a lone surrogate ("\ud800")
            return _error(400, f"'prompt' cannot be tokenized: {exc}", "invalid_request_error", "prompt")
        if not prompt_ids:
            return _error(400, "the prompt encodes to no tokens", "invalid_request_error", "prompt")
        return req, prompt_ids

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if not self.engine.is_ready:
            return _error(503, "the engine is not ready; poll GET /health", "service_unavailable")
        parsed = await self._parse(request)
        if isinstance(parsed, web.Response):
            self.metrics.observe_rejected()
            return parsed
        req, prompt_ids = parsed
        run = _Run(f"cmpl-{uuid.uuid4().hex}", int(time.time()), time.monotonic())
        self.metrics.running.inc()
        try:
            outputs = self.engine.generate(run.request_id, prompt_ids, req.sampling_params, req.kv_transfer_params)
            async with aclosing(outputs):
                try:
                    run.saw(await anext(outputs))
                except ValueError as exc:  # the engine rejected the input
                    run.outcome = "bad_request"
                    return _error(400, str(exc), "invalid_request_error", getattr(exc, "param", None))
                except RequestFailedError as exc:
                    run.outcome = "error"
                    return _error(500, str(exc), "engine_error")
                except EngineDeadError as exc:
                    run.outcome = "error"
                    return _error(503, str(exc), "service_unavailable")
                if req.stream:
                    return await self._stream(request, outputs, run)
                return await self._collect(outputs, run)
        except ConnectionResetError:
            logger.info("the client of %s hung up; request aborted", run.request_id)
            return web.Response(status=499)
        finally:
            self.metrics.running.dec()
            self._observe(run)

    def _observe(self, run: _Run) -> None:
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

    async def _collect(self, outputs, run: _Run) -> web.Response:
        try:
            async for output in outputs:
                run.saw(output)
        except EngineDeadError as exc:
            run.outcome = "error"
            return _error(503, str(exc), "service_unavailable")
        failure = run.failure
        run.outcome = "error" if failure else "ok"
        if failure:
            return _error(500, failure, "engine_error")
        extra = self._kvbridge_stats(run)
        return web.json_response(protocol.completion_response(run.request_id, run.created, self.model_name, run.last, extra))

    async def _stream(self, request: web.Request, outputs, run: _Run) -> web.StreamResponse:
        """SSE: one chunk per output that added tokens; the last one carries usage and stats."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent_tokens, sent_text = 0, ""
        output = run.last
        try:
            while True:
                completion = output.outputs[0] if output.outputs else None
                if completion is not None and (len(completion.token_ids) > sent_tokens or output.finished):
                    full_text = protocol.stable_text(completion.text, output.finished)
                    text = full_text[len(sent_text):] if full_text.startswith(sent_text) else ""
                    chunk = protocol.completion_chunk(
                        run.request_id, run.created, self.model_name, text,
                        list(completion.token_ids[sent_tokens:]), completion.finish_reason,
                    )  # fmt: skip
                    if output.finished:
                        self._finish_chunk(chunk, run)
                    await response.write(_sse(chunk))
                    sent_tokens = len(completion.token_ids)
                    sent_text = full_text if full_text.startswith(sent_text) else sent_text
                if output.finished:
                    break
                output = await anext(outputs)
                run.saw(output)
        except EngineDeadError as exc:
            run.outcome = "error"
            await response.write(_sse(protocol.error_body(str(exc), "service_unavailable", 503)))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response

    def _finish_chunk(self, chunk: dict[str, Any], run: _Run) -> None:
        failure = run.failure
        run.outcome = "error" if failure else "ok"
        if failure:
            chunk["error"] = protocol.error_body(failure, "engine_error", 500)["error"]
        chunk["usage"] = protocol.usage(run.last)
        chunk["kv_transfer_params"] = run.last.kv_transfer_params
        chunk["kvbridge"] = self._kvbridge_stats(run)

    def _kvbridge_stats(self, run: _Run) -> dict[str, Any]:
        layout = getattr(self.engine.engine, "layout", None)
        block_size, block_nbytes = (layout.block_size, layout.block_nbytes) if layout is not None else (0, 0)
        return protocol.kvbridge_stats(run.last, run.timings(), block_size, block_nbytes)

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


API_KEY = web.AppKey("api", CompletionsAPI)


def create_app(
    engine: AsyncEngine, model_name: str, role: str = "both", admin_token: str | None = None
) -> web.Application:
    """The node's aiohttp application; `app[API_KEY]` is the CompletionsAPI (tests read its metrics).
    With `admin_token`, the admin endpoints need it as a bearer token (serve/admin.py)."""
    api = CompletionsAPI(engine, model_name, role)
    admin, auth = AdminAPI(engine, role), AdminAuth(admin_token)
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app[API_KEY] = api
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics_text)
    app.router.add_get("/v1/kvbridge/state", auth.guard(admin.state))
    app.router.add_post("/v1/kvbridge/reset_prefix_cache", auth.guard(admin.reset_prefix_cache))
    return app
