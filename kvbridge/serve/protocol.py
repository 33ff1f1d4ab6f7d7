"""The OpenAI-compatible `/v1/completions` wire format: parse a request body, build responses.

Pure functions on plain dicts: the server (serve/api.py) calls `parse_completion_request` on
every POST body and the `*_response` / `*_chunk` builders on the engine's `RequestOutput`s; the
proxy and the demo read the same shapes. Nothing here imports torch or aiohttp.

Non-standard fields, all optional for clients:
  request: `top_k`, `stop_token_ids`, `ignore_eos`, `repetition_penalty`, `min_tokens`, `kv_transfer_params`;
  response: `choices[i].token_ids`, top-level `kv_transfer_params`, and a `kvbridge` dict with
  per-request cache and transfer figures (see `kvbridge_stats`).

Every value is range-checked here or in `SamplingParams` (400 naming the field); what needs the
model (token ids < vocabulary size, lengths within max_model_len) is checked by the engine's
`add_request`, also as a 400. The limits are listed in docs/serving.md.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.sampling_params import MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID, SamplingParams
from kvbridge.errors import InvalidRequestError, SamplingParamsError
from kvbridge.kv_transfer_params import parse_handoff, parse_handoff_inbox, parse_remote_prefill
from kvbridge.serve.logprobs import MAX_COMPLETION_LOGPROBS
from kvbridge.serve.stop_strings import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

DEFAULT_MAX_TOKENS = 16  # OpenAI's default
MAX_CHOICES = 16  # per request: n times the prompts, each choice an engine request of its own
# Fields OpenAI (or vLLM) defines that kvbridge cannot honour, why, and the values that ask for
# nothing (the defaults clients send): any other value is a 400 naming the field, never ignored.
NOT_ASKED = (None, False, 0, "", [], {})
UNSUPPORTED_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "echo": ("kvbridge does not echo the prompt", NOT_ASKED),
    "best_of": ("kvbridge does not rank candidates; ask for n choices instead", (None, 1)),
    "suffix": ("kvbridge does not insert text", NOT_ASKED),
    "logit_bias": ("kvbridge's sampler takes no logit bias", NOT_ASKED),
}
# A body is at most 3 levels deep (object, prompt list, token-id list); kv_transfer_params a few more.
MAX_JSON_DEPTH = 32

# Values quoted in error messages are cut short: a client's 8 MB list is not sent back to it.
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxdict, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 2, 6, 4, 60, 60, 40


def _fail(message: str, param: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # Never math.isfinite(an int): past float range it raises OverflowError.
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer past float range: the range check refuses it, naming the field
        return math.inf


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= MAX_TOKEN_ID


def _nests_deeper_than(value: Any, limit: int) -> bool:
    """Level by level, so a deep value cannot exhaust the stack of what checks it."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        deeper: list[Any] = []
        for item in level:
            children = item.values() if isinstance(item, dict) else item
            deeper += [child for child in children if isinstance(child, (dict, list))]
        if not deeper:
            return False
        level = deeper
    return True


def decode_body(raw: bytes) -> Any:
    """Decode a request body (UTF-8, -16 or -32 JSON). Raises InvalidRequestError for anything else,
    including numbers of over 4,300 digits and nesting deeper than MAX_JSON_DEPTH."""
    too_deep = f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep"
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _fail(too_deep) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int past Python's digit limit
        raise _fail(f"the request body is not valid JSON: {_BRIEF.repr(str(exc))}") from None
    # Fewer '[' and '{' bytes than the limit (in any of the encodings) cannot nest deeper: the walk,
    # slower than json.loads itself over a 4M-entry list, only runs when it could find something.
    num_brackets = raw.count(b"[") + raw.count(b"{")
    if num_brackets > MAX_JSON_DEPTH and _nests_deeper_than(body, MAX_JSON_DEPTH):
        raise _fail(too_deep)
    return body


def _parse_one_prompt(prompt: Any) -> Prompt | None:
    """A non-empty string or a non-empty list of token ids; None for anything else."""
    if isinstance(prompt, str) and prompt:
        return Prompt(prompt, None)
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return Prompt(None, list(prompt))
    return None


def _parse_prompts(prompt: Any) -> list[Prompt]:
    """A string, a list of token ids, or a list of up to MAX_CHOICES of either."""
    if isinstance(prompt, str) and not prompt:
        raise _fail("'prompt' is empty; send at least one character or token id", "prompt")
    if (one := _parse_one_prompt(prompt)) is not None:
        return [one]
    if isinstance(prompt, list) and 0 < len(prompt) <= MAX_CHOICES and all(isinstance(p, (str, list)) for p in prompt):
        prompts = [_parse_one_prompt(p) for p in prompt]
        if None not in prompts:
            return prompts
    raise _fail(
        "'prompt' must be a non-empty string, a non-empty list of token ids (integers from 0 to the "
        f"vocabulary size - 1), or a list of up to {MAX_CHOICES} of those",
        "prompt",
    )


