"""One request's answer, written from the engine's outputs: a whole JSON response or an SSE stream.

`CompletionsAPI` (serve/api.py) validates a request and starts one engine request per choice (`n`).
It hands their outputs to an `AnswerWriter` as `ChoiceRun`s (each with its `RequestRun` and its
`ChoiceText`, which cuts stop strings) with the route's `Wire` (the shapes of serve/protocol.py or
serve/chat_protocol.py). The writer drives every choice until it finished or hit a stop string; the
caller then closes the outputs, which aborts an engine request that is still running.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, NamedTuple

from aiohttp import web

from kvbridge.cli_errors import flag_names
from kvbridge.engine.outputs import RequestOutput, TokenLogprobs
from kvbridge.serve import chat_protocol, protocol
from kvbridge.serve.http_errors import error_response
from kvbridge.serve.async_engine import EngineDeadError
from kvbridge.serve.logprobs import ChatLogprobs, CompletionLogprobs, Decode, LogprobsFormatter
from kvbridge.serve.stop_strings import ChoiceText, Delta


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
    response: Callable[..., dict[str, Any]]  # (id, created, model, Choices, last outputs, kvbridge stats)
    chunk: Callable[..., dict[str, Any]]  # (id, created, model, delta Choice, is_first)
    logprobs: Callable[[Decode], LogprobsFormatter]  # the route's shape of a choice's logprobs


COMPLETIONS = Wire(
    "cmpl", "text_completion", "prompt", protocol.completion_response, protocol.completion_chunk, CompletionLogprobs
)
CHAT = Wire(
    "chatcmpl", chat_protocol.CHAT_COMPLETION_CHUNK, "messages", chat_protocol.chat_response, chat_protocol.chat_chunk,
    ChatLogprobs,
)  # fmt: skip


@dataclass
class ChoiceRun:
    """One choice of a request: its engine request, its visible text, the engine's outputs for it."""

    index: int
    run: RequestRun
    text: ChoiceText
    outputs: AsyncIterator[RequestOutput]
    counts_prompt: bool = True  # the first choice of its prompt: usage counts each prompt once
    is_first_chunk: bool = True
    logprobs: LogprobsFormatter | None = None  # set when the request asked for log-probabilities

    async def updates(self) -> AsyncIterator[Delta]:
        """What each engine output adds to the choice, until the request finished or hit a stop string."""
        output = self.run.last
        while True:
            yield self.text.update(output.outputs[0], output.finished)
            if self.text.is_finished:
                return
            output = await anext(self.outputs)
            self.run.saw(output)

    def answer(self) -> protocol.Choice:
        """The whole choice (once it finished)."""
        text = self.text
        return protocol.Choice(self.index, text.text, text.token_ids, text.finish_reason, self._logprobs(text.logprobs))

    def part(self, delta: Delta) -> protocol.Choice:
        """What one chunk adds to the choice."""
        return protocol.Choice(self.index, delta.text, delta.token_ids, delta.finish_reason, self._logprobs(delta.logprobs))

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        return None if self.logprobs is None or entries is None else self.logprobs.format(entries)

    def settle(self) -> str | None:
        """Record the outcome of a finished choice; returns the engine's error, if any."""
        failure = self.run.failure
        self.run.outcome = "error" if failure else "ok"
        return failure


async def interleave(choices: list[ChoiceRun]) -> AsyncIterator[tuple[ChoiceRun, Delta]]:
    """Every choice's deltas as they come, until all finished. Each choice is driven by a task of its
    own; the first that raises (EngineDeadError) ends the iteration, and all are cancelled on exit,
    which leaves no engine output being awaited when the caller closes them."""
    queue: asyncio.Queue[tuple[ChoiceRun, Delta] | asyncio.Task] = asyncio.Queue()

    async def drive(choice: ChoiceRun) -> None:
        async for delta in choice.updates():
            queue.put_nowait((choice, delta))

    tasks = [asyncio.ensure_future(drive(c)) for c in choices]
    for task in tasks:
        task.add_done_callback(queue.put_nowait)
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if isinstance(item, asyncio.Task):
                num_running -= 1
                if not item.cancelled() and item.exception() is not None:
                    raise item.exception()
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(choices: list[ChoiceRun]) -> dict[str, int]:
    num_prompt_tokens = sum(len(c.run.last.prompt_token_ids) for c in choices if c.counts_prompt)
    return protocol.usage(num_prompt_tokens, sum(len(c.text.token_ids) for c in choices))


class AnswerWriter:
    """Writes answers for one served model; `kvbridge_stats(run)` gives a run's `kvbridge` figures
    (with n > 1: those of choice 0's engine request)."""

    def __init__(self, model_name: str, kvbridge_stats: Callable[[RequestRun], dict[str, Any]]) -> None:
        self.model_name = model_name
        self._kvbridge_stats = kvbridge_stats

    async def collect(self, request_id: str, created: int, choices: list[ChoiceRun], wire: Wire) -> web.Response:
        try:
            async with aclosing(interleave(choices)) as deltas:
                async for _ in deltas:
                    pass
        except EngineDeadError as exc:
            for choice in choices:
                choice.run.outcome = "error"
            return error_response(503, str(exc), "service_unavailable")
        failure = next((f for f in [c.settle() for c in choices] if f is not None), None)
        if failure:
            return error_response(500, flag_names(failure), "engine_error")  # the server was configured by flags
        answers = [c.answer() for c in choices]
        kv_params, stats = choices[0].run.last.kv_transfer_params, self._kvbridge_stats(choices[0].run)
        body = wire.response(request_id, created, self.model_name, answers, _usage(choices), kv_params, stats)
        return web.json_response(body)

    async def stream(
        self, request: web.Request, request_id: str, created: int, choices: list[ChoiceRun], wire: Wire,
        include_usage: bool,
    ) -> web.StreamResponse:  # fmt: skip
        """SSE: one chunk per output that added tokens to a choice. The chunk that finishes the last
        choice carries usage and stats, or with `include_usage` a chunk of its own with no choices
        follows (OpenAI's shape)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        num_unfinished = len(choices)
        try:
            # Closed on any exit (a client gone mid-write too): no task is left reading the outputs.
            async with aclosing(interleave(choices)) as deltas:
                async for choice, delta in deltas:
                    if not delta.token_ids and not delta.is_last:
                        continue
                    chunk = wire.chunk(request_id, created, self.model_name, choice.part(delta), choice.is_first_chunk)
                    choice.is_first_chunk = False
                    if delta.is_last:
                        num_unfinished -= 1
                        if failure := choice.settle():
                            chunk["error"] = protocol.error_body(flag_names(failure), "engine_error", 500)["error"]
                        if not num_unfinished and not include_usage:
                            chunk["usage"] = _usage(choices)
                            self._add_stats(chunk, choices)
                    await response.write(sse(chunk))
            if include_usage:
                chunk = protocol.usage_chunk(request_id, created, self.model_name, wire.chunk_object, _usage(choices))
                await response.write(sse(self._add_stats(chunk, choices)))
        except EngineDeadError as exc:
            for choice in choices:
                choice.run.outcome = "error"
            await response.write(sse(protocol.error_body(str(exc), "service_unavailable", 503)))
        await response.write(sse("[DONE]"))
        await response.write_eof()
        return response

    def _add_stats(self, chunk: dict[str, Any], choices: list[ChoiceRun]) -> dict[str, Any]:
        """What the last chunk carries beside usage: the connector's params, the kvbridge figures."""
        chunk["kv_transfer_params"] = choices[0].run.last.kv_transfer_params
        chunk["kvbridge"] = self._kvbridge_stats(choices[0].run)
        return chunk
