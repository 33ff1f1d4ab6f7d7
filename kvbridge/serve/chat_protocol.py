"""The OpenAI-compatible `/v1/chat/completions` wire format: parse a body, build responses.

Pure functions on plain dicts, like serve/protocol.py, whose sampling, stop-string, streaming and
P/D fields a chat body shares. The messages are turned into a prompt by the model's chat
template (serve/chat.py). Beyond OpenAI's fields: `add_generation_prompt` (default true, as in
vLLM), and in the response `choices[0].token_ids`, `kv_transfer_params` and `kvbridge`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbridge.engine.sampling_params import MAX_LOGPROBS
from kvbridge.errors import InvalidRequestError
from kvbridge.serve.protocol import (
    NOT_ASKED,
    UNSUPPORTED_FIELDS,
    Choice,
    CommonFields,
    check_unsupported,
    choice_body,
    envelope,
    get_checked,
    parse_common_fields,
    whole_response,
)

# Chat has no echo, suffix or best_of; it has tools and formats kvbridge cannot honour.
CHAT_UNSUPPORTED_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    **{k: v for k, v in UNSUPPORTED_FIELDS.items() if k not in ("echo", "suffix", "best_of")},
    "tools": ("kvbridge does not call tools", NOT_ASKED),
    "functions": ("kvbridge does not call functions", NOT_ASKED),
    "tool_choice": ("kvbridge does not call tools", (None, "none", "auto")),
    "function_call": ("kvbridge does not call functions", (None, "none", "auto")),
    "response_format": ("kvbridge answers in plain text only", (None, {"type": "text"})),
}
CHAT_COMPLETION_CHUNK = "chat.completion.chunk"


@dataclass(frozen=True)
class ChatRequest:
    """A validated `/v1/chat/completions` body; `messages` are ready for the chat template."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    fields: CommonFields


def _fail(message: str, param: str = "messages") -> InvalidRequestError:
    return InvalidRequestError(message, param)


def _content_text(content: Any, where: str) -> str | None:
    """A message's content as the template sees it: a string; text parts are joined with newlines."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "\n".join(p["text"] for p in content)
    raise _fail(f"{where}.content must be a string, null, or a list of {{'type': 'text', 'text': ...}} parts")


def _parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _fail("'messages' must be a non-empty list of {'role': ..., 'content': ...} objects")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _fail(f"{where} must be an object with a string 'role'")
        messages.append({**message, "content": _content_text(message.get("content"), where)})
    return messages


def parse_chat_request(body: Any, default_max_tokens: int) -> ChatRequest:
    """Validate a decoded JSON body. `default_max_tokens` applies when neither `max_completion_tokens`
    nor `max_tokens` is given (the engine's max_model_len: the answer ends with the context).
    Raises InvalidRequestError (HTTP 400) naming the bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    if "messages" not in body:
        raise _fail("'messages' is required")
    check_unsupported(body, CHAT_UNSUPPORTED_FIELDS)
    messages = _parse_messages(body["messages"])
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise _fail("'add_generation_prompt' must be true or false", "add_generation_prompt")
    # max_completion_tokens replaced max_tokens in OpenAI's chat API; either is accepted.
    max_tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    fields = parse_common_fields(body, max_tokens_field, default_max_tokens, _parse_logprobs(body))
    return ChatRequest(messages, add_generation_prompt, fields)


def _parse_logprobs(body: dict) -> int | None:
    """SamplingParams.logprobs from chat's `logprobs` (a switch) and `top_logprobs` (how many alternatives)."""
    wanted = get_checked(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
    num_top = get_checked(
        body, "top_logprobs", lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LOGPROBS,
        f"an integer in [0, {MAX_LOGPROBS}]", None,
    )  # fmt: skip
    if num_top is not None and not wanted:
        raise _fail("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (num_top or 0) if wanted else None


def chat_response(
    request_id: str, created: int, model: str, choices: list[Choice], usage: dict[str, int],
    kv_transfer_params: dict[str, Any] | None, extra: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The whole (non-streamed) response."""
    bodies = [choice_body(c, {"message": {"role": "assistant", "content": c.text}}) for c in choices]
    return whole_response(request_id, "chat.completion", created, model, bodies, usage, kv_transfer_params, extra)


def chat_chunk(request_id: str, created: int, model: str, delta: Choice, is_first: bool) -> dict[str, Any]:
    """One SSE chunk: the content one choice generated since its previous chunk; its first names the role."""
    content = {"role": "assistant", "content": delta.text} if is_first else {"content": delta.text}
    return envelope(request_id, CHAT_COMPLETION_CHUNK, created, model, [choice_body(delta, {"delta": content})])