def get_checked(body: dict, name: str, check, expected: str, default: Any, parent: str | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        path = f"{parent}.{name}" if parent else name
        raise _fail(f"'{path}' must be {expected}, got {_BRIEF.repr(value)}", parent or name)
    return value


def _is_token_id_list(value: Any) -> bool:
    # Count first: checking 4M entries one by one is the cost the bound exists to avoid.
    return isinstance(value, list) and len(value) <= MAX_STOP_TOKEN_IDS and all(_is_token_id(t) for t in value)


def check_unsupported(body: dict, fields: dict[str, tuple[str, tuple[Any, ...]]]) -> None:
    """Refuse a field that asks for something kvbridge cannot do (400 naming it)."""
    for name, (why, off) in fields.items():
        if body.get(name) not in off:
            raise _fail(f"'{name}' is not supported: {why}; leave it out", name)


def _parse_stop(value: Any) -> tuple[str, ...]:
    """`stop`: a string or a list of strings (OpenAI's form)."""
    stop = [value] if isinstance(value, str) else value
    expected = f"a string or a list of at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_STRING_CHARS} characters"
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stop)
    ):
        raise _fail(f"'stop' must be {expected}, got {_BRIEF.repr(value)}", "stop")
    return tuple(stop)


class CommonFields(NamedTuple):
    """The fields /v1/completions and /v1/chat/completions share, validated."""

    model: str | None
    sampling_params: SamplingParams
    n: int  # choices: engine requests of the same prompt
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None


class Prompt(NamedTuple):
    """One prompt: exactly one of `text` / `token_ids` is set."""

    text: str | None
    token_ids: list[int] | None


@dataclass(frozen=True)
class CompletionRequest:
    """A validated `/v1/completions` body: one prompt or several (each answered by `n` choices)."""

    prompts: list[Prompt]
    fields: CommonFields

    @property
    def prompt_text(self) -> str | None:
        """The first prompt's text (the proxy routes a request by its first prompt)."""
        return self.prompts[0].text

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return self.prompts[0].token_ids


