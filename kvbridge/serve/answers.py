"""One request's answer, written from the engine's outputs: a whole JSON response or an SSE stream.

`CompletionsAPI` (serve/api.py) validates a request, starts it in the engine, and hands the outputs to an
`AnswerWriter` with the request's `RequestRun`, its `ChoiceText` (stop strings) and the route's `Wire`
(the shapes of serve/protocol.py or serve/chat_protocol.py). The writer drives the outputs until the
request finished or hit a stop string; the caller closes them, which aborts an unfinished request.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from aiohttp import web

from kvbridge.engine.outputs import RequestOutput
from kvbridge.serve import chat_protocol, protocol
from kvbridge.serve.async_engine import EngineDeadError
from kvbridge.serve.stop_strings import ChoiceText, Delta


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    return web.json_response(protocol.error_body(message, err_type, status, param), status=status)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass
class RequestRun:
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


class Wire(NamedTuple):
    """How one route writes its answers (serve/protocol.py, serve/chat_protocol.py)."""

    id_prefix: str
    chunk_object: str
    prompt_param: str  # the field a 400 about the prompt names: `prompt`, or `messages` for chat
    response: Callable[..., dict[str, Any]]  # (id, created, model, Choice, last output, kvbridge stats)
    chunk: Callable[..., dict[str, Any]]  # (id, created, model, delta Choice, is_first)


COMPLETIONS = Wire("cmpl", "text_completion", "prompt", protocol.completion_response, protocol.completion_chunk)
CHAT = Wire(
    "chatcmpl", chat_protocol.CHAT_COMPLETION_CHUNK, "messages", chat_protocol.chat_response, chat_protocol.chat_chunk
)


class AnswerWriter:
    """Writes answers for one served model; `kvbridge_stats(run)` gives a run's `kvbridge` figures."""

    def __init__(self, model_name: str, kvbridge_stats: Callable[[RequestRun], dict[str, Any]]) -> None:
        self.model_name = model_name
        self._kvbridge_stats = kvbridge_stats

    @staticmethod
    async def _updates(outputs, run: RequestRun, choice: ChoiceText) -> AsyncIterator[Delta]:
        """What each engine output adds to the choice, until the request finished or hit a stop string."""
        output = run.last
        while True:
            yield choice.update(output.outputs[0], output.finished)
            if choice.is_finished:
                return
            output = await anext(outputs)
            run.saw(output)

    async def collect(self, outputs, run: RequestRun, choice: ChoiceText, wire: Wire) -> web.Response:
        try:
            async for _ in self._updates(outputs, run, choice):
                pass
        except EngineDeadError as exc:
            run.outcome = "error"
            return error_response(503, str(exc), "service_unavailable")
        failure = run.failure
        run.outcome = "error" if failure else "ok"
        if failure:
            return error_response(500, failure, "engine_error")
        answer = protocol.Choice(choice.text, choice.token_ids, choice.finish_reason)
        body = wire.response(run.request_id, run.created, self.model_name, answer, run.last, self._kvbridge_stats(run))
        return web.json_response(body)

    async def stream(
        self, request: web.Request, outputs, run: RequestRun, choice: ChoiceText, wire: Wire, include_usage: bool
    ) -> web.StreamResponse:
        """SSE: one chunk per output that added tokens. The last one carries usage and stats, or with
        `include_usage` a chunk of its own with no choices follows it (OpenAI's shape)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        is_first = True
        try:
            async for delta in self._updates(outputs, run, choice):
                if not delta.token_ids and not choice.is_finished:
                    continue
                part = protocol.Choice(delta.text, delta.token_ids, choice.finish_reason)
                chunk = wire.chunk(run.request_id, run.created, self.model_name, part, is_first)
                is_first = False
                if choice.is_finished:
                    self._finish_chunk(chunk, run, with_stats=not include_usage)
                await response.write(sse(chunk))
            if include_usage:
                chunk = protocol.usage_chunk(run.request_id, run.created, self.model_name, wire.chunk_object, run.last)
                chunk["kv_transfer_params"] = run.last.kv_transfer_params
                chunk["kvbridge"] = self._kvbridge_stats(run)
                await response.write(sse(chunk))
        except EngineDeadError as exc:
            run.outcome = "error"
            await response.write(sse(protocol.error_body(str(exc), "service_unavailable", 503)))
        await response.write(sse("[DONE]"))
        await response.write_eof()
        return response

    def _finish_chunk(self, chunk: dict[str, Any], run: RequestRun, with_stats: bool) -> None:
        failure = run.failure
        run.outcome = "error" if failure else "ok"
        if failure:
            chunk["error"] = protocol.error_body(failure, "engine_error", 500)["error"]
        if with_stats:
            chunk["usage"] = protocol.usage(run.last)
            chunk["kv_transfer_params"] = run.last.kv_transfer_params
            chunk["kvbridge"] = self._kvbridge_stats(run)