def parse_common_fields(
    body: dict, max_tokens_field: str = "max_tokens", default_max_tokens: int = DEFAULT_MAX_TOKENS,
    num_logprobs: int | None = None,
) -> CommonFields:  # fmt: skip
    """Sampling, stop strings, streaming and P/D fields; `num_logprobs` is what the route's own logprobs
    fields asked for (SamplingParams.logprobs). Raises InvalidRequestError naming the bad field."""
    n = get_checked(body, "n", lambda v: _is_int(v) and 1 <= v <= MAX_CHOICES, f"an integer in [1, {MAX_CHOICES}]", 1)
    model = get_checked(body, "model", lambda v: isinstance(v, str), "a string", None)
    max_tokens = get_checked(body, max_tokens_field, _is_int, "an integer >= 1", default_max_tokens)
    temperature = get_checked(body, "temperature", _is_number, "0 or a number in [0.01, 100]", 1.0)
    top_p = get_checked(body, "top_p", _is_number, "a number in (0, 1]", 1.0)
    top_k = get_checked(body, "top_k", _is_int, "an integer >= 0 (0 or -1 for no cut)", 0)
    seed = get_checked(body, "seed", _is_int, "an integer in [0, 2**64 - 1]", None)
    stop_token_ids = get_checked(
        body, "stop_token_ids", _is_token_id_list, f"a list of at most {MAX_STOP_TOKEN_IDS} token ids", []
    )
    presence_penalty = get_checked(body, "presence_penalty", _is_number, "a number in [-2, 2]", 0.0)
    frequency_penalty = get_checked(body, "frequency_penalty", _is_number, "a number in [-2, 2]", 0.0)
    repetition_penalty = get_checked(body, "repetition_penalty", _is_number, "a number in [0.01, 100] (1: none)", 1.0)
    min_tokens = get_checked(body, "min_tokens", _is_int, "an integer in [0, max_tokens]", 0)
    stop = () if body.get("stop") is None else _parse_stop(body["stop"])
    ignore_eos = get_checked(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False)
    stream = get_checked(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    stream_options = get_checked(body, "stream_options", lambda v: isinstance(v, dict), "a JSON object", {})
    include_usage = get_checked(
        stream_options, "include_usage", lambda v: isinstance(v, bool), "true or false", False, "stream_options"
    )
    kv_transfer_params = get_checked(body, "kv_transfer_params", lambda v: isinstance(v, dict), "a JSON object", None)
    if n > 1 and kv_transfer_params:
        raise _fail("'n' must be 1 with kv_transfer_params: a P/D hand-off moves one request's KV", "n")
    try:
        parse_remote_prefill(kv_transfer_params)  # a bad P/D hand-off is the client's error, not a mid-step one
        parse_handoff_inbox(kv_transfer_params)  # checks the key too
        parse_handoff(kv_transfer_params)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param="kv_transfer_params") from None
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_float(temperature),
            top_p=_float(top_p),
            top_k=0 if top_k == -1 else top_k,
            seed=seed,
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=ignore_eos,
            presence_penalty=_float(presence_penalty),
            frequency_penalty=_float(frequency_penalty),
            repetition_penalty=_float(repetition_penalty),
            min_tokens=min_tokens,
            logprobs=num_logprobs,
        )
    except SamplingParamsError as exc:
        param = max_tokens_field if exc.field == "max_tokens" else exc.field
        message = str(exc).replace("SamplingParams.max_tokens", param).replace("SamplingParams.", "")
        raise _fail(message, param) from None
    return CommonFields(model, params, n, stop, stream, include_usage, kv_transfer_params)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded JSON body. Raises InvalidRequestError (HTTP 400) naming the bad field."""
    if not isinstance(body, dict):
        raise _fail("the request body must be a JSON object")
    if "prompt" not in body:
        raise _fail("'prompt' is required", "prompt")
    check_unsupported(body, UNSUPPORTED_FIELDS)
    prompts = _parse_prompts(body["prompt"])
    num_logprobs = get_checked(
        body, "logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_COMPLETION_LOGPROBS,
        f"an integer in [0, {MAX_COMPLETION_LOGPROBS}] (alternatives per token), or null for none", None,
    )  # fmt: skip
    fields = parse_common_fields(body, num_logprobs=num_logprobs)
    if len(prompts) > 1 and fields.kv_transfer_params:
        raise _fail("send one prompt with kv_transfer_params: a P/D hand-off moves one request's KV", "prompt")
    if len(prompts) * fields.n > MAX_CHOICES:
        raise _fail(f"{len(prompts)} prompts times n={fields.n} choices exceed {MAX_CHOICES} per request", "n")
    return CompletionRequest(prompts, fields)


def error_body(message: str, err_type: str = "invalid_request_error", code: int = 400, param: str | None = None) -> dict:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def finish_reason(output: RequestOutput) -> str | None:
    return output.outputs[0].finish_reason if output.outputs else None


def external_kv_bytes(num_external_tokens: int, block_size: int, block_nbytes: int) -> int:
    """Bytes of KV a request loaded through its connector: whole blocks move, so a partly filled
    last block counts in full (local prefix-cache hits are whole blocks, so external runs start
    on a block boundary)."""
    return -(-num_external_tokens // block_size) * block_nbytes


def kvbridge_stats(
    output: RequestOutput, timings: dict[str, float], block_size: int = 0, block_nbytes: int = 0
) -> dict[str, Any]:
    """The non-standard per-request figures: cache hits, tokens and bytes loaded from a peer, timings."""
    stats: dict[str, Any] = {
        "num_cached_tokens": output.num_cached_tokens,
        "num_external_tokens": output.num_external_tokens,
        "num_failed_load_blocks": getattr(output, "num_failed_load_blocks", 0),  # a connector's load failed ...
        "kv_load_error": getattr(output, "kv_load_error", None),  # ... and why, as the connector said
        "kv_external_source": getattr(output, "kv_external_source", None),  # "peer", "host_tier", "disk_tier"
        "kv_transfer_bytes": (
            external_kv_bytes(output.num_external_tokens, block_size, block_nbytes) if block_size else 0
        ),
        **{k: round(v, 6) for k, v in timings.items()},
    }
    transfer = getattr(output, "kv_transfer_stats", None)  # per-request stats, if the engine reports them
    if transfer:
        stats["kv_transfer"] = transfer
    return stats


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    """OpenAI's token counts. Each prompt counts once (the n choices of one prompt share it)."""
    total = num_prompt_tokens + num_completion_tokens
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens, "total_tokens": total}


class Choice(NamedTuple):
    """A choice as the client sees it (stop strings cut off), or what a chunk adds to it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None  # already in the route's shape (serve/logprobs.py)


def choice_body(choice: Choice, content: dict[str, Any]) -> dict[str, Any]:
    """One entry of `choices`, in either route's response or chunk: `content` is the route's own part
    (`text`, or chat's `message` / `delta`)."""
    return {
        "index": choice.index,
        **content,
        "token_ids": choice.token_ids,
        "finish_reason": choice.finish_reason,
        "logprobs": choice.logprobs,
    }


def envelope(request_id: str, obj: str, created: int, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """What every response and chunk of both routes starts with."""
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}


def whole_response(
    request_id: str, obj: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, int],
    kv_transfer_params: dict[str, Any] | None, extra: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """A non-streamed response of either route."""
    body = envelope(request_id, obj, created, model, choices)
    return {**body, "usage": usage, "kv_transfer_params": kv_transfer_params, "kvbridge": extra}


def completion_response(
    request_id: str, created: int, model: str, choices: list[Choice], usage: dict[str, int],
    kv_transfer_params: dict[str, Any] | None, extra: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The whole (non-streamed) response."""
    bodies = [choice_body(c, {"text": c.text}) for c in choices]
    return whole_response(request_id, "text_completion", created, model, bodies, usage, kv_transfer_params, extra)


def completion_chunk(request_id: str, created: int, model: str, delta: Choice, is_first: bool) -> dict[str, Any]:
    """One SSE chunk: the text and token ids one choice generated since its previous chunk."""
    return envelope(request_id, "text_completion", created, model, [choice_body(delta, {"text": delta.text})])


def usage_chunk(request_id: str, created: int, model: str, chunk_object: str, usage: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {**envelope(request_id, chunk_object, created, model, []), "usage": usage}
